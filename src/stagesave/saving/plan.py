"""The file image: a genuine ``torch.save`` file laid out before any tensor byte is copied.

``torch.save`` runs under ``torch.serialization.skip_data()`` into a recording sink: it pickles
the structure (capturing every non-tensor leaf by value, at this instant), lays out a zip whose
storage records are 4096-aligned and empty, and tells us nothing else. The sink keeps the few
small pieces it writes (headers, ``data.pkl``) at their offsets; torch's own reader then tells
each storage record's offset. The staging step copies those pieces and every storage's bytes
into a host buffer at their final offsets, so the buffer *is* the file and writing it needs no
serialization pass.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import pickle
import secrets
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields, is_dataclass
from typing import IO, Any, ParamSpec, TypeVar, cast

import torch

try:  # torch >= 2.7: records can be aligned to pages
    from torch.utils.serialization import config as _torch_save_config
# torch 2.6: records are 64-byte aligned (the whole image is still written in pages)
except ImportError:
    _torch_save_config = None  # type: ignore[assignment]

from ..errors import UnsupportedObjectError
from ..ondisk.checksum import crc32
from ..ondisk.names import ALIGNMENT
from ..ondisk.torchzip import TorchZip, ZipFormatError, parse_torch_zip
from .image import MAX_INDEXED_TENSORS, FileImage, StorageSlot, TensorEntry
from .index_json import check_empty_offsets
from .sparse import SinkFull, SparseReader, SparseSink

__all__ = ["FileImage", "StorageSlot", "TensorEntry", "gc_paused", "plan_torch_file"]


_NEVER_PERSISTENT = frozenset(
    {
        int,
        float,
        complex,
        str,
        bytes,
        bool,
        type(None),
        tuple,
        list,
        dict,
        set,
        frozenset,
        collections.OrderedDict,
        torch.Tensor,
        torch.nn.Parameter,
        torch.Size,
        torch.dtype,
        torch.device,
    }
)


def _recording_pickle_module(found: dict[str, torch.UntypedStorage]) -> types.ModuleType:
    """A pickle module whose Pickler remembers which storage torch named with which key."""

    class RecordingPickler(pickle.Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # torch.save subclasses this class and defines ``persistent_id``; wrap that method
            # so every storage it names is recorded under the key it chose.
            named = type(self).persistent_id

            def persistent_id(obj: Any) -> Any:
                if type(obj) in _NEVER_PERSISTENT:
                    return None
                pid = named(self, obj)
                if pid is not None and pid[0] == "storage":
                    storage = obj._untyped_storage if isinstance(obj, torch.TypedStorage) else obj
                    found.setdefault(pid[2], storage)
                return pid

            self.persistent_id = persistent_id  # type: ignore[method-assign]
            super().__init__(*args, **kwargs)

    module = types.ModuleType("stagesave_recording_pickle")
    module.Pickler = RecordingPickler  # type: ignore[attr-defined]
    return module


def _describe_unpicklable(state: Any, exc: BaseException) -> str:
    """Find the first leaf that fails to pickle, to name it in the error."""
    for name, leaf in _walk(state, "", depth=0):
        if isinstance(leaf, torch.Tensor):
            continue
        try:
            pickle.dumps(leaf, protocol=2)
        except Exception:  # noqa: BLE001 - any failure identifies the culprit
            return f"the value at {name or '<root>'!s} ({type(leaf).__qualname__})"
    return "an object in the state"


def _walk(obj: Any, prefix: str, depth: int) -> Iterator[tuple[str, Any]]:
    """Yield ``(dotted name, leaf)`` for the leaves of nested containers."""
    if depth > 64:
        yield prefix, obj
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _walk(v, f"{prefix}.{k}" if prefix else str(k), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{prefix}.{i}" if prefix else str(i), depth + 1)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            v = getattr(obj, f.name)
            yield from _walk(v, f"{prefix}.{f.name}" if prefix else f.name, depth + 1)
    else:
        yield prefix, obj


def index_tensors(state: Any, keys: dict[int, str]) -> list[TensorEntry]:
    """The manifest's index: every tensor of ``state`` by dotted name (``keys``: storage
    ``_cdata`` -> key)."""
    entries: list[TensorEntry] = []
    for name, leaf in _walk(state, "", depth=0):
        if not isinstance(leaf, torch.Tensor) or len(entries) >= MAX_INDEXED_TENSORS:
            continue
        try:
            key = keys.get(leaf.untyped_storage()._cdata)
            if key is None:
                continue
            entry = TensorEntry(
                name=name,
                storage_key=key,
                dtype=str(leaf.dtype).removeprefix("torch."),
                shape=tuple(leaf.shape),
                stride=tuple(leaf.stride()),
                storage_offset=int(leaf.storage_offset()),
            )
        except (RuntimeError, NotImplementedError):  # sparse, nested, subclasses: not indexed
            continue
        entries.append(entry)
    return entries


def unique_id(length: int) -> str:
    """A serialization id of ``length`` digits, unique per save and ordered by time."""
    digits = f"{time.time_ns():020d}{secrets.randbelow(10**20):020d}"
    return digits[-length:] if length <= len(digits) else digits.rjust(length, "0")


def _replace_bytes(
    pieces: list[tuple[int, bytes]], offset: int, data: bytes
) -> list[tuple[int, bytes]]:
    out = []
    for off, chunk in pieces:
        lo, hi = max(off, offset), min(off + len(chunk), offset + len(data))
        if lo < hi:
            b = bytearray(chunk)
            b[lo - off : hi - off] = data[lo - offset : hi - offset]
            chunk = bytes(b)
        out.append((off, chunk))
    return out


_P = ParamSpec("_P")
_R = TypeVar("_R")
_gc_lock = threading.Lock()
_gc_depth = 0  # plans in progress, over all threads
_gc_resume = False  # whether the outermost pause found the collector enabled


#: A pause that leaves at least this many tracked objects alive promotes them (and every
#: other tracked object) to the oldest generation when it ends (:func:`_promote_survivors`).
PROMOTE_FROM = 10_000


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector for the duration (if it was enabled).

    Pickling a state of thousands of tensors allocates hundreds of thousands of short-lived
    objects, enough to trigger full collections over every object of the training process in
    the middle of the blocking phase (a plan of 2,688 tensors in a process holding 2 million
    objects: median 0.08 s either way, p95 0.39 s and max 0.76 s unpaused, 0.084 s paused;
    ``benchmarks/results/plan.md``). The garbage is collected later, as usual. Pauses nest and
    overlap across threads: the collector resumes when the last one ends, and only if it was
    enabled when the first began.

    When it resumes, what the pause left alive goes to the oldest generation (see
    :func:`_promote_survivors`): otherwise the first allocation after the pause started a
    collection of every object made during it (at the end of a load of 100,000 tensors,
    90-205 ms; of 8,000 tensors, 4-72 ms).
    """
    global _gc_depth, _gc_resume
    with _gc_lock:
        if _gc_depth == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_resume:
                _promote_survivors()
                gc.enable()


def _promote_survivors() -> None:
    """After a pause that left many objects alive (:data:`PROMOTE_FROM`), move every object
    the collector tracks into its oldest generation and zero the youngest's allocation count,
    without a collection (``gc.freeze`` then ``gc.unfreeze``).

    Such survivors are a loaded state or a new plan: long-lived objects, which the collector
    would promote anyway after scanning them once or twice; the pause's garbage was freed by
    reference counting (saves and loads leave no cycles, ``tests/core/test_plan_gc.py``). The
    cost: young cyclic garbage of other code, from just before or during that pause, waits for
    the next full collection; steady saves never promote (45 survivors at 8,000 tensors, 6,015
    at 100,000; the second save of a structure, which builds its copy list, can). Skipped when
    the process froze objects itself (``gc.freeze``: unfreezing would undo that)."""
    if gc.get_count()[0] >= max(PROMOTE_FROM, 10 * gc.get_threshold()[0]) and (
            gc.get_freeze_count() == 0):
        gc.freeze()
        gc.unfreeze()


def collector_paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run inside :func:`gc_paused` (a whole save: after its plan, the first save of a
    100,000-tensor state made enough objects sending its layout to the writer agent for the
    collector to take 0.5 s there)."""

    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with gc_paused():
            return fn(*args, **kwargs)

    return paused


#: The most bytes a state holding quantized or nested tensors may have (torch lays it out only
#: with all its bytes, in memory; see :func:`_plan_torch_file`).
WITH_BYTES_LIMIT = 256 << 20


def plan_torch_file(state: Any) -> FileImage:
    """Lay out ``state`` as a ``torch.save`` file without copying any tensor data.

    Every non-tensor leaf is pickled by value now, so mutating it after this call does not
    change the checkpoint; tensors are referenced by their storages, which the caller must copy
    before they can change (the staging step does). The garbage collector is paused meanwhile
    (:func:`gc_paused`).

    Raises:
        UnsupportedObjectError: something in the state cannot be pickled; the message names it.
    """
    with gc_paused():
        return _plan_torch_file(state)


def _plan_torch_file(state: Any) -> FileImage:
    found: dict[str, torch.UntypedStorage] = {}
    sink = SparseSink()
    aligned = (_torch_save_config.patch({"save.storage_alignment": ALIGNMENT})  # type: ignore[attr-defined]
               if _torch_save_config is not None else contextlib.nullcontext())
    with aligned:
        try:
            try:
                with torch.serialization.skip_data():
                    # torch's own function even when ``torch.save`` is monkeypatched (a mock
                    # writes nothing)
                    torch.serialization.save(
                        state, cast(IO[bytes], sink), pickle_module=_recording_pickle_module(found)
                    )
            except RuntimeError as exc:
                if "skip_data" not in str(exc):
                    raise
                # quantized and nested tensors: torch lays them out only with their bytes,
                # which the sink then holds (a copy made now, as staging would), for states of
                # at most WITH_BYTES_LIMIT (a copy of a larger one in memory, every save)
                found.clear()
                sink = SparseSink(limit=WITH_BYTES_LIMIT)
                try:
                    torch.serialization.save(
                        state, cast(IO[bytes], sink),
                        pickle_module=_recording_pickle_module(found))
                    if sink.full:
                        raise SinkFull(WITH_BYTES_LIMIT)
                except SinkFull:
                    raise UnsupportedObjectError(
                        f"cannot save a state holding quantized or nested tensors of more than "
                        f"{WITH_BYTES_LIMIT >> 20} MiB: torch lays such tensors out only with "
                        "the bytes of the whole state, which stagesave would copy in memory at "
                        f"every save ({exc}). Save them apart (a state of their own), "
                        "dequantize them, or use torch.save for this state."
                    ) from None
        except UnsupportedObjectError:
            raise
        except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
            where = _describe_unpicklable(state, exc)
            raise UnsupportedObjectError(
                f"cannot save {where}: {exc}. Convert it to tensors, numpy arrays or plain "
                "Python values (or make it picklable) before saving."
            ) from exc

    pieces = sink.coalesced()
    reader = torch._C.PyTorchFileReader(cast(IO[bytes], SparseReader(sink.end, pieces)))
    slots = []
    for key, storage in found.items():
        offset = int(reader.get_record_offset(f"data/{key}"))  # type: ignore[attr-defined]
        slots.append(StorageSlot(key, offset, int(storage.nbytes()), storage=storage))
    slots.sort(key=lambda s: s.offset)
    # torch derives the id from record checksums, which skip_data leaves empty, so two states of
    # the same structure would share one; give each save its own (same length, time-ordered).
    id_offset = int(reader.get_record_offset(".data/serialization_id"))  # type: ignore[attr-defined]
    old = str(reader.serialization_id())
    sid = unique_id(len(old))
    pieces = _replace_bytes(pieces, id_offset, sid.encode())
    zip_, crc_fields, pieces = _archive(pieces, sink.end, slots, sid)
    keys = {storage._cdata: key for key, storage in found.items()}
    tensors = index_tensors(state, keys)
    check_empty_offsets(tensors)
    return FileImage(
        size=sink.end,
        pieces=pieces,
        slots=slots,
        serialization_id=sid,
        id_offset=id_offset,
        tensors=tensors,
        kind="torch",
        zip=zip_,
        crc_fields=crc_fields,
    )


def _archive(
    pieces: list[tuple[int, bytes]], size: int, slots: list[StorageSlot], sid: str,
) -> tuple[TorchZip, list[int], list[tuple[int, bytes]]]:
    """Parse torch's archive; give the serialization id record its real CRC (we changed its bytes).

    Returns the archive, where each slot's CRC goes, and the pieces with the id record's CRC.
    """
    sparse = SparseReader(size, pieces)

    def read(offset: int, n: int) -> bytes:
        sparse.seek(offset)
        out = bytearray(max(0, min(n, size - offset)))
        sparse.readinto(out)
        return bytes(out)

    try:
        zip_ = parse_torch_zip(read, size)
    except ZipFormatError as exc:  # torch changed its writer: say so instead of writing a bad file
        raise UnsupportedObjectError(
            f"torch {torch.__version__} wrote an archive stagesave cannot lay out: {exc}"
        ) from exc
    id_record = zip_.record(".data/serialization_id")
    crc = crc32(sid.encode())
    if id_record.descriptor_crc_at >= 0:
        pieces = _replace_bytes(pieces, id_record.descriptor_crc_at, crc.to_bytes(4, "little"))
    zip_ = TorchZip(
        zip_.prefix, zip_.records, zip_.cd_start, zip_.with_crcs({id_record.name: crc}), zip_.zip64
    )
    by_name = {r.name: r for r in zip_.records}
    fields = [by_name[f"{zip_.prefix}/data/{s.key}"].descriptor_crc_at
              if f"{zip_.prefix}/data/{s.key}" in by_name else -1 for s in slots]
    return zip_, fields, pieces
