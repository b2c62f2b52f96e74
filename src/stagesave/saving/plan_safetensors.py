"""Safetensors files as images: a JSON header, then every tensor's bytes back to back.

Accelerate writes ``model.safetensors``; we lay the same file out in the staging buffer so it is
written without a serialization pass, exactly as torch files are. Reading stays with the
``safetensors`` library (its header parser is the one users already trust).

Format 2 keeps the proof in the header: ``__metadata__["stagesave.proof"]`` is reserved as a run
of spaces when the file is laid out (safetensors refuses trailing bytes, and the data offsets
depend on the header's length), hashed as spaces, and filled with the proof once every digest is
known; the header's first pages are written last.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping

import torch

from ..errors import UnsupportedObjectError
from ..ondisk.names import MAX_MANIFEST_BYTES, PROOF_KEY
from ..ondisk.validate import MAX_TENSOR_NAME
from .plan import FileImage, StorageSlot

__all__ = ["plan_safetensors_file"]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("complex64", "C64"),
):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code

#: Safetensors pads its header so that the data starts 8-byte aligned.
_HEADER_ALIGN = 8


#: How many bytes to reserve for the proof of a file of ``size`` bytes and these storages.
ProofRoom = Callable[[int, list[list[object]]], int]


#: The largest header safetensors readers accept (the library's own limit, and stagesave's).
MAX_HEADER_BYTES = 100_000_000


def plan_safetensors_file(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
    *, proof_room: ProofRoom | None = None,
) -> FileImage:
    """Lay out ``tensors`` as a safetensors file, with room for its proof when ``proof_room`` says.

    Raises:
        UnsupportedObjectError: a value is not a dense tensor, its dtype has no safetensors
            code, two entries share memory, metadata is not ``str -> str`` or uses the
            proof's key.
    """
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise UnsupportedObjectError("safetensors metadata must map str to str")
        if PROOF_KEY in metadata:
            raise UnsupportedObjectError(
                f"safetensors metadata key {PROOF_KEY!r} is stagesave's own"
            )
    header["__metadata__"] = dict(metadata or {})
    sources: list[tuple[str, torch.Tensor]] = []
    seen: dict[tuple[int, int], str] = {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise UnsupportedObjectError(
                f"safetensors entry {name!r} is a {type(t).__name__}, not a dense tensor"
            )
        if len(name) > MAX_TENSOR_NAME:  # a reader's limit on the proof's storage keys
            raise UnsupportedObjectError(
                f"safetensors entry name of {len(name)} characters: readers accept at most "
                f"{MAX_TENSOR_NAME}")
        code = _DTYPES.get(t.dtype)
        if code is None:
            raise UnsupportedObjectError(
                f"safetensors cannot store {name!r} of dtype {t.dtype}; save it as a torch file"
            )
        if t.numel():
            key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
            if key in seen:
                raise UnsupportedObjectError(
                    f"safetensors entries {seen[key]!r} and {name!r} share memory (tied weights); "
                    "keep one of them, as safetensors requires"
                )
            seen[key] = name
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": code,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        flat = t.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        sources.append(
            (name, flat.view(torch.uint8) if nbytes else flat.new_empty(0, dtype=torch.uint8))
        )
        offset += nbytes
    room = 0
    if proof_room is not None:
        data_bytes = offset
        storages: list[list[object]] = [[name, 0, 0] for name, _ in sources]
        plain = len(json.dumps(header, separators=(",", ":")))
        room = proof_room(8 + plain + data_bytes, storages)
        room = proof_room(8 + plain + room + data_bytes, storages)  # the room counts in the size
        header["__metadata__"] = {**dict(metadata or {}), PROOF_KEY: " " * room}
    elif not metadata:
        del header["__metadata__"]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _HEADER_ALIGN)
    if room > MAX_MANIFEST_BYTES or len(raw) > MAX_HEADER_BYTES:
        raise UnsupportedObjectError(
            f"a safetensors file of {len(sources)} tensors would have a header of "
            f"{len(raw) / 1e6:.0f} MB holding a proof of {room / 2**20:.0f} MiB; readers accept "
            f"at most {MAX_HEADER_BYTES / 1e6:.0f} MB and {MAX_MANIFEST_BYTES >> 20} MiB: save "
            "fewer tensors per file (split it, as sharded safetensors checkpoints do) or "
            "shorter names"
        )
    head = struct.pack("<Q", len(raw)) + raw
    blank = None
    if proof_room is not None:
        marker = json.dumps(PROOF_KEY).encode() + b':"'
        at = raw.index(marker + b" " * room + b'"')
        blank = (8 + at + len(marker), room)
    base = len(head)
    slots = []
    pos = base
    for name, src in sources:
        n = src.numel()
        slots.append(StorageSlot(name, pos, n, src))
        pos += n
    return FileImage(size=pos, pieces=[(0, head)], slots=slots, serialization_id="", id_offset=0,
                     kind="safetensors", blank=blank)
