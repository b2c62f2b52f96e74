"""torch's archive, laid out directly: the records ``torch.save`` writes, byte for byte.

Every record has a local header whose extra field pads its data to a 4096-byte boundary (``FB``,
its length, ``Z``), a data descriptor after the data (none for an empty record), zip64 fields
where torch puts them (sizes of 4 GiB or more, offsets past 4 GiB), and a central-directory
entry. :class:`Layout` holds everything from the first storage record on, which depends only on
the storages' sizes: it is computed once per structure and cached (:func:`cached_layout`) until the
last ``Checkpointer`` of the process closes (:func:`forget_layouts`). :func:`lay_out_head` lays out
``data.pkl`` and the small records before the storages at every save.
"""

from __future__ import annotations

import collections
import struct
import threading
from dataclasses import dataclass
from typing import NamedTuple

from ..ondisk.checksum import crc32
from ..ondisk.names import ALIGNMENT
from ..ondisk.torchzip import ZipRecord

__all__ = [
    "PREFIX",
    "Constants",
    "Layout",
    "Record",
    "cached_layout",
    "cd_entry",
    "central_directory",
    "forget_layouts",
    "lay_out_head",
    "local_header",
]

_LH_SIG = 0x04034B50
_CD_SIG = 0x02014B50
_DD_SIG = 0x08074B50
_U32 = 0xFFFFFFFF
_LH = struct.Struct("<IHHHHHIIIHH")
_CD = struct.Struct("<IHHHHHHIIIHHHHHII")
_DD32 = struct.Struct("<IIII")
_H = struct.Struct("<H")
_FLAGS = 0x0808  # data descriptor follows; names are UTF-8
PREFIX = "archive"

#: The padding every cached header shares (a view of it per header, not a copy: a layout of
#: 100,000 storages would otherwise hold ~400 MB of ``Z``).
_ZPAD = memoryview(b"Z" * ALIGNMENT)


def local_header(name: bytes, offset: int, size: int) -> bytes:
    """A streamed record's local header (sizes and CRC in its descriptor), padded to alignment."""
    fixed, pad = _local_header_parts(name, offset, size)
    return fixed + b"Z" * pad


def _local_header_parts(name: bytes, offset: int, size: int) -> tuple[bytes, int]:
    """:func:`_local_header` without its trailing ``Z`` padding, and how many ``Z`` follow."""
    big_size, big_offset = size >= _U32, offset >= _U32
    z64 = b""
    if big_size or big_offset:
        # torch's local zip64 field: the size and a zero compressed size (known later), the offset
        values = ([size, 0] if big_size else []) + ([offset] if big_offset else [])
        z64 = struct.pack(f"<HH{len(values)}Q", 0x0001, 8 * len(values), *values)
    start = offset + 30 + len(name) + len(z64) + 4
    pad = -start % ALIGNMENT
    extra_len = len(z64) + 4 + pad
    fixed = _LH.pack(_LH_SIG, 0, _flags(size), 0, 0, 0, 0, 0, 0, len(name), extra_len)
    return fixed + name + z64 + b"FB" + _H.pack(pad), pad


def _flags(size: int) -> int:
    """torch streams every record but an empty one (no data descriptor then)."""
    return _FLAGS if size else _FLAGS & ~0x08


def data_descriptor(crc: int, offset: int, size: int) -> bytes:
    if not size:
        return b""
    if size >= _U32 or offset >= _U32:
        return struct.pack("<IIQQ", _DD_SIG, crc, size, size)
    return _DD32.pack(_DD_SIG, crc, size, size)


def cd_entry(name: bytes, crc: int, offset: int, size: int) -> bytes:
    big_size, big_offset = size >= _U32, offset >= _U32
    values = ([size, size] if big_size else []) + ([offset] if big_offset else [])
    extra = struct.pack(f"<HH{len(values)}Q", 0x0001, 8 * len(values), *values) if values else b""
    return _CD.pack(
        _CD_SIG, 0, 0, _flags(size), 0, 0, 0, crc, min(size, _U32), min(size, _U32),
        len(name), len(extra), 0, 0, 0, 0, min(offset, _U32),
    ) + name + extra


@dataclass(frozen=True)
class Constants:
    """What torch writes into its small records (learned from torch itself, once)."""

    small: tuple[tuple[str, bytes], ...]  # records between data.pkl and the storages
    version: bytes
    id_length: int


class Record(NamedTuple):
    """A record of the layout (a named tuple: one per storage)."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc_at: int  # the CRC field of its data descriptor


class Layout:
    """The archive of one structure, from the first storage record to the central directory.

    ``head`` bytes (data.pkl and the small records) precede it: their length, rounded up by the
    padding, is ``start``; a pickle that still fits before ``start`` reuses the layout.
    """

    def __init__(self, constants: Constants, start: int, sizes: tuple[int, ...]) -> None:
        self.start = start
        self.sizes = sizes
        pieces: list[tuple[int, bytes | memoryview]] = []
        records: list[Record] = []
        pos = start
        # The small records before the storages are not part of ``start``: the head holds them.
        pending = b""
        lh, h, dd, add_record, add_piece = _LH.pack, _H.pack, _DD32.pack, records.append, \
            pieces.append
        prefix = f"{PREFIX}/data/"
        for key, size in enumerate(sizes):
            text = f"{prefix}{key}"
            name = text.encode()
            if 0 < size < _U32 and pos < _U32:  # the common record, as _local_header_parts
                pad = -(pos + 34 + len(name)) % ALIGNMENT
                fixed = lh(_LH_SIG, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(name), 4 + pad) + name + \
                    b"FB" + h(pad)
            else:
                fixed, pad = _local_header_parts(name, pos, size)
            header_len = len(fixed) + pad
            add_record(Record(text, pos, pos + header_len, size,
                              pos + header_len + size + 4 if size else -1))
            add_piece((pos - len(pending), pending + fixed))
            if pad:
                add_piece((pos + len(fixed), _ZPAD[:pad]))
            start = pos
            pos += header_len + size
            pending = (dd(_DD_SIG, 0, size, size) if 0 < size < _U32 and start < _U32
                       else data_descriptor(0, start, size))
            pos += len(pending)
        self.storage_records = records
        self.keys = [str(k) for k in range(len(sizes))]
        self.crc_fields = [r.crc_at for r in records]
        self._zip_records: dict[int, list[ZipRecord]] = {}
        self.pieces = pieces  # the first one starts at ``start`` (no pending descriptor yet)
        self.after = pos - len(pending)  # where the last storage's descriptor starts
        self.pending = pending
        self.constants = constants

    def zip_records(self, cd_base: int, cd_at: list[int]) -> list[ZipRecord]:
        """The storage records as :class:`ZipRecord` s, their CD entries ``cd_base`` into the CD."""
        made = self._zip_records.get(cd_base)
        if made is None:
            made = [
                ZipRecord(r.name, r.header_offset, r.data_offset, r.size, r.crc_at, cd_base + at)
                for r, at in zip(self.storage_records, cd_at)
            ]
            self._zip_records[cd_base] = made
        return made

    def tail(self, sid: bytes) -> tuple[list[Record], bytes, int]:
        """The records after the storages (version, serialization id) as one piece at
        :attr:`after`, with their records and where the piece ends (the central directory)."""
        out = bytearray(self.pending)
        pos = self.after + len(out)
        recs = []
        for rel, data in (("version", self.constants.version), (".data/serialization_id", sid)):
            name = f"{PREFIX}/{rel}".encode()
            header = local_header(name, pos, len(data))
            recs.append(
                Record(
                    name.decode(),
                    pos,
                    pos + len(header),
                    len(data),
                    pos + len(header) + len(data) + 4,
                )
            )
            descriptor = data_descriptor(crc32(data), pos, len(data))
            out += header + data + descriptor
            pos += len(header) + len(data) + len(descriptor)
        return recs, bytes(out), pos


def lay_out_head(constants: Constants, pkl: bytes) -> tuple[list[Record], bytes, dict[str, int]]:
    """data.pkl and the small records from offset 0, up to where the next record would start,
    with each record's CRC-32 by name."""
    out = bytearray()
    recs = []
    crcs = {}
    for rel, data in ((("data.pkl", pkl),) + constants.small):
        pos = len(out)
        name = f"{PREFIX}/{rel}".encode()
        header = local_header(name, pos, len(data))
        recs.append(
            Record(
                name.decode(), pos, pos + len(header), len(data), pos + len(header) + len(data) + 4
            )
        )
        crc = crcs[recs[-1].name] = crc32(data)
        out += header + data + data_descriptor(crc, pos, len(data))
    return recs, bytes(out), crcs


def central_directory(records: list[Record], crcs: dict[str, int]) -> tuple[bytes, list[int]]:
    out = bytearray()
    at = []
    pack, get = _CD.pack, crcs.get
    for r in records:
        at.append(len(out))
        size, offset, name = r.size, r.header_offset, r.name.encode()
        if 0 < size < _U32 and offset < _U32:  # the common entry, as cd_entry
            out += pack(_CD_SIG, 0, 0, _FLAGS, 0, 0, 0, get(r.name, 0), size, size, len(name),
                        0, 0, 0, 0, 0, offset)
            out += name
        else:
            out += cd_entry(name, get(r.name, 0), offset, size)
    return bytes(out), at


# ---------------------------------------------------------------------------- the cache
_lock = threading.Lock()  # the layout cache
_layouts: collections.OrderedDict[tuple[int, tuple[int, ...]], tuple[Layout, bytes, list[int]]] = (
    collections.OrderedDict())
_MAX_LAYOUTS = 8


def cached_layout(
    constants: Constants, start: int, sizes: tuple[int, ...]
) -> tuple[Layout, bytes, list[int]]:
    """The layout for ``sizes`` after a head of ``start`` bytes, and the central directory of
    its storage records (CRCs zero) with where each entry starts."""
    key = (start, sizes)
    with _lock:
        hit = _layouts.get(key)
        if hit is not None:
            _layouts.move_to_end(key)
            return hit
    layout = Layout(constants, start, sizes)
    cd, at = central_directory(layout.storage_records, {})
    made = (layout, cd, at)
    with _lock:
        _layouts[key] = made
        while len(_layouts) > _MAX_LAYOUTS:
            _layouts.popitem(last=False)
    return made


def forget_layouts() -> None:
    """Drop every cached layout (the last ``Checkpointer`` of the process closed)."""
    with _lock:
        _layouts.clear()
