"""DCP's default save planner, with its plans reused while the state's structure is the same.

``DefaultSavePlanner`` builds one ``WriteItem`` per tensor (its chunk, its properties) for the
local plan, then on the coordinator the global plan (de-duplication, validation, the metadata)
from every rank's plan: ~60-70 µs per item on the caller's thread, at every save (0.5 s for a
state of 8,000 tensors, 7 s for 100,000), whatever the storage writer.
:class:`SteadySavePlanner` keeps its plans of the last few structures (:mod:`._recent`:
Accelerate saves each model and optimizer through one writer):

* **local**: a rank whose flattened state has the same keys, in the same order, with the same
  flattening, each plain tensor of the same dtype, size, layout, ``requires_grad`` and pinning,
  each ``DTensor`` of the same spec (mesh, placements, global shape) over a local shard of the
  same facts (:mod:`._dtensor_items`), and each other value still a non-tensor, proposes the
  same items, so it returns its last local plan (the tensors' facts checked by torch's
  compiled check where it can tell, :mod:`stagesave.saving.tensor_guard`, else read in
  Python: ~2 µs per tensor). A state holding anything else (ShardedTensors, other tensor
  subclasses, a ``DTensor`` with ``Partial`` placements) has its local plan made by
  ``DefaultSavePlanner`` each time.
* **global**: a coordinator that receives the same local plans from every rank as last time
  (compared by value: ranks send theirs through a collective) returns its last global plan and a
  copy of its last metadata, skipping de-duplication and validation.

Two more of DCP's per-item costs go at every save: the state is flattened in one pass, and
flattened again for ``ShardedTensor`` s only when it holds one (:mod:`._flatten`: the same flat
state and mappings, ~0.7 s less per save at 100,000 tensors); and ``resolve_data`` of a plain
tensor's item takes it from the flat state directly (DCP's lookup checks its chunk offset and
type through abstract classes, ~2 µs per item), unless a subclass changed how objects are looked
up or transformed.

The plans are DCP's own; nothing else changes (the collectives still run, each rank still
resolves every item from the state at hand). :func:`stagesave.dcp.save` goes further once every
rank's structure is a kept one: the ranks exchange the global plan's name instead of the plans
(:mod:`._exchange`, with :meth:`SteadySavePlanner.steady_token` and
:meth:`SteadySavePlanner.kept_global`). Unlike DCP's ``enable_plan_caching``, nothing is
skipped in the exchange, so the storage writer's per-save plan data (``StagedStorageWriter``'s
save id and staging folder) is fresh at every save.
"""

from __future__ import annotations

import dataclasses
import io
import secrets
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ..saving import tensor_guard
from ._dtensor_items import local_shard
from ._flatten import Flat, fast_flatten_usable, flatten, outline
from ._rank_guard import Shape, Vouched
from ._recent import Recent
from ._signature import facts as _facts
from ._signature import signature as _signature

__all__ = ["ItemsToken", "SteadySavePlanner"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclasses.dataclass(frozen=True)
class ItemsToken:
    """Names one global plan made by a :class:`SteadySavePlanner`, and the rank its plan is for
    (in that plan's ``planner_data``, which DCP reads no more once the global plan is made):
    given again with a reused global plan, it tells the rank that its items are those it was
    given with it before (:meth:`SteadySavePlanner.finish_plan` then gives the storage writer
    that list, whose tensors' places the planner knows, instead of the equal one DCP
    unpickled)."""

    value: str
    rank: int


@dataclasses.dataclass
class _Local:
    """A local plan and what it was made from."""

    keys: list[Any]
    facts: list[Any]
    guard: tensor_guard.Guard | None
    mappings: dict[str, Any]
    plan: SavePlan
    #: the items a save of this structure resolved (a writer's list, held), per item the
    #: position of its tensor among the state's plain tensors (``-1``: resolved by DCP's rule),
    #: whether every tensor item has one, the items in short (:class:`._rank_guard.Shape`),
    #: and the items resolved by DCP's rule
    resolved: tuple[Sequence[WriteItem], list[int] | None, bool, Shape | None,
                    list[int]] | None = None
    #: the name of the global plan this local plan was last part of (:class:`ItemsToken`)
    token: ItemsToken | None = None


def _name(plans: list[SavePlan]) -> str | None:
    """The name a :class:`SteadySavePlanner` gave a global plan (``None``: none)."""
    data = plans[0].planner_data if plans else None
    return data.value if type(data) is ItemsToken else None


class SteadySavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that reuses its last local and global plans for an unchanged
    state structure (see the module's docstring). One instance per writer, reused across saves
    (:attr:`.StagedStorageWriter.planner`, which :func:`stagesave.dcp.save` uses by default)::

        dcp.save(state, checkpoint_id=path, storage_writer=writer, planner=writer.planner)

    Args:
        **kwargs: ``DefaultSavePlanner`` arguments (``enable_plan_caching`` is refused: it skips
            the plan exchange that carries each save's storage data).

    Raises:
        ValueError: ``enable_plan_caching=True``.
    """

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("enable_plan_caching"):
            raise ValueError(
                "SteadySavePlanner does not take enable_plan_caching=True: it reuses plans "
                "itself, without skipping the exchange StagedStorageWriter needs"
            )
        super().__init__(**kwargs)
        self._locals: Recent[_Local] = Recent()
        self._globals: Recent[tuple[list[SavePlan], list[SavePlan], Metadata]] = Recent()
        #: Items resolved by position only by this class itself: a subclass may change the
        #: state after planning (its methods run between the plan and the writer's resolve).
        self._positional = type(self) is SteadySavePlanner
        kind = type(self)  # looks objects up and transforms them as DCP's default does
        self._plain_lookup = (kind.lookup_object is DefaultSavePlanner.lookup_object
                              and kind.transform_object is DefaultSavePlanner.transform_object)
        #: Set up for a save its writer has not begun yet (:class:`.StagedStorageWriter` makes
        #: the first save's staging buffer from :attr:`state_dict` then, and clears it).
        self.set_up_pending = False
        self.reused_local = 0  # saves that reused the local / the global plan (telemetry, tests)
        self.reused_global = 0
        self.resolved_by_place = 0  # saves whose items were resolved by their tensors' places
        #: (token, items) of the global plans recently given to this rank (one per structure)
        self._given: Recent[tuple[ItemsToken, list[WriteItem]]] = Recent()
        #: this save's local plan entry and plain tensors (None: its local plan is DCP's alone)
        self._local: _Local | None = None
        self._tensors: list[torch.Tensor] | None = None
        #: (structure, flat keys, mappings) of recent states (:func:`._flatten.outline`)
        self._outlines: Recent[tuple[list[Any], list[str], dict[str, Any]]] = Recent()

    def _flatten(self, state_dict: dict[str, Any]) -> Flat | None:
        """:func:`._flatten.flatten` of ``state_dict``, or a kept flattening of the same
        structure paired with its leaves (the flat keys are then the kept string objects, so
        the signature's comparison meets each key by identity)."""
        # by this class only: a subclass may change its mappings in place, which are shared
        shape = outline(state_dict) if self._positional else None
        if shape is not None:
            structure, leaves = shape
            known = self._outlines.find(lambda e: e[0] == structure)
            if known is not None:
                return dict(zip(known[1], leaves)), known[2], False
        flat = flatten(state_dict)
        if flat is not None and shape is not None and not flat[2]:
            self._outlines.add((shape[0], list(flat[0]), flat[1]))
        return flat

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        flat = (self._flatten(state_dict) if self.flatten_state_dict and fast_flatten_usable()
                else None)
        if flat is None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            self.set_up_pending = True
            return
        state, mappings, sharded = flat
        # DCP's own set-up on the flat state: it flattens nothing more (ShardedTensors only
        # when there are some), and does whatever else this torch's version does
        flags = self.flatten_state_dict, self.flatten_sharded_tensors
        self.flatten_sharded_tensors = flags[1] and sharded
        self.flatten_state_dict = False
        try:
            super().set_up_planner(state, storage_meta, is_coordinator)
        finally:
            self.flatten_state_dict, self.flatten_sharded_tensors = flags
        self.mappings = mappings
        self.set_up_pending = True

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        index = write_item.index
        if write_item.type is WriteItemType.TENSOR and self._plain_lookup:
            obj: Any = self.state_dict.get(index.fqn)
            if type(obj) in _PLAIN:
                offset = index.offset
                if offset is None or (len(offset) == obj.dim() and not any(offset)):
                    return obj  # type: ignore[no-any-return]  # DCP's answer for a plain tensor
        return super().resolve_data(write_item)

    def resolve_items(self, items: Sequence[WriteItem]) -> list[Any]:
        """:meth:`resolve_data` of each item, in order (one call for a whole rank file).

        The items of a reused local plan's structure, given again as the same list (a rank given
        the same global plan again gets the list it was given before: :class:`ItemsToken`), are
        resolved by position (from the second time the list comes; by this class only, not a
        subclass): the plain tensors its last resolution took directly are this
        save's tensors at the same places among the state's plain tensors (the local plan was
        reused because the state has the same keys, in the same order, each plain tensor where
        it was, with the same dimensions)."""
        if not self._plain_lookup or type(self).resolve_data is not SteadySavePlanner.resolve_data:
            return [self.resolve_data(item) for item in items]
        resolve = super().resolve_data
        local, tensors = (self._local, self._tensors) if self._positional else (None, None)
        known = local.resolved if local is not None else None
        if known is not None and known[0] is items and known[1] is not None and (
                tensors is not None):
            self.resolved_by_place += 1
            # a place of -1 takes the last tensor here and is resolved by DCP's rule below
            placed: list[Any] = list(map(tensors.__getitem__, known[1])) if tensors else [
                None] * len(items)
            for i in known[4]:
                placed[i] = resolve(items[i])
            return placed
        if local is not None and (known is None or known[0] is not items):
            local.resolved = (items, None, False, None, [])  # places made if it comes back
            local = None
        state, plain = self.state_dict, _PLAIN
        tensor, shard, byte_io = WriteItemType.TENSOR, WriteItemType.SHARD, WriteItemType.BYTE_IO
        at = self._positions() if local is not None else {}
        out: list[Any] = []
        places: list[int] = []
        note, place = out.append, places.append
        for item in items:
            if item.type is tensor:
                index = item.index
                obj: Any = state.get(index.fqn)
                if type(obj) in plain:
                    offset = index.offset
                    if offset is None or (len(offset) == obj.dim() and not any(offset)):
                        note(obj)
                        place(at.get(index.fqn, -1))
                        continue
            elif item.type is shard and (shard_data := local_shard(
                    state.get(item.index.fqn))) is not None:
                note(shard_data)  # DCP's answer is to_local(), a view of it
                place(at.get(item.index.fqn, -1))
                continue
            note(resolve(item))
            place(-1)
        if local is not None:
            local.resolved = (items, places, all(
                p >= 0 or item.type is byte_io for item, p in zip(items, places)), Shape(items),
                [i for i, p in enumerate(places) if p < 0])
        return out

    def vouch(self, items: Sequence[WriteItem]) -> Vouched:
        """What this save's own checks of its state tell about ``items``' tensors, once
        :meth:`resolve_items` resolved them: whether every tensor item's data is one of the
        state's plain tensors as :func:`._signature.signature` found them (each strided, not nested:
        :func:`~stagesave.saving.tensor_guard.checkable`), then the compiled check those
        tensors passed in this save (``None``: none), whose facts are theirs now, and the
        items in short kept with their places (``None``: none yet)."""
        local = self._local if self._positional else None
        known = local.resolved if local is not None else None
        if (local is None or known is None or known[0] is not items or known[1] is None
                or self._tensors is None):
            return False, None, None
        return known[2], local.guard if known[2] else None, known[3]

    def _positions(self) -> dict[str, int]:
        """Each plain tensor's key -> its place among this save's plain tensors (as
        :func:`._signature.signature` found them)."""
        local = self._local
        assert local is not None
        tensor_keys = [k[0] for k in local.keys[1:] if type(k) is tuple and len(k) in (2, 3)]
        return {fqn: i for i, fqn in enumerate(tensor_keys)}

    def _kept_local(self) -> tuple[list[Any], list[torch.Tensor], list[Any], _Local | None] | None:
        """This save's keys and plain tensors, their facts if they were read in Python (else
        empty), and the kept local plan of the same structure, if any; ``None`` when the state's
        local plan is DCP's alone (:func:`._signature.signature`)."""
        signature = _signature(self.state_dict, self.is_coordinator)
        self._local = self._tensors = None
        if signature is None:
            return None
        keys, tensors = signature
        mappings = self.mappings
        facts: list[list[Any]] = []  # read in Python once, if a comparison needs them

        def same(e: _Local) -> bool:
            if e.keys != keys or (e.mappings is not mappings and e.mappings != mappings):
                return False
            if e.guard is not None and e.guard.same(tensors):
                return True
            if not facts:
                facts.append(_facts(tensors))
            if e.facts != facts[0]:
                return False
            if e.guard is not None:  # it said otherwise: made again, as torch sees them now
                e.guard = tensor_guard.build(tensors)
            return True

        return keys, tensors, facts[0] if facts else [], self._locals.find(same)

    def create_local_plan(self) -> SavePlan:
        kept = self._kept_local()
        if kept is None:
            return super().create_local_plan()
        keys, tensors, facts, known = kept
        if known is not None:
            self.plan = known.plan
            self.reused_local += 1
        else:
            known = _Local(keys, facts or _facts(tensors), tensor_guard.build(tensors),
                           self.mappings if self._positional else dict(self.mappings),
                           super().create_local_plan())
            self._locals.add(known)
        self._local, self._tensors = known, tensors
        return known.plan

    def steady_token(self) -> ItemsToken | None:
        """For :mod:`._exchange`, after :meth:`set_up_planner`: the name of the global plan
        this save's local plan was last part of, when the state's structure is a kept one and
        this rank still holds the items it was given with that name; ``None`` otherwise (then
        nothing is made or counted: ``dcp.save`` plans as usual). By this class only."""
        if not self._positional:
            return None
        kept = self._kept_local()
        known = kept[3] if kept is not None else None
        token = known.token if known is not None else None
        if kept is None or known is None or token is None or (
                self._given.find(lambda e: e[0] == token) is None):
            return None
        self._local, self._tensors = known, kept[1]
        self.plan = known.plan
        return token

    def kept_global(self, name: str) -> tuple[list[SavePlan], Metadata] | None:
        """For :mod:`._exchange`, on the coordinator: its kept global plan of that name and a
        copy of that plan's metadata (counted as a reused global plan); ``None``: not kept."""
        known = self._globals.find(lambda e: _name(e[1]) == name)
        if known is None:
            return None
        self.reused_global += 1
        self.global_plan = list(known[1])
        self.metadata = dataclasses.replace(known[2])
        return self.global_plan, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """DCP's, with this rank's items as the list it was given before when the coordinator's
        steady planner says they are the same (:class:`ItemsToken`): DCP hands every rank an
        unpickled copy of its plan at every save, and the places of the items' tensors are known
        for the list kept (one per recent structure). A subclass keeps the items it is given."""
        token = new_plan.planner_data
        if self._positional and type(token) is ItemsToken:
            known = self._given.find(lambda e: e[0] == token)
            if known is not None:
                new_plan = dataclasses.replace(new_plan, items=known[1])
            else:
                self._given.add((token, new_plan.items))
            if self._local is not None:
                self._local.token = token
        return super().finish_plan(new_plan)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        known = self._globals.find(lambda e: e[0] == all_plans)
        if known is not None:
            global_plan, metadata = known[1], known[2]
            self.reused_global += 1
        else:
            global_plan, metadata = super().create_global_plan(all_plans)
            # each rank's plan names this global plan and the rank (ItemsToken, in planner_data,
            # which DCP merged into the metadata above and reads no more): a rank given the same
            # token again knows its items are the ones it was given with it before
            # (by this class only: a subclass's own use of planner_data stays as DCP leaves it)
            if self._positional:
                name = secrets.token_hex(16)
                global_plan = [dataclasses.replace(plan, planner_data=ItemsToken(name, rank))
                               for rank, plan in enumerate(global_plan)]
            self._globals.add((list(all_plans), global_plan, metadata))
        # the storage writer fills in storage data and meta: a copy, the kept one stays as made
        self.global_plan = list(global_plan)
        self.metadata = dataclasses.replace(metadata)
        return self.global_plan, self.metadata
