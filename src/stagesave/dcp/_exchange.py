"""A steady sharded save that exchanges the plans' names instead of the plans.

Under a process group, ``dcp.save`` sends every item of a save through four pickled
collectives: each rank's local plan to the coordinator, the global plan back, each rank's write
results to the coordinator, and the global metadata to every rank. On the training thread that
is ~50-80 µs per item (0.5 s of every save of 8,000 tensors on one gloo rank, where the copy
into host memory takes 0.06 s; 7.8 s of one of 100,000), whether or not anything changed. Once
the state's structure is unchanged on every rank the steady planner reuses its plans and each
rank its file's layout, so none of it needs to travel. :func:`steady_save` (called by
:func:`stagesave.dcp.save`) runs the same steps with small messages:

1. Every rank sets the save up as ``dcp.save`` does (the writer's ``reset``, each ``Stateful``'s
   ``state_dict()``, the planner's and the writer's set-up) and tells the coordinator the name
   of the global plan its local plan was last part of (:class:`.ItemsToken`; ``None`` when its
   structure is new or changed, or its planner is not the writer's own steady planner), and the
   mark of the write results it last sent with that name.
2. The coordinator: if every rank names the same global plan and it keeps that plan, the plan
   is this save's; the writer's ``prepare_global_plan`` gives each rank its save data (the
   lease, the staging folder, extra files) as in ``dcp.save``, and each rank gets its save data,
   the name, and whether to send its write results in full. Otherwise every rank runs
   ``dcp.save`` on the state set up in step 1 (nothing is made twice: each ``state_dict()`` is
   called once, the planner's local plan is made by ``dcp.save`` alone).
3. Every rank writes: the planner's ``finish_plan`` gives it the items it was given with that
   name, the writer's ``write_data`` lays out, stages and queues its file, and the rank sends
   its write results, or, where they are the very list it sent before with that name and the
   coordinator holds it, the mark of that list.
4. The coordinator's writer finishes the save (``finish``, with a copy of the kept metadata and
   every rank's results), and every rank learns the outcome.

The collectives are DCP's own (``_DistWrapper``): a failure on any rank raises the same
``CheckpointException`` on every rank as ``dcp.save`` would. The folder is the one ``dcp.save``
writes (the same files, ``.metadata`` with this save's id). What ``dcp.save`` returns (the
metadata, on every rank) is not made. Every rank of the group must call
:func:`stagesave.dcp.save` (step 1 is a collective even where a rank's planner is not eligible).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CheckpointError
from ._steady_planner import ItemsToken, SteadySavePlanner

if TYPE_CHECKING:
    from ._writer import StagedStorageWriter

_DistWrapper: Any
try:  # DCP's collectives with its failure handling (private; without it, dcp.save runs)
    from torch.distributed.checkpoint.utils import _DistWrapper
except ImportError:  # pragma: no cover - another torch
    _DistWrapper = None

__all__ = ["Exchanged", "Outcome", "planned_save", "steady_save"]

#: Names whose write results a writer remembers (a few structures, as the planner keeps).
_NAMES_KEPT = 8


@dataclass(frozen=True)
class _Probe:
    """A rank's step 1: the name of its local plan's last global plan, and the mark of the
    write results it last sent with that name (``None``: none)."""

    token: ItemsToken | None
    sent: str | None


@dataclass(frozen=True)
class _Go:
    """The coordinator's step 2, per rank: its plan (no items: its save data and name)."""

    plan: SavePlan
    full: bool  # send the write results in full


@dataclass(frozen=True)
class _Results:
    """A rank's step 3: its write results, or ``None`` for those sent before with ``mark``."""

    mark: str
    results: list[WriteResult] | None


class Exchanged:
    """What a writer remembers between steady saves, per global plan name: the write results
    this rank sent last (mark, the list itself) and, on the coordinator, every rank's."""

    def __init__(self) -> None:
        self.sent: dict[str, tuple[str, list[WriteResult]]] = {}
        self.received: dict[str, dict[int, tuple[str, list[WriteResult]]]] = {}
        self.saves = 0  # steady saves made this way (tests, telemetry)
        self.by_mark = 0  # of which this rank sent its write results as a mark

    def forget(self) -> None:
        """After a failed save: send every rank's results in full next time (the coordinator
        may not have received those of this save)."""
        self.sent.clear()

    @staticmethod
    def _keep(table: dict[str, Any], name: str, value: Any) -> None:
        table.pop(name, None)
        table[name] = value
        while len(table) > _NAMES_KEPT:
            del table[next(iter(table))]


@dataclass
class Outcome:
    """:func:`steady_save`'s result: the save's handle, or the state set up for a save planned
    from it, and DCP's collectives for :func:`planned_save` (``None``: ``dcp.save`` runs)."""

    handle: Any
    state: dict[str, Any]
    dist: Any = None


def _stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """DCP's ``_stateful_to_state_dict``: each ``Stateful`` value's ``state_dict()``, once."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def steady_save(
    state_dict: dict[str, Any],
    path: Any,
    writer: StagedStorageWriter,
    planner: SavePlanner,
    process_group: dist.ProcessGroup | None,
) -> Outcome:
    """Steps 1-4 above on every rank; ``Outcome.handle`` is ``None`` where ``dcp.save`` must
    run (with ``Outcome.state``).

    Raises:
        torch.distributed.checkpoint.api.CheckpointException: a step failed on some rank
            (raised on every rank).
    """
    if _DistWrapper is None:  # pragma: no cover - another torch
        return Outcome(None, _stateful(state_dict))
    use_dist = dist.is_available() and dist.is_initialized()
    dist_w = _DistWrapper(process_group, use_dist, 0)
    rank, coordinator = dist_w.rank, dist_w.is_coordinator
    ours = type(planner) is SteadySavePlanner and planner is writer.planner
    memory = writer.exchanged
    if path is not None:
        writer.reset(path)

    converted: list[dict[str, Any]] = []

    def probe() -> _Probe:
        # inside the collective: a state_dict() that raises raises on every rank (dcp.save
        # calls them before its first collective, where the other ranks would wait for it)
        state = _stateful(state_dict)
        converted.append(state)
        if not ours:
            return _Probe(None, None)
        assert isinstance(planner, SteadySavePlanner)
        planner.set_up_planner(state, writer.storage_meta(), coordinator)
        token = planner.steady_token()
        if token is None:
            return _Probe(None, None)
        writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
        writer.prepare_local_plan(planner.plan)
        sent = memory.sent.get(token.value)
        return _Probe(token, sent[0] if sent is not None else None)

    metadata: list[Metadata] = []

    def decide(probes: list[_Probe]) -> list[_Go | None]:
        tokens = [p.token for p in probes]
        first = tokens[0]
        if first is None or any(t is None or t.value != first.value or t.rank != r
                                for r, t in enumerate(tokens)):
            return [None] * len(probes)
        assert isinstance(planner, SteadySavePlanner)
        kept = planner.kept_global(first.value)
        if kept is None:
            return [None] * len(probes)
        metadata.append(kept[1])
        plans = writer.prepare_global_plan(
            [SavePlan([], planner_data=token) for token in tokens])
        received = memory.received.get(first.value, {})
        return [_Go(plan, full=p.sent is None or received.get(r, ("",))[0] != p.sent)
                for r, (plan, p) in enumerate(zip(plans, probes))]

    go: _Go | None = dist_w.reduce_scatter("plan", probe, decide)
    state = converted[0]
    if go is None:
        return Outcome(None, state, dist_w if ours and use_dist else None)
    assert isinstance(planner, SteadySavePlanner)
    token = go.plan.planner_data
    assert isinstance(token, ItemsToken)
    name = token.value

    def write() -> _Results:
        final = planner.finish_plan(go.plan)
        if not final.items and final is go.plan:  # pragma: no cover - step 1 checked
            raise CheckpointError("stagesave: this rank lost the items of its kept plan")
        results = writer.write_data(final, planner).value()
        sent = memory.sent.get(name)
        if not go.full and sent is not None and sent[1] is results:
            memory.by_mark += 1
            return _Results(sent[0], None)
        mark = secrets.token_hex(8)
        memory._keep(memory.sent, name, (mark, results))
        return _Results(mark, results)

    def finish(all_results: list[_Results]) -> None:
        known = memory.received.get(name, {})
        lists = []
        for r, res in enumerate(all_results):
            if res.results is None:
                held = known.get(r)
                if held is None or held[0] != res.mark:  # pragma: no cover - step 2 checked
                    raise CheckpointError(
                        f"stagesave: the coordinator does not hold rank {r}'s write results; "
                        "the save was not committed")
                lists.append(held[1])
            else:
                lists.append(res.results)
                known[r] = (res.mark, res.results)
        memory._keep(memory.received, name, known)
        writer.finish(metadata[0], lists)

    dist_w.all_reduce("write", write, finish)
    planner.reused_local += 1
    memory.saves += 1
    return Outcome(writer.last_handle, state)


def planned_save(state: dict[str, Any], writer: StagedStorageWriter, planner: SavePlanner,
                 dist_w: Any) -> None:
    """A save planned from ``state`` (a first save, or a changed structure) on every rank:
    ``dcp.save``'s steps (its ``_save_state_dict``) on the state :func:`steady_save` set up,
    through the same collectives, but the global metadata is not sent back to every rank at
    the end: ``dcp.save`` returns it, :func:`stagesave.dcp.save` does not, and its pickle went
    to every rank in a fourth collective (~13 µs per item: 0.1 s of a first save of 8,000
    tensors, 1-2 s at 100,000).

    Raises:
        torch.distributed.checkpoint.api.CheckpointException: a step failed on some rank
            (raised on every rank).
    """
    coordinator = dist_w.is_coordinator
    made: list[Metadata] = []

    def local_step() -> SavePlan:
        planner.set_up_planner(state, writer.storage_meta(), coordinator)
        writer.set_up_storage_writer(coordinator, rank=dist_w.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_step(all_plans: list[SavePlan]) -> list[SavePlan]:
        plans, metadata = planner.create_global_plan(all_plans)
        made.append(metadata)
        return writer.prepare_global_plan(plans)

    central: SavePlan = dist_w.reduce_scatter("plan", local_step, global_step)

    def write() -> list[WriteResult]:
        results = writer.write_data(planner.finish_plan(central), planner)
        results.wait()
        return results.value()

    def finish(all_results: list[list[WriteResult]]) -> None:
        writer.finish(made[0], all_results)

    dist_w.all_reduce("write", write, finish)
