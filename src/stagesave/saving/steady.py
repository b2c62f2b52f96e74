"""The steady state: a plan reused while the structure of the state stays the same.

A training loop saves the same structure again and again: the same keys, the same tensors at
the same addresses with the same shapes, only the bytes inside the tensors and a few numbers
(the step, the epoch, a learning rate) differ. Planning from scratch costs ~10 µs per tensor
(:mod:`.fastplan`), which dominates the save of a state of thousands of small tensors. A
:class:`PlanCache` plans the first save as usual and keeps a **template** of it:

* the pickle, cut where each volatile leaf (an exact ``int``, ``float``, ``bool``, ``None`` or
  ``str`` value) sits, so that each save splices its own values in (:mod:`.splice`);
* the image of the file around the pickle (records, central directory, slots, the index) and
  the host copies of the storages.

A later save walks the state once (:mod:`.walk`) and reuses the template when the structure is
the same (the tensors' facts checked by torch's compiled check where it proved itself,
:mod:`.tensor_guard`, else read in Python). Aliasing (which tensors share a storage) follows
from each tensor's storage object (``StorageImpl``), compared with the plan's at every save (a
storage replaced at the same data address, or one memory made two storages, has another);
storage sizes and addresses from the tensors' data addresses: when only addresses changed (new
tensors over new storages, as copies made at each save have), the storages are looked at
again, their sizes and sharing checked, and the template is kept with the new addresses.
Anything else (a new key, a new shape, a shared container, a tensor torch pickles
differently, a state the walk does not understand) plans from scratch and makes a new
template (or, with a holder, is held to be planned behind the caller: :mod:`.behind`). The
template holds no tensor: only addresses, used only after the walk of the save at hand found
them again. Tests compare the spliced file with ``torch.save``'s layout after every change.
"""

from __future__ import annotations

import collections
import io
import threading
from collections.abc import Callable, Iterable
from typing import Any

from torch.nn import Parameter

from . import tensor_guard
from .behind import Held, Holder, walk_and_hold
from .fastplan import (
    Framed,
    constants,
    fast_path_enabled,
    image_of,
    index,
    plan,
    planner_setting,
)
from .first_pickle import Facts, first_pickle
from .host_copy import BIG, HostCopies, host_view
from .image import FileImage, StorageSlot, TensorEntry
from .index_json import IndexJson
from .plan import gc_paused, plan_torch_file
from .splice import MAX_LEAVES, Spliced, cut, marked
from .torch_pickler import ELEMENT_SIZE, TorchPickler
from .walk import Fact, Walked, walk
from .ziplayout import Constants, Layout

__all__ = ["MAX_FILES", "PlanCache", "Template"]

#: File names of folder checkpoints whose plans a Checkpointer keeps.
MAX_FILES = 16


def _identity(tensors: list[Any], positions: Iterable[int]) -> list[int]:
    """For each of ``positions``, the first of them holding the same tensor object."""
    first: dict[int, int] = {}
    return [first.setdefault(id(tensors[i]), i) for i in positions]


class Template:
    """A planned state's pickle, cut at its leaves, and its image around it.

    Holds no tensor: only addresses (and views of host memory at them, used only after the
    addresses were checked again).
    """

    def __init__(self, walked: Walked, pieces: list[bytes], order: list[int],
                 pickler: TorchPickler | Facts, tensors: list[TensorEntry]) -> None:
        self.structure = walked.structure
        self.facts = walked.facts
        self.offsets = [f[2] for f in self.facts]
        #: torch's compiled check of the tensors' other facts (``None``: compared in Python)
        self.guard = tensor_guard.build(walked.tensors)
        self.addresses = walked.addresses
        #: per tensor: its storage's own object (``StorageImpl``) when planned
        self.storage_ids = walked.storage_ids
        self.n_containers = len(walked.containers)
        # Which tensors are one object (pickled once, then referred to): with the same
        # addresses only the tensors at addresses held twice need their identities compared.
        self.identity = _identity(walked.tensors, range(len(walked.tensors)))
        self._note_shared()
        self.spliced = Spliced(pieces, order)
        self.index = tensors
        self.index_json = IndexJson()  # its JSON, encoded by the first save's writer
        self.sizes = tuple(int(s.nbytes()) for s in pickler.storages)
        self.counts = (sum(self.sizes), sum(1 for n in self.sizes if n))
        info, param_data = pickler.info, pickler.param_data
        facts = [  # as the pickler saw each tensor: (key, dtype, shape, stride, offset)
            info[id(param_data[id(t)]) if type(t) is Parameter else id(t)]
            for t in walked.tensors
        ]
        #: per tensor (walk order): its storage's key and the bytes from the storage's start
        self.key_of = [int(f[0]) for f in facts]
        self.delta = [f[4] * ELEMENT_SIZE[f[1]] for f in facts]
        # per storage: the end of the furthest tensor over it (elements; one dtype per storage)
        reach, esize = [0] * len(self.sizes), [1] * len(self.sizes)
        for k, (_, dtype, shape, stride, offset) in zip(self.key_of, facts):
            if len(shape) == 1 and shape[0]:
                end = offset + (shape[0] - 1) * stride[0] + 1
            elif len(shape) != 1 and all(shape):
                end = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))
            else:
                continue
            if end > reach[k]:
                reach[k], esize[k] = end, ELEMENT_SIZE[dtype]
        #: storages not covered to their end by the tensors over them: sizes checked each save
        self.loose = [(i, k) for i, k in enumerate(self.key_of)
                      if reach[k] * esize[k] < self.sizes[k]]
        #: per storage: its host address (every tensor is in host memory: see _new_template)
        self.starts = [a or 0 for a in pickler.addresses]
        self.frame: Framed | None = None
        self.layout: Layout | None = None
        self.slots: list[StorageSlot] = []
        self.copies: HostCopies | None = None
        self.where: list[int | None] = []  # per storage: its entry in copies.small or .big

    def slots_for(self, layout: Layout) -> list[StorageSlot]:
        """``layout``'s storage records at the storages' addresses (made once per layout)."""
        if self.layout is not layout:
            self.layout = layout
            self.slots = [
                StorageSlot(key, rec.data_offset, rec.size, device_type="cpu", address=address)
                for key, rec, address in zip(layout.keys, layout.storage_records, self.starts)
            ]
            self.copies = None
        return self.slots

    def _host_copies(self) -> HostCopies:
        """The copies of :attr:`slots` (made on the second save: the first copies each storage
        once anyway, views of host memory would cost it ~1 µs per storage more)."""
        if self.copies is None:
            self.copies = HostCopies()
            self.where = [None] * len(self.slots)
            for k, slot in enumerate(self.slots):
                self._place(k, slot)
        return self.copies

    def _place(self, k: int, slot: StorageSlot) -> None:
        """Put storage ``k``'s copy into :attr:`copies` (where it was, if it was)."""
        assert self.copies is not None
        n, address, at = slot.nbytes, self.starts[k], self.where[k]
        if not n:
            return
        if n >= BIG:
            big = self.copies.big
            if at is None:
                self.where[k], at = len(big), len(big)
                big.append((0, 0, 0))
            big[at] = (slot.offset, address, n)
        else:
            small = self.copies.small
            if at is None:
                self.where[k], at = len(small), len(small)
                small.append((0, memoryview(b"")))
            small[at] = (slot.offset, host_view(address, n))

    def matches(self, walked: Walked) -> bool:
        """Whether ``walked`` has this structure (the addresses updated if only they moved)."""
        if walked.structure != self.structure:
            return False
        if len(set(walked.containers)) != self.n_containers:
            return False  # a container shared where the template had two equal ones
        if not self._same_facts(walked):
            return False
        tensors = walked.tensors
        for i, k in self.loose:
            if tensors[i].untyped_storage().nbytes() != self.sizes[k]:
                return False
        if walked.storage_ids != self.storage_ids and not self._restored(walked):
            return False
        if walked.addresses != self.addresses:
            return self._moved(walked, walked.addresses)
        return not self.shared or _identity(tensors, self.shared) == self.shared_identity

    def _same_facts(self, walked: Walked) -> bool:
        """Whether every tensor has the template's shape, stride, offset, dtype, ``requires_grad``
        (type: in the structure), by torch's compiled check where it says so, else Python."""
        guard = self.guard
        if guard is not None and guard.same(walked.tensors) and walked.offsets == self.offsets:
            return True
        if walked.facts != self.facts:
            return False
        if guard is not None:  # the same by Python where the check said otherwise (nothing
            # known does that): the check made again, as torch sees the tensors now; a check
            # that cannot be made again is not tried at the next saves
            self.guard = tensor_guard.build(walked.tensors)
        return True

    def _restored(self, walked: Walked) -> bool:
        """Tensors over other storage objects than when planned (replaced, perhaps with their
        data at the same address, or one storage made two over the same memory): the same
        grouping of tensors into storages, each of the same size."""
        ids, key_of, sizes = walked.storage_ids, self.key_of, self.sizes
        pairs = set(zip(ids, key_of))
        if len(pairs) != len(set(ids)) or len(pairs) != len(sizes):
            return False  # tensors of one storage now over two, or of two now over one
        tensors = walked.tensors
        for i in [i for i, (new, old) in enumerate(zip(ids, self.storage_ids)) if new != old]:
            if tensors[i].untyped_storage().nbytes() != sizes[key_of[i]]:
                return False
        self.storage_ids = ids
        return True

    def _note_shared(self) -> None:
        """The positions of tensors at an address another tensor has, and their identities."""
        counts = collections.Counter(self.addresses)
        self.shared = [i for i, a in enumerate(self.addresses) if counts[a] > 1]
        self.shared_identity = [self.identity[i] for i in self.shared]

    def _moved(self, walked: Walked, addresses: list[int]) -> bool:
        """Tensors over new storages: the same aliasing, storages of the same sizes."""
        if _identity(walked.tensors, range(len(walked.tensors))) != self.identity:
            return False  # tensors that are one object now and two before, or the reverse
        starts = list(self.starts)
        changed: set[int] = set()
        seen: dict[int, int] = {}
        sizes, key_of, delta, tensors = self.sizes, self.key_of, self.delta, walked.tensors
        for i, (new, old) in enumerate(zip(addresses, self.addresses)):
            k = key_of[i]
            if not sizes[k]:  # an empty storage: no bytes, no address to agree on, but still
                if new != old and tensors[i].untyped_storage().nbytes():  # empty
                    return False
                continue
            start = new - delta[i]
            if seen.setdefault(k, start) != start:
                return False  # tensors of one storage no longer share it
            if new != old:
                t = tensors[i]
                storage = t.untyped_storage()
                if not t.is_cpu or storage.nbytes() != sizes[k] or storage.data_ptr() != start:
                    return False
                starts[k] = start
                changed.add(k)
        used = [a for k, a in enumerate(starts) if sizes[k]]
        if len(set(used)) != len(used):
            return False  # two storages became one
        self.addresses, self.starts = addresses, starts
        self._note_shared()
        if self.layout is not None:  # new lists: images of earlier saves keep theirs
            self.slots = list(self.slots)
            copies = self.copies
            if copies is not None:
                self.copies = HostCopies(list(copies.small), list(copies.big))
            for k in changed:
                old_slot = self.slots[k]
                self.slots[k] = StorageSlot(old_slot.key, old_slot.offset, old_slot.nbytes,
                                            device_type="cpu", address=starts[k])
                if copies is not None:
                    self._place(k, self.slots[k])
        return True

    def image(self, walked: Walked, consts: Constants) -> FileImage:
        """The image of the state ``walked`` saw (which :meth:`matches` this template)."""
        pkl = self.spliced.pickle(walked.leaves)
        first = self.layout is None
        image, self.frame = image_of(consts, pkl, self.sizes, self.slots_for, self.index,
                                     self.frame)
        if not first:
            image.copies = self._host_copies()
        image.counts = self.counts
        image.index_json = self.index_json
        return image


# ---------------------------------------------------------------------------- the cache
class PlanCache:
    """One Checkpointer's last template (see the module's docstring)."""

    def __init__(self, prepare: Callable[..., None] | None = None) -> None:
        """``prepare`` (:meth:`.StagingMemory.prepare`): given the bounds of a new structure's
        file size (:meth:`.Walked.image_bounds`) before it is planned, to make its buffer."""
        fast_path_enabled()  # the once-per-process check of the planner, before the first save
        self.prepare = prepare
        self._template: Template | None = None
        #: a structure (and its tensors' facts) no template can stand for
        self._refused: tuple[list[Any], list[Fact]] | None = None
        self._files: dict[str, PlanCache] = {}  # per file name of folder checkpoints
        self._lock = threading.Lock()

    def plan(self, state: Any) -> FileImage:  # (nothing holds without a holder)
        return self.plan_or_hold(state, None)  # type: ignore[return-value]

    def plan_or_hold(self, state: Any, holder: Holder | None) -> FileImage | Held:
        """The file image of ``state``, reusing the last plan when the structure is the same;
        with ``holder``, a structure that needs a new plan may be held (:mod:`.behind`).

        Raises:
            UnsupportedObjectError: something in the state cannot be pickled; the message names it.
            ValueError: ``STAGESAVE_PLANNER`` holds something other than ``auto`` or ``torch``.
        """
        if planner_setting() != "auto" or not fast_path_enabled():
            return plan_torch_file(state)
        if not self._lock.acquire(blocking=False):  # another thread of this Checkpointer saves
            held = None if holder is None else walk_and_hold(state, holder)  # (or plans a held
            return held if held is not None else plan(state)  # save): held, or planned alone
        try:
            with gc_paused():
                return self._plan(state, holder)
        finally:
            self._lock.release()

    def adopt(self, fn: Callable[[Template], None]) -> None:
        """``fn(template)`` under the lock (:func:`.behind.repoint`), when there is one."""
        with self._lock:
            if self._template is not None:
                fn(self._template)

    def forget(self) -> None:
        """Drop the templates (their addresses and views of host memory)."""
        self._template = self._refused = None
        self._files.clear()

    def of(self, name: str) -> PlanCache:
        """The cache of the files named ``name`` in folder checkpoints (the most recent
        :data:`MAX_FILES` names are kept)."""
        cache = self._files.pop(name, None) or PlanCache()
        self._files[name] = cache  # the most recently used last
        while len(self._files) > MAX_FILES:
            del self._files[next(iter(self._files))]
        return cache

    def _plan(self, state: Any, holder: Holder | None = None) -> FileImage | Held:
        consts = constants()
        try:
            walked: Walked | None = walk(state)
        except Exception:  # noqa: BLE001 - _Different, RecursionError, an unpicklable object
            walked = None
        template = self._template
        if walked is not None and template is not None and consts is not None and _agrees(
                template, walked):
            return template.image(walked, consts)
        self._template = None
        if walked is not None:
            try:  # every tensor's facts and address, read once for a new plan
                walked.facts  # noqa: B018 - cached properties
                walked.addresses  # noqa: B018
            except Exception:  # noqa: BLE001 - a tensor without them (sparse): no template
                walked = None
        fresh = walked is not None and consts is not None and not _agrees(self._refused, walked)
        if fresh and holder is not None and (held := holder(walked)) is not None:  # type: ignore[arg-type]
            return held  # (before a buffer is made ahead: its lease would wait for that)
        if walked is not None and self.prepare is not None:
            self.prepare(walked.image_bounds)
        if walked is not None and consts is not None and fresh:
            made = self._new_template(state, walked, consts)
            if made is not None:
                return made
            self._refused = walked.structure, walked.facts
        return plan(state)

    def _new_template(self, state: Any, walked: Walked, consts: Constants) -> FileImage | None:
        """Plan ``state`` (its pickle written from the walk, or a marked copy pickled and cut),
        keep the template, return the image (``None``: no template can stand for it)."""
        tensors = walked.tensors
        if (len(walked.leaves) >= MAX_LEAVES or not all(t.is_cpu for t in tensors)
                or len(set(walked.containers)) != len(walked.containers)):
            return None
        written = first_pickle(state, walked)
        recorded: TorchPickler | Facts
        if written is not None:
            pieces, order, recorded = written
        else:  # something only the pickler writes: a marked copy pickled and cut
            buf = io.BytesIO()
            recorded = pickler = TorchPickler(buf)
            try:
                pickler.dump(marked(state))
            except Exception:  # noqa: BLE001 - Unsupported, or pickling fails: torch.save names why
                return None
            found = cut(buf.getvalue(), len(walked.leaves))
            if found is None or len(pickler.storages) != len(
                {t.untyped_storage()._cdata for t in tensors}
            ):
                return None
            pieces, order = found
        template = Template(walked, pieces, order, recorded, index(state, recorded))
        self._template = template
        return template.image(walked, consts)


def _agrees(known: Template | tuple[list[Any], list[Fact]] | None, walked: Walked) -> bool:
    """Whether ``walked`` matches a template (or equals a refused structure); ``False`` when the
    comparison itself fails (a key whose ``==`` is not a bool, such as a tensor's)."""
    try:
        if isinstance(known, Template):
            return known.matches(walked)
        return known is not None and walked.structure == known[0] and walked.facts == known[1]
    except Exception:  # noqa: BLE001 - plan from scratch, which names real problems
        return False
