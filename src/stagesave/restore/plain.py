"""Files without a stagesave proof: whether one would load as what it claims to be.

A file without a proof is offered for a resume only if it would load as a torch file
(:func:`plain_problem`); verification then checks its zip records' CRC-32s, the only proof it has.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
from typing import Any

from ..stores.base import Reader

__all__ = ["plain_problem"]

#: What ``torch.save(..., _use_new_zipfile_serialization=False)`` pickles first: its magic number.
_LEGACY_TORCH_MAGIC = b"\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
#: safetensors refuses headers over 100 MB; so do we.
_MAX_SAFETENSORS_HEADER = 100_000_000


class _ReaderFile(io.RawIOBase):
    """A seekable, read-only file object over a :class:`Reader` (for :mod:`zipfile`)."""

    def __init__(self, reader: Reader) -> None:
        self._reader, self._pos = reader, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._reader.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        room = max(0, min(len(view), self._reader.size - self._pos))
        n = self._reader.readinto(self._pos, view[:room])
        self._pos += n
        return n


def plain_problem(reader: Reader, *, full: bool) -> str | None:
    """Why a file without a stagesave proof cannot be offered for a resume (``None``: it can).

    It can when it would load as what it is: a torch zip archive whose central directory reads
    and names a ``data.pkl`` record, a legacy (pre-zip) torch file, or a safetensors file whose
    header parses and whose tensors lie inside the file. ``full`` also reads every record of a
    zip and checks its CRC-32 (``torch.save`` writes them): the only proof such a file carries.
    """
    where = reader.where
    head = reader.read(0, 16)
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(_ReaderFile(reader)) as zf:
                names = zf.namelist()
                if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
                    return (f"{where} is a zip archive without a data.pkl record: not a torch "
                            f"checkpoint")
                if full:
                    bad = zf.testzip()
                    if bad is not None:
                        return f"{where}: its record {bad} does not match its CRC-32 (damaged)"
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, OSError,
                RuntimeError) as exc:
            return f"{where} is not a readable torch checkpoint (no stagesave proof): {exc}"
        return None
    if _LEGACY_TORCH_MAGIC in head:
        return None
    if reader.size >= 8:
        (n,) = struct.unpack("<Q", reader.read(0, 8))
        if 2 <= n <= min(_MAX_SAFETENSORS_HEADER, reader.size - 8) and reader.read(8, 1) == b"{":
            return _safetensors_problem(reader, n)
    return f"{where} is neither a torch file nor a safetensors file, and has no stagesave proof"


def _safetensors_problem(reader: Reader, n: int) -> str | None:
    where = reader.where
    try:
        header = json.loads(reader.read(8, n))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"{where}: its safetensors header is not valid JSON ({exc})"
    if not isinstance(header, dict):
        return f"{where}: its safetensors header is not an object"
    data = reader.size - 8 - n
    for key, value in header.items():
        if key == "__metadata__":
            continue
        offsets = value.get("data_offsets") if isinstance(value, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data):
            return f"{where}: tensor {key!r} of its safetensors header lies outside the file"
    return None

