"""The first save of a structure of many small tensors, planned behind the caller.

Planning a structure from scratch (its pickle, its zip layout, its index, its template) costs
~10–25 µs per tensor: ~2 s for 100,000 tensors, against ~0.1 s to copy their bytes. A
Checkpointer planning behind (``plan_behind``) does not make its caller wait for that: the save
is **held**. The caller copies every storage's bytes into one scratch buffer and keeps the walk
of the state (:mod:`.walk`), which for a state made only of dicts, lists, tuples,
``OrderedDict``\\ s, tensors, numbers, strings and ``None`` (keys of exact ``str``, ``int``,
``bool`` or ``None``) says everything its pickle says: the containers with their keys in order,
each tensor's type, facts and storage, which tensors are one object. The writer thread
rebuilds that state (:meth:`Held.thaw`: the same containers, tensors over the scratch with the
same facts, storage sharing and identities), plans it as any first save, and writes it. Its
template, moved to the real state's addresses and storage objects as they were when held
(:func:`repoint`), then serves the next saves of the real state.

Held: only when planning would cost more than copying (at least :data:`MIN_TENSORS` tensors
averaging under :data:`MEAN_BYTES` per storage, :data:`MAX_BYTES` in all) and the state is of
the kinds above, in host memory, each tensor a leaf or not requiring grad, with no conjugate or
negative bit, one dtype per storage (what ``torch.save`` would refuse, ``save()`` refuses).
Anything else is planned on the caller's time as before.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import ctypes
import mmap
from collections.abc import Callable
from typing import Any

import torch

from .host_copy import HostCopies, copy_in
from .image import StorageSlot
from .plan import gc_paused
from .splice import MAX_LEAVES
from .torch_pickler import ELEMENT_SIZE
from .walk import LEAF, TEXT, Fact, Walked, file_bounds, walk

__all__ = [
    "MAX_BYTES", "MEAN_BYTES", "MIN_TENSORS", "Held", "Holder", "hold", "repoint", "walk_and_hold",
]

#: Fewer tensors than this are planned on the caller's time (a plan of a few milliseconds).
MIN_TENSORS = 2000
#: Storages averaging this many bytes or more: copying costs more than planning.
MEAN_BYTES = 32 << 10
#: A larger state is planned on the caller's time (its scratch copy would double its memory).
MAX_BYTES = 4 << 30

_ALIGN = 64
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_OrderedDict = collections.OrderedDict
_untyped_storage = torch.Tensor.untyped_storage
_DTYPES = frozenset(ELEMENT_SIZE)


class Held:
    """A state as it was when saved: its walk's structure and leaves, its tensors' facts, and
    its storages' bytes in one scratch buffer (see the module's docstring)."""

    def __init__(self, walked: Walked, scratch: mmap.mmap | None, spans: list[tuple[int, int]],
                 storage_of: list[int], identity: list[int] | None, starts: list[int],
                 span: tuple[int, int], bounds: tuple[int, int]) -> None:
        self.structure = walked.structure
        #: where the state's tensors and storages were when held (:func:`repoint`)
        self.addresses, self.storage_ids, self.starts = (walked.addresses, walked.storage_ids,
                                                         starts)
        self.span = span  # the scratch copy's first and last byte + 1 (0, 0: none)
        self.bounds = bounds  # of its file's size (:func:`.walk.file_bounds`)
        self.leaves = walked.leaves
        self.facts: list[Fact] = walked.facts
        self.scratch = scratch  # (None: no bytes at all)
        self.spans = spans  # per storage: (offset in the scratch, bytes)
        self.storage_of = storage_of  # per tensor (walk order): its storage
        self.identity = identity  # per tensor: the first position of the same object (or None)
        #: the bytes of the storages: a lower bound of the file's size
        self.nbytes = sum(n for _, n in spans)
        self.released = False

    def thaw(self) -> Any:
        """The state again: the same containers, tensors over the scratch buffer."""
        if self.released:
            raise RuntimeError("this held state was released")
        view = memoryview(self.scratch if self.scratch is not None else b"")
        storages = [torch.frombuffer(view[o : o + n], dtype=torch.uint8).untyped_storage()
                    if n else torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
                    for o, n in self.spans]
        facts, storage_of, identity = self.facts, self.storage_of, self.identity
        made: list[torch.Tensor] = []

        def tensor(kind: Any) -> torch.Tensor:
            i = len(made)
            if identity is not None and identity[i] != i:
                made.append(made[identity[i]])
                return made[-1]
            shape, stride, offset, dtype, requires_grad, _ = facts[i]
            t = torch.empty((0,), dtype=dtype).set_(storages[storage_of[i]], offset, shape,
                                                     stride)
            if kind is _Parameter:
                t = _Parameter(t, requires_grad=requires_grad)
            elif requires_grad:
                t.requires_grad_(True)
            made.append(t)
            return t

        return rebuild(self.structure, self.leaves, tensor)

    def release(self) -> None:
        """Let go of the scratch buffer (the tensors :meth:`thaw` made keep it while they
        live)."""
        self.scratch, self.released = None, True


#: Holds a save whose structure needs a new plan (:func:`hold`), or declines (``None``).
Holder = Callable[[Walked], "Held | None"]


def walk_and_hold(state: Any, holder: Holder) -> Held | None:
    """``state`` walked and held (``None``: it cannot be, or the walk failed: a plan from
    scratch names the problem)."""
    with gc_paused():
        try:
            return holder(walk(state))
        except Exception:  # noqa: BLE001 - planned from scratch, which names problems
            return None


def rebuild(structure: list[Any], leaves: list[Any], tensor: Callable[[Any], Any]) -> Any:
    """The state a walk of only containers, tensors and leaves recorded (``tensor(kind)``: the
    next tensor, ``kind`` being its type)."""
    root: list[Any] = []
    stack: list[tuple[Any, int, list[Any]]] = [((list, 1), 1, root)]
    pending = iter(leaves)
    for entry in structure[:-1]:  # the last entry: the keys' types
        if entry is _Tensor or entry is _Parameter:
            value = tensor(entry)
        elif entry is LEAF or entry is TEXT:
            value = next(pending)
        else:
            kind = entry[0]
            if kind is dict or kind is _OrderedDict:
                need = len(entry[1]) + (1 if kind is _OrderedDict and entry[2] else 0)
            else:
                need = entry[1]
            if need:
                stack.append((entry, need, []))
                continue
            value = _made(entry, [])
        while True:  # into its container; a container complete goes into its own
            entry, need, items = stack[-1]
            items.append(value)
            if len(items) < need or len(stack) == 1:
                break
            stack.pop()
            value = _made(entry, items)
    return root[0]


def _made(entry: tuple[Any, ...], items: list[Any]) -> Any:
    kind = entry[0]
    if kind is dict:
        return dict(zip(entry[1], items))
    if kind is list:
        return items
    if kind is tuple:
        return tuple(items)
    keys = entry[1]
    made = _OrderedDict(zip(keys, items))
    if entry[2]:  # its attributes (a state_dict's ``_metadata``), walked after its values
        made.__dict__.update(items[len(keys)])
    return made


def _plain(walked: Walked) -> bool:
    """Whether the walk saw only containers, tensors and leaves, keys of exact types."""
    structure = walked.structure
    if len(structure[-1]) != 2:  # the keys' own pickles: a key of another type
        return False
    empty_tuples = structure.count((tuple, 0))
    known = len(walked.tensors) + len(walked.leaves) + len(walked.containers) + empty_tuples
    return len(structure) - 1 == known  # anything else: an object by its own pickle


def hold(walked: Walked, pool: Callable[[], cf.Executor] | None, workers: int,
         ) -> Held | None:
    """The state ``walked`` saw, held (its storages copied now), or ``None`` when it is better
    planned on the caller's time or cannot be rebuilt from its walk (see the module's
    docstring). ``pool``/``workers``: the copy threads sharing the large storages' copies."""
    tensors = walked.tensors
    n = len(tensors)
    if (n < MIN_TENSORS or len(walked.leaves) >= MAX_LEAVES
            or len(set(walked.containers)) != len(walked.containers) or not _plain(walked)
            or not all(t.is_cpu for t in tensors)):
        return None
    facts = walked.facts
    if any(f[5] for f in facts) or not {f[3] for f in facts} <= _DTYPES:
        return None  # a conjugate or negative bit; a dtype the planner does not know
    if any(t.grad_fn is not None for t, f in zip(tensors, facts) if f[4]):
        return None  # a tensor that requires grad and is not a leaf
    index_of: dict[int, int] = {}
    firsts: list[int] = []
    storage_of: list[int] = []
    for i, sid in enumerate(walked.storage_ids):
        k = index_of.get(sid)
        if k is None:
            k = index_of[sid] = len(firsts)
            firsts.append(i)
        storage_of.append(k)
    if len({(k, f[3]) for k, f in zip(storage_of, facts)}) != len(firsts):
        return None  # two dtypes over one storage: torch.save refuses it, on the caller's time
    storages = [_untyped_storage(tensors[i]) for i in firsts]
    sizes = [s.nbytes() for s in storages]
    total = sum(sizes)
    if total > MAX_BYTES or total >= MEAN_BYTES * len(sizes):
        return None
    starts = [s.data_ptr() for s in storages]
    held = [a for a, n in zip(starts, sizes) if n]
    if len(set(held)) != len(held):
        return None  # two storage objects over one memory: torch.save's own check decides
    try:
        return _copied(walked, sizes, starts, storage_of, pool, workers)
    except (OSError, MemoryError):  # no room for the copy: planned on the caller's time
        return None


def _copied(walked: Walked, sizes: list[int], starts: list[int], storage_of: list[int],
            pool: Callable[[], cf.Executor] | None, workers: int) -> Held:
    """The storages (at ``starts``, of ``sizes``) copied into one scratch buffer."""
    spans: list[tuple[int, int]] = []
    moves: list[tuple[int, int, int]] = []
    end = 0
    for start, size in zip(starts, sizes):
        spans.append((end, size))
        if size:
            moves.append((end, start, size))
        end += (size + _ALIGN - 1) // _ALIGN * _ALIGN
    scratch, address = None, 0
    if end:  # anonymous memory: its pages zero and mapped by the copy itself
        scratch = mmap.mmap(-1, end)
        view = memoryview(scratch)
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        copy_in(view, address, HostCopies(big=moves), pool, workers)
        view.release()
    ids = list(map(id, walked.tensors))
    identity = None
    if len(set(ids)) != len(ids):
        first: dict[int, int] = {}
        identity = [first.setdefault(x, i) for i, x in enumerate(ids)]
    return Held(walked, scratch, spans, storage_of, identity, starts, (address, address + end),
                file_bounds(sizes, len(walked.leaves)))


def repoint(template: Any, held: Held) -> None:
    """``template``, planned over ``held``'s scratch copy (:meth:`Held.thaw`), made to stand
    for the state it was copied from: its tensors' addresses and storage objects, its storages'
    starts, as a plan made of that state when it was held would have them (the next save of
    it then matches at once instead of checking every storage again). Nothing when the
    template does not point into the copy (a later save moved it to the state already)."""
    (lo, hi), sizes, key_of = held.span, template.sizes, template.key_of
    if not lo or not all(lo <= a < hi for a, n in zip(template.starts, sizes) if n):
        return
    storage_of = held.storage_of
    starts = list(template.starts)
    for i, k in enumerate(key_of):
        starts[k] = held.starts[storage_of[i]]
    template.starts, template.addresses = starts, held.addresses
    template.storage_ids = held.storage_ids
    template._note_shared()  # the template's own bookkeeping, redone
    if template.layout is not None:  # new lists: the held save's image keeps its own
        template.slots = [StorageSlot(s.key, s.offset, s.nbytes, device_type="cpu", address=a)
                          for s, a in zip(template.slots, starts)]
        template.copies = None  # made again from the slots by the next save
