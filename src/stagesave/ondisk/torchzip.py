"""The zip structure of a torch file, as far as format 2 needs it.

``torch.save`` writes a zip in streaming mode: every record's local header says "sizes and CRC
follow" (flag bit 3) and a data descriptor after the record's bytes carries its CRC-32; the
central directory (CD) at the end repeats each CRC. Under ``skip_data`` torch leaves the CRC of
every storage record at zero. Format 2 fixes that and appends the proof:

* the CRC-32 of each storage record, computed while staging, is written into its data descriptor
  (inside the image: a 4-byte *override*) and into its CD entry;
* torch's CD and end records are replaced by a *tail*: two more stored records (the index and the
  proof, proof last), the CD with their entries added, zip64 end records when needed, and the
  end-of-central-directory record whose archive comment is the *summary* and its *footer*.

So every format-2 file ends with the footer, a reader finds the proof from the last few hundred
bytes, ``zipfile``/``unzip -t`` accept the file, and torch ignores the two records it does not
know. The tail is a pure function of its inputs (:func:`build_tail`), which lets a verifier
rebuild it from the proven parts and compare it byte for byte.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "FOOTER_LEN",
    "TorchZip",
    "ZipRecord",
    "build_tail",
    "parse_torch_zip",
    "read_footer",
]

_LH_SIG = 0x04034B50
_CD_SIG = 0x02014B50
_DD_SIG = 0x08074B50
_EOCD_SIG = 0x06054B50
_EOCD64_SIG = 0x06064B50
_LOC64_SIG = 0x07064B50
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF

#: The footer that ends every format-2 file: magic, then the summary's length and CRC-32.
FOOTER_MAGIC = b"STAGESV2"
FOOTER_LEN = len(FOOTER_MAGIC) + 8
_MAX_SUMMARY = 60_000  # the zip comment holding summary + footer must stay under 64 KiB


class ZipFormatError(ValueError):
    """The bytes are not the zip this module expects (callers wrap it in their own error)."""


class ZipRecord(NamedTuple):
    """One record of torch's archive (a named tuple: a layout makes one per storage)."""

    name: str  # full name, with the archive prefix
    header_offset: int
    data_offset: int
    size: int
    #: Offset of the CRC field of the record's data descriptor (-1: no descriptor).
    descriptor_crc_at: int
    #: Offset of the record's CD entry inside :attr:`TorchZip.cd`.
    cd_entry_at: int


@dataclass(frozen=True)
class TorchZip:
    """torch's records and central directory; the file's proven prefix ends at ``cd_start``."""

    prefix: str
    records: tuple[ZipRecord, ...]
    cd_start: int
    cd: bytes
    zip64: bool

    def record(self, relative: str) -> ZipRecord:
        full = f"{self.prefix}/{relative}"
        for r in self.records:
            if r.name == full:
                return r
        raise KeyError(relative)

    def with_crcs(self, crcs: dict[str, int]) -> bytes:
        """The CD with the CRC-32 of the named records (full names) set."""
        cd = bytearray(self.cd)
        for r in self.records:
            crc = crcs.get(r.name)
            if crc is not None:
                struct.pack_into("<I", cd, r.cd_entry_at + 16, crc)
        return bytes(cd)


Reader = Callable[[int, int], bytes]


def _zip64_extra(extra: bytes) -> bytes | None:
    pos = 0
    while pos + 4 <= len(extra):
        hid, ln = struct.unpack_from("<HH", extra, pos)
        if hid == 0x0001:
            return extra[pos + 4 : pos + 4 + ln]
        pos += 4 + ln
    return None


def _end_records(read: Reader, size: int) -> tuple[int, int, int, bool, int]:
    """``(cd_offset, cd_size, entries, zip64, eocd_offset)`` of an archive without a comment."""
    if size < 22:
        raise ZipFormatError("too short for a zip archive")
    eocd_at = size - 22
    eocd = read(eocd_at, 22)
    sig, _d, _dcd, _n_disk, entries, cd_size, cd_off, comment_len = struct.unpack("<IHHHHIIH", eocd)
    if sig != _EOCD_SIG or comment_len != 0:
        raise ZipFormatError("no end-of-central-directory record at the end")
    zip64 = False
    if entries == _U16 or cd_size == _U32 or cd_off == _U32 or eocd_at >= 20:
        loc = read(eocd_at - 20, 20) if eocd_at >= 20 else b""
        if len(loc) == 20 and struct.unpack_from("<I", loc)[0] == _LOC64_SIG:
            eocd64_at = struct.unpack_from("<Q", loc, 8)[0]
            rec = read(eocd64_at, 56)
            if len(rec) != 56 or struct.unpack_from("<I", rec)[0] != _EOCD64_SIG:
                raise ZipFormatError("bad zip64 end record")
            entries, cd_size, cd_off = struct.unpack_from("<QQQ", rec, 32)
            zip64 = True
        elif entries == _U16 or cd_size == _U32 or cd_off == _U32:
            raise ZipFormatError("zip64 values without a zip64 end record")
    return cd_off, cd_size, entries, zip64, eocd_at


def parse_torch_zip(read: Reader, size: int) -> TorchZip:
    """Parse torch's archive (as written by ``torch.save``, no comment) through ``read``.

    Raises:
        ZipFormatError: anything unexpected (the caller names the file).
    """
    cd_off, cd_size, entries, zip64, _ = _end_records(read, size)
    if cd_off + cd_size > size:
        raise ZipFormatError("central directory outside the file")
    cd = read(cd_off, cd_size)
    records = []
    pos = 0
    for _ in range(entries):
        if pos + 46 > len(cd) or struct.unpack_from("<I", cd, pos)[0] != _CD_SIG:
            raise ZipFormatError("bad central directory entry")
        (csize, usize, nlen, elen, clen) = struct.unpack_from("<IIHHH", cd, pos + 20)
        lh_off = struct.unpack_from("<I", cd, pos + 42)[0]
        name = cd[pos + 46 : pos + 46 + nlen].decode("utf-8")
        extra = cd[pos + 46 + nlen : pos + 46 + nlen + elen]
        z64 = _zip64_extra(extra)
        if z64 is not None:
            vals = list(struct.unpack_from(f"<{len(z64) // 8}Q", z64))
            if usize == _U32:
                usize = vals.pop(0)
            if csize == _U32:
                csize = vals.pop(0)
            if lh_off == _U32:
                lh_off = vals.pop(0)
        lh = read(lh_off, 30)
        if len(lh) != 30 or struct.unpack_from("<I", lh)[0] != _LH_SIG:
            raise ZipFormatError(f"bad local header of {name}")
        flags = struct.unpack_from("<H", lh, 6)[0]
        lnlen, lelen = struct.unpack_from("<HH", lh, 26)
        data_off = lh_off + 30 + lnlen + lelen
        desc_crc_at = -1
        if flags & 0x08:
            sig = read(data_off + usize, 4)
            if len(sig) != 4 or struct.unpack("<I", sig)[0] != _DD_SIG:
                raise ZipFormatError(f"no data descriptor after {name}")
            desc_crc_at = data_off + usize + 4
        records.append(ZipRecord(name, lh_off, data_off, usize, desc_crc_at, pos))
        pos += 46 + nlen + elen + clen
    if not records or "/" not in records[0].name:
        raise ZipFormatError("not a torch archive (no records in a folder)")
    return TorchZip(records[0].name.partition("/")[0], tuple(records), cd_off, cd, zip64)


def _local_header(name: bytes, crc: int, size: int) -> bytes:
    fixed = struct.pack("<IHHHHHIIIHH", _LH_SIG, 20, 0x0800, 0, 0, 0x21, crc, size, size,
                        len(name), 0)
    return fixed + name


def _cd_entry(name: bytes, crc: int, size: int, offset: int) -> bytes:
    extra = b""
    field = offset
    if offset >= _U32:
        extra = struct.pack("<HHQ", 0x0001, 8, offset)
        field = _U32
    return struct.pack(
        "<IHHHHHHIIIHHHHHII", _CD_SIG, 0x031E, 45 if extra else 20, 0x0800, 0, 0, 0x21, crc,
        size, size, len(name), len(extra), 0, 0, 0, 0, field,
    ) + name + extra


def build_tail(
    zip_: TorchZip, cd: bytes, records: Sequence[tuple[str, bytes]], summary: bytes, *,
    crc32: Callable[[bytes], int], n_records: int | None = None,
) -> tuple[bytes, list[int]]:
    """The bytes that follow the proven prefix ``[0, zip_.cd_start)``.

    Args:
        zip_: torch's archive.
        cd: torch's CD with real CRCs (:meth:`TorchZip.with_crcs`).
        records: ``(name relative to the archive prefix, bytes)`` appended as stored records.
        summary: the summary; the archive comment is the summary and its footer.
        crc32: CRC-32 function.
        n_records: How many records ``cd`` lists (default: ``len(zip_.records)``).

    Returns:
        The tail, and the offset (in the file) of each appended record's data.
    """
    if len(summary) > _MAX_SUMMARY:
        raise ValueError(f"summary of {len(summary)} bytes is too long for a zip comment")
    out = bytearray()
    entries = bytearray(cd)
    offsets = []
    pos = zip_.cd_start
    for rel, data in records:
        name = f"{zip_.prefix}/{rel}".encode()
        crc = crc32(data)
        lh = _local_header(name, crc, len(data))
        entries += _cd_entry(name, crc, len(data), pos)
        out += lh
        offsets.append(pos + len(lh))
        out += data
        pos += len(lh) + len(data)
    cd_off, cd_size = pos, len(entries)
    n = (len(zip_.records) if n_records is None else n_records) + len(records)
    out += entries
    zip64 = zip_.zip64 or n >= _U16 or cd_off >= _U32 or cd_size >= _U32
    if zip64:
        eocd64_at = cd_off + cd_size
        out += struct.pack("<IQHHIIQQQQ", _EOCD64_SIG, 44, 45, 45, 0, 0, n, n, cd_size, cd_off)
        out += struct.pack("<IIQI", _LOC64_SIG, 0, eocd64_at, 1)
    comment = summary + footer(summary, crc32)
    out += struct.pack(
        "<IHHHHIIH", _EOCD_SIG, 0, 0, min(n, _U16), min(n, _U16), min(cd_size, _U32),
        min(cd_off, _U32), len(comment),
    )
    out += comment
    return bytes(out), offsets


def footer(summary: bytes, crc32: Callable[[bytes], int]) -> bytes:
    """The 16 bytes after a summary: magic, length, CRC-32."""
    return FOOTER_MAGIC + struct.pack("<II", len(summary), crc32(summary))


def read_footer(tail: bytes, crc32: Callable[[bytes], int]) -> bytes | None:
    """The summary ending ``tail`` (the last bytes of a file), or ``None`` without a valid footer.

    ``tail`` must hold the whole summary; a summary longer than ``tail`` returns ``None`` too
    (callers read the last 64 KiB, more than any summary).
    """
    if len(tail) < FOOTER_LEN or tail[-FOOTER_LEN : -8] != FOOTER_MAGIC:
        return None
    n, crc = struct.unpack("<II", tail[-8:])
    if n > _MAX_SUMMARY or n + FOOTER_LEN > len(tail):
        return None
    summary = tail[-FOOTER_LEN - n : -FOOTER_LEN]
    if crc32(summary) != crc:
        return None
    return summary
