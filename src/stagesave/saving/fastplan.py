"""The fast planner: the file image of a state of plain tensors, without running ``torch.save``.

:func:`stagesave.saving.plan.plan_torch_file` lets ``torch.save`` lay the file out under
``skip_data`` and reads the layout back. That costs ~50-100 µs per tensor (torch's reductions,
its zip writer, reading the archive back), which dominates a save of thousands of small tensors.
This module produces the same bytes itself:

* **the pickle**: a C pickler whose ``reducer_override`` reduces plain tensors and parameters the
  way torch does (``_rebuild_tensor_v2`` / ``_rebuild_parameter`` with the same arguments) and
  whose ``persistent_id`` names storages the way ``torch.save`` does (same keys, types,
  locations and counts, in the same order). Every non-tensor leaf is pickled by value, at every
  save, by the same C pickler torch uses;
* **the archive**: torch's records in torch's order, each local header padded so the data starts
  on a 4096-byte boundary, data descriptors, zip64 fields where torch puts them, and the central
  directory. The part that depends only on the storages' sizes (everything from the first
  storage record on) is computed once per structure and reused (:class:`Layout`), so a save of
  an unchanged structure costs the pickle, a header and a copy of the central directory.

Anything else (tensor subclasses, tensors with Python attributes or hooks, sparse, quantized,
meta or non-CPU/CUDA tensors, storages in the state, the newer dtypes that torch saves as
untyped storages, two dtypes over one storage) makes :func:`plan_fast` return ``None`` and the
caller uses ``torch.save``'s layout. The first use in a process checks the whole thing against
``torch.save`` on a probe state; if the installed torch writes anything differently the fast
path stays off for the process. Tests compare both planners byte for byte on generated states.
"""

from __future__ import annotations

import collections
import io
import os
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass
from typing import Any

import torch

from ..ondisk.checksum import crc32
from ..ondisk.torchzip import TorchZip, ZipRecord
from .first_pickle import Facts
from .image import MAX_INDEXED_TENSORS, FileImage, StorageSlot, TensorEntry
from .index_json import check_empty_offsets
from .plan import gc_paused, plan_torch_file, unique_id
from .torch_pickler import STORAGE_CLASS, TorchPickler, Unsupported
from .ziplayout import (
    PREFIX,
    Constants,
    Layout,
    cached_layout,
    cd_entry,
    central_directory,
    lay_out_head,
)

__all__ = [
    "Framed", "constants", "fast_path_enabled", "image_of", "index", "plan", "plan_fast",
    "planner_setting", "same_layout",
]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_OrderedDict = collections.OrderedDict


# ---------------------------------------------------------------------------- the probe
_probe_lock = threading.Lock()
_constants: Constants | None = None
_checked: bool | None = None  # the probe's verdict: None = not run yet


def fast_path_enabled() -> bool:
    """Whether this process lays torch files out itself (the probe against ``torch.save``
    passed)."""
    global _checked, _constants
    if _checked is None:
        with _probe_lock:
            if _checked is None:
                try:
                    _constants = _learn_constants()
                    _checked = _agrees_with_torch()
                except Exception:  # noqa: BLE001 - any surprise means: let torch lay files out
                    _checked = False
    return bool(_checked)


def constants() -> Constants | None:
    """What torch writes into its small records (``None`` until the probe ran, or if it failed)."""
    return _constants if _checked else None


def _learn_constants() -> Constants:
    """The small records torch writes, read from a probe file laid out by torch."""
    image = plan_torch_file({})
    data = _image_bytes(image)
    zip_ = image.zip
    assert zip_ is not None
    names = [r.name.removeprefix(f"{PREFIX}/") for r in zip_.records]
    content = {
        n: bytes(data[r.data_offset : r.data_offset + r.size]) for n, r in zip(names, zip_.records)
    }
    if names[0] != "data.pkl" or names[-2:] != ["version", ".data/serialization_id"]:
        raise ValueError(f"unexpected records {names}")
    small = tuple((n, content[n]) for n in names[1:-2])
    return Constants(small, content["version"], len(image.serialization_id))


def _image_bytes(image: FileImage) -> bytearray:
    out = bytearray(image.size)
    for off, piece in image.pieces:
        out[off : off + len(piece)] = piece
    return out


def _probe_state() -> dict[str, Any]:
    base = torch.arange(12, dtype=torch.float32)
    return {
        "w": torch.nn.Parameter(torch.ones(2, 3)),
        "view": base[2:8].view(2, 3),
        "base": base,
        "t": base.t() if base.dim() == 2 else base.reshape(3, 4).t(),
        "i": torch.zeros(3, dtype=torch.int64),
        "b": torch.tensor([True]),
        "h": torch.ones(1, dtype=torch.bfloat16),
        "e": torch.empty(0),
        "step": 3,
        "lr": 0.1,
        "name": "probe",
        "nested": [{"x": (1, 2.5, None)}, b"bytes"],
    }


def _agrees_with_torch() -> bool:
    """Whether both planners lay the probe state out identically (apart from the id)."""
    state = _probe_state()
    ours, theirs = plan_fast(state, probe=True), plan_torch_file(state)
    return ours is not None and same_layout(ours, theirs)


def same_layout(a: FileImage, b: FileImage) -> bool:
    """Whether two images of one state hold the same bytes where it matters: the file up to its
    central directory with both serialization ids blanked, the same slots and CD entries."""
    if a.zip is None or b.zip is None or a.zip.cd_start != b.zip.cd_start or a.covered != b.covered:
        return False
    x, y = _image_bytes(a)[: a.covered], _image_bytes(b)[: b.covered]
    for image, data in ((a, x), (b, y)):
        n = len(image.serialization_id)
        data[image.id_offset : image.id_offset + n] = bytes(n)
        assert image.zip is not None
        rec = image.zip.record(".data/serialization_id")
        if rec.descriptor_crc_at >= 0:
            data[rec.descriptor_crc_at : rec.descriptor_crc_at + 4] = bytes(4)
    if x != y:
        return False
    if [(s.key, s.offset, s.nbytes) for s in a.slots] != [
        (s.key, s.offset, s.nbytes) for s in b.slots
    ]:
        return False
    if a.crc_fields != b.crc_fields or a.tensors != b.tensors:
        return False
    cds = []
    for image in (a, b):
        assert image.zip is not None
        cd = bytearray(image.zip.cd)
        rec = image.zip.record(".data/serialization_id")
        struct.pack_into("<I", cd, rec.cd_entry_at + 16, 0)
        cds.append(bytes(cd))
    return cds[0] == cds[1] and [
        (r.name, r.header_offset, r.data_offset, r.size) for r in a.zip.records
    ] == [(r.name, r.header_offset, r.data_offset, r.size) for r in b.zip.records]


# ---------------------------------------------------------------------------- planning
PLANNER_ENV = "STAGESAVE_PLANNER"


def planner_setting() -> str:
    """``STAGESAVE_PLANNER``: ``auto`` (default: this module where it can) or ``torch`` (always
    ``torch.save``'s layout, the escape hatch should the two ever disagree).

    Raises:
        ValueError: another value.
    """
    value = os.environ.get(PLANNER_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "torch"):
        raise ValueError(f"{PLANNER_ENV} must be 'auto' or 'torch', got {value!r}")
    return value


def plan(state: Any) -> FileImage:
    """The file image of ``state``: laid out here when it can be, else by ``torch.save``.

    Raises:
        UnsupportedObjectError: something in the state cannot be pickled; the message names it.
        ValueError: ``STAGESAVE_PLANNER`` holds something other than ``auto`` or ``torch``.
    """
    if planner_setting() == "auto" and fast_path_enabled():
        image = plan_fast(state)
        if image is not None:
            return image
    return plan_torch_file(state)


def plan_fast(state: Any, *, probe: bool = False) -> FileImage | None:
    """Lay ``state`` out without ``torch.save`` (``None``: it holds something only torch lays out,
    or pickling it fails: the caller's ``torch.save`` path then reports that)."""
    constants = _constants
    if constants is None or (not probe and not _checked):
        return None
    with gc_paused():
        buf = io.BytesIO()
        pickler = TorchPickler(buf)
        try:
            pickler.dump(state)
        except Unsupported:
            return None
        except Exception:  # noqa: BLE001 - torch.save's path names the culprit
            return None
        pkl = buf.getvalue()
        return _image(constants, pkl, pickler, state)


def _image(constants: Constants, pkl: bytes, pickler: TorchPickler, state: Any) -> FileImage:
    sizes = tuple(int(s.nbytes()) for s in pickler.storages)

    def slots(layout: Layout) -> list[StorageSlot]:
        return [
            StorageSlot(
                key, rec.data_offset, rec.size, storage=storage, device_type=device,
                address=address,
            )
            for key, rec, storage, device, address in zip(
                layout.keys, layout.storage_records, pickler.storages, pickler.devices,
                pickler.addresses,
            )
        ]

    return image_of(constants, pkl, sizes, slots, index(state, pickler))[0]


Framed = tuple[Layout, bytes, list[int]]


def image_of(
    constants: Constants,
    pkl: bytes,
    sizes: tuple[int, ...],
    slots_for: Callable[[Layout], list[StorageSlot]],
    tensors: list[TensorEntry],
    frame: Framed | None = None,
) -> tuple[FileImage, Framed]:
    """The image of a torch file whose pickle is ``pkl`` and whose storages have ``sizes``.

    ``slots_for(layout)`` makes the slots for the storage records of ``layout``; ``frame``: the
    layout (with its central directory) a caller already holds for these sizes, used when the
    head still ends where it did. Returns the image and the frame it used.
    """
    head_records, head, head_crcs = lay_out_head(constants, pkl)
    # The first storage's header starts where the head ends (no gap: torch writes records back to
    # back).
    if frame is None or frame[0].start != len(head):
        frame = cached_layout(constants, len(head), sizes)
    layout, storage_cd, storage_cd_at = frame
    sid = unique_id(constants.id_length).encode()
    tail_records, tail, cd_start = layout.tail(sid)
    pieces: list[tuple[int, bytes | memoryview]]
    if layout.pieces:
        first = layout.pieces[0][1]
        pieces = [(0, head + first), *layout.pieces[1:], (layout.after, tail)]
        static: tuple[object, int, int] | None = (layout, 1, len(pieces) - 1)
    else:
        pieces = [(0, head + tail)]
        static = None
    head_cd, _ = central_directory(head_records, head_crcs)
    tail_cd, _ = central_directory(tail_records, {tail_records[0].name: crc32(constants.version),
                                                   tail_records[1].name: crc32(sid)})
    cd = head_cd + storage_cd + tail_cd
    zip_records = []
    at = 0
    for r in head_records:
        zip_records.append(ZipRecord(r.name, r.header_offset, r.data_offset, r.size, r.crc_at, at))
        at += 46 + len(r.name.encode())
    zip_records.extend(layout.zip_records(len(head_cd), storage_cd_at))
    at = len(head_cd) + len(storage_cd)
    for r in tail_records:
        zip_records.append(ZipRecord(r.name, r.header_offset, r.data_offset, r.size, r.crc_at, at))
        at += len(cd_entry(r.name.encode(), 0, r.header_offset, r.size))
    zip_ = TorchZip(PREFIX, tuple(zip_records), cd_start, cd, True)
    check_empty_offsets(tensors)
    image = FileImage(
        size=cd_start,
        pieces=pieces,
        slots=slots_for(layout),
        serialization_id=sid.decode(),
        id_offset=tail_records[1].data_offset,
        tensors=tensors,
        kind="torch",
        zip=zip_,
        crc_fields=layout.crc_fields,
        gapless=True,
        static=static,
    )
    return image, frame


_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in STORAGE_CLASS}


_ATOMS = frozenset({int, float, str, bool, type(None), bytes, complex})


def index(state: Any, pickler: TorchPickler | Facts) -> list[TensorEntry]:
    """The manifest's index, as :func:`stagesave.saving.plan.index_tensors` builds it (same names,
    order, depth limit and cap), from what the pickler recorded about each tensor."""
    out: list[TensorEntry] = []
    info, param_data = pickler.info, pickler.param_data

    def add(name: str, obj: Any, kind: type) -> None:
        if kind is _Parameter:
            data = param_data.get(id(obj))
            got = info.get(id(data)) if data is not None else None
        else:
            got = info.get(id(obj))
        if got is not None and len(out) < MAX_INDEXED_TENSORS:
            key, dtype, shape, stride, offset = got
            out.append(TensorEntry(name, key, _DTYPE_NAMES[dtype], shape, stride, offset))

    kind = type(state)
    if kind is _Tensor or kind is _Parameter:
        add("", state, kind)
    else:
        _index_walk(state, "", 0, add)
    return out


def _index_walk(obj: Any, prefix: str, depth: int, add: Callable[[str, Any, type], None]) -> None:
    # A module function, not a closure naming itself: such a closure is a reference cycle that
    # would keep the pickler's tables alive until the cyclic collector runs (inside a save).
    if depth > 64:
        return  # as deep as the index goes (a tensor there was added by its parent)
    kind = type(obj)
    items: Any
    if (
        kind is dict
        or kind is _OrderedDict
        or (kind is not _Tensor and isinstance(obj, Mapping))
    ):
        items = obj.items()
    elif (
        kind is list
        or kind is tuple
        or (kind is not _Tensor and isinstance(obj, (list, tuple)))
    ):
        items = enumerate(obj)
    elif is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in fields(obj)]
    else:
        return
    for k, v in items:
        vk = type(v)
        if vk in _ATOMS:
            continue
        name = f"{prefix}.{k}" if prefix else str(k)
        if vk is _Tensor or vk is _Parameter:
            add(name, v, vk)
        else:
            _index_walk(v, name, depth + 1, add)
