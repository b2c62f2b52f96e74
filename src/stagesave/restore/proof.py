"""Reading a file's proof, and checking a file against it.

Everything here reads through one :class:`~stagesave.stores.base.Reader`, so the proof and the bytes
it proves come from the same version of the file even while another process replaces it.

* :func:`peek` reads the last few KiB: the footer and summary of a format-2 torch or trailer
  file (its sequence number, its folder), or tells a plain file from a torn zip. It is what a
  listing costs per file.
* :func:`read_proof` reads and checks the whole proof: the summary, the proof record, and for a
  torch file the rest of the tail (index record, central directory, end records), rebuilt from
  the proven parts and compared byte for byte; for a safetensors file the proof in its header.
* :func:`chunk_problems` reads every covered byte and compares each chunk's digest.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import ManifestError
from ..ondisk.checksum import crc32, digest
from ..ondisk.manifest import Manifest, Summary, parse_index, parse_proof, parse_summary
from ..ondisk.names import INDEX_RECORD, PROOF_KEY, PROOF_RECORD
from ..ondisk.torchzip import FOOTER_LEN, FOOTER_MAGIC, TorchZip, build_tail, read_footer
from ..saving.write import TRAILER_KINDS, proof_value
from ..stores.base import Reader

__all__ = [
    "PARSE_LATER_BYTES", "Peek", "chunk_problems", "peek", "read_proof", "reporting", "run_chunks",
]

#: Bytes read from the end of a file to find its footer (a summary is ~200 bytes).
PEEK_BYTES = 4096
_MAX_SUMMARY_READ = 65_536
#: safetensors refuses headers over 100 MB; so do we.
_MAX_ST_HEADER = 100_000_000


@dataclass
class Peek:
    """What the end (or start) of a file says about it, without reading its proof."""

    #: 2: a format-2 stagesave file; 0: no stagesave footer (plain, safetensors, format 1).
    format: int
    summary: Summary | None = None
    #: A problem that makes the file unusable (torn zip, bad summary).
    problem: str | None = None


def _tail(reader: Reader, n: int) -> bytes:
    n = min(reader.size, n)
    return reader.read(reader.size - n, n)


def peek(reader: Reader) -> Peek:
    """The footer's summary of a format-2 file, or why a plain file cannot be a checkpoint."""
    tail = _tail(reader, PEEK_BYTES)
    raw = read_footer(tail, crc32)
    if raw is None and len(tail) >= FOOTER_LEN and reader.size > len(tail):
        raw = read_footer(_tail(reader, _MAX_SUMMARY_READ), crc32)  # a summary longer than usual
    if raw is not None:
        try:
            return Peek(2, parse_summary(raw, reader.where))
        except ManifestError as exc:
            return Peek(2, problem=str(exc))
    damaged = _damaged_footer(reader, tail)
    if damaged:
        return Peek(2, problem=damaged)
    return Peek(0, problem=_plain_problem(reader, tail))


def _damaged_footer(reader: Reader, tail: bytes) -> str | None:
    """A file that was written as format 2 but whose footer no longer checks out."""
    short = len(tail) < min(reader.size, _MAX_SUMMARY_READ)
    end = _tail(reader, _MAX_SUMMARY_READ) if short else tail
    if FOOTER_MAGIC in end or PROOF_RECORD.encode() in end:
        return (f"{reader.where}: its stagesave footer is damaged (the file was changed after it "
                f"was written)")
    return None


def _plain_problem(reader: Reader, tail: bytes) -> str | None:
    """For a file without a footer: is it at least a complete zip (not torn)?"""
    size = reader.size
    if size < 22:
        return f"{reader.where} is {size} bytes: too short to be a checkpoint"
    if reader.read(0, 4) != b"PK\x03\x04":
        return None  # not a zip: a legacy torch file or another format, loadable as such
    end = _tail(reader, 65_558) if len(tail) < min(size, 65_558) else tail
    if b"PK\x05\x06" not in end:
        return f"{reader.where} is a truncated zip (no end-of-archive record): a torn write"
    return None


@dataclass
class FileProof:
    """A file's proof as read: ``manifest`` is ``None`` when there is none (or it is broken)."""

    manifest: Manifest | None
    summary: Summary | None = None
    problems: list[str] = field(default_factory=list)
    #: 2 (embedded proof), 0 (none found: plain file, or format 1 to look for beside it).
    format: int = 0
    #: CRC-32 of the proof's bytes (what a folder's carrier pins its members by).
    proof_crc: int | None = None


#: From this size a load's tensor index is parsed beside the load rather than before it.
PARSE_LATER_BYTES = 256 << 10


def read_proof(reader: Reader, name: str, *, index: bool = True) -> FileProof:
    """Read and check the embedded proof of ``reader``'s file (``name``: its name in the folder).

    A file without a footer is tried as a safetensors file with a proof in its header; a file
    with neither returns ``format=0`` (plain, or format 1). ``index=False`` (a load): a large
    tensor index (:data:`PARSE_LATER_BYTES` or more) is checked against its digest here and
    left in ``manifest.pending_index`` for the caller to parse while it reads the data (100,000
    entries took half of this function's time); ``tensors`` and ``telemetry`` stay empty.
    """
    where = reader.where
    try:
        tail = _tail(reader, PEEK_BYTES)
        raw = read_footer(tail, crc32)
        if raw is None and reader.size > len(tail):
            tail = _tail(reader, _MAX_SUMMARY_READ)
            raw = read_footer(tail, crc32)
        if raw is None:
            damaged = _damaged_footer(reader, tail)
            if damaged:
                return FileProof(None, None, [damaged], 2)
            return _safetensors_proof(reader, name)
        summary = parse_summary(raw, where)
        end = reader.size - FOOTER_LEN - len(raw)
        if not 0 <= summary.proof_offset <= summary.proof_offset + summary.proof_len <= end:
            return FileProof(None, summary, [f"{where}: its summary points outside the file"], 2)
        proof = reader.read(summary.proof_offset, summary.proof_len)
        if len(proof) != summary.proof_len or crc32(proof) != summary.proof_crc:
            return FileProof(None, summary,
                             [f"{where}: its proof record is damaged (CRC mismatch)"], 2)
        manifest = parse_proof(proof, where, name, reader.size)
        problems = _consistent(summary, manifest, where)
        if not problems:
            if summary.kind == "torch":
                problems = _check_zip_tail(reader, manifest, summary, proof, raw, index)
            elif summary.kind in TRAILER_KINDS:
                if (summary.proof_offset != manifest.files[0].end
                        or summary.proof_offset + len(proof) != end):
                    problems = [f"{where}: the trailer does not follow the data it proves"]
            else:
                problems = [f"{where}: unknown kind {summary.kind!r} in its summary"]
        return FileProof(manifest if not problems else None, summary, problems, 2,
                         summary.proof_crc)
    except ManifestError as exc:
        return FileProof(None, None, [str(exc)], 2)


def _consistent(summary: Summary, manifest: Manifest, where: str) -> list[str]:
    entry = manifest.files[0]
    folder = manifest.folder
    if (summary.kind != entry.kind or summary.seq != manifest.seq
            or summary.created_ns != manifest.created_ns
            or summary.folder != (folder.token if folder else None)
            or summary.carrier != (folder.carrier if folder else None)):
        return [f"{where}: its summary and its proof disagree"]
    return []


_LH_FIXED = 30


@dataclass(frozen=True)
class ZipTail:
    """The parts of a format-2 torch file's tail that its proof pins (the rest is rebuilt)."""

    prefix: str
    index: bytes
    cd_prefix: bytes
    zip64: bool
    n_records: int
    covered: int

    def rebuild(self, proof: bytes, summary: bytes) -> bytes:
        """The tail these parts, this proof and this summary make."""
        zip_ = TorchZip(self.prefix, (), self.covered, self.cd_prefix, self.zip64)
        records = [(INDEX_RECORD, self.index), (PROOF_RECORD, proof)]
        tail, _ = build_tail(zip_, self.cd_prefix, records, summary, crc32=crc32,
                             n_records=self.n_records)
        return tail


def zip_tail_parts(
    tail: bytes, covered: int, proof_offset: int, proof_len: int, summary_len: int,
) -> ZipTail | None:
    """Split ``tail`` (the bytes from ``covered`` to the end) into index, torch's CD and the rest;
    ``None`` when it does not have the shape format 2 writes."""
    try:
        sig, = struct.unpack_from("<I", tail, 0)
        nlen, = struct.unpack_from("<H", tail, 26)
        name = tail[_LH_FIXED : _LH_FIXED + nlen].decode()
    except (struct.error, UnicodeDecodeError):
        return None
    prefix, _, rel = name.partition("/")
    proof_name_len = len(f"{prefix}/{PROOF_RECORD}")
    index_at = covered + _LH_FIXED + nlen
    index_len = proof_offset - _LH_FIXED - proof_name_len - index_at
    if sig != 0x04034B50 or rel != INDEX_RECORD or index_len < 0:
        return None
    index = tail[index_at - covered : index_at - covered + index_len]
    ours = sum(46 + len(f"{prefix}/{r}") + (12 if off >= 0xFFFFFFFF else 0)
               for r, off in ((INDEX_RECORD, covered), (PROOF_RECORD, index_at + index_len)))
    end_len = 22 + summary_len + FOOTER_LEN
    eocd = tail[-end_len:]
    try:
        n_total = struct.unpack_from("<H", eocd, 10)[0]
        cd_size = struct.unpack_from("<I", eocd, 12)[0]
    except struct.error:
        return None
    zip64 = tail[-(end_len + 20) : -end_len][:4] == b"PK\x06\x07"
    if zip64:
        rec_at = len(tail) - (end_len + 20 + 56)
        if rec_at < 0:
            return None
        _, n_total, cd_size = struct.unpack_from("<QQQ", tail, rec_at + 24)
    cd_start = proof_offset + proof_len
    cd_prefix_len = cd_size - ours
    if cd_prefix_len < 0 or n_total < 2 or cd_start - covered + cd_prefix_len > len(tail):
        return None
    cd_prefix = tail[cd_start - covered : cd_start - covered + cd_prefix_len]
    return ZipTail(prefix, index, cd_prefix, zip64, n_total - 2, covered)


def _check_zip_tail(
    reader: Reader, manifest: Manifest, summary: Summary, proof: bytes, raw: bytes,
    index: bool = True,
) -> list[str]:
    """Rebuild the tail of a torch file from its proven parts and compare it with the file's."""
    entry = manifest.files[0]
    where = reader.where
    covered = entry.end
    tail = reader.read(covered, reader.size - covered)
    if len(tail) != reader.size - covered:
        return [f"{where}: truncated in its tail"]
    parts = zip_tail_parts(tail, covered, summary.proof_offset, len(proof), len(raw))
    if parts is None:
        return [f"{where}: its zip tail is damaged"]
    zip_digests = manifest.zip_digests or {}
    if digest(entry.algorithm, parts.index) != zip_digests.get("index"):
        return [f"{where}: its tensor index does not match its proof"]
    if digest(entry.algorithm, parts.cd_prefix) != zip_digests.get("cd"):
        return [f"{where}: its central directory does not match its proof"]
    if parts.rebuild(proof, raw) != tail:
        return [f"{where}: its zip tail differs from the one its proof implies"]
    if index or len(parts.index) < PARSE_LATER_BYTES:
        manifest.tensors, manifest.telemetry = parse_index(parts.index, where)
    else:
        manifest.pending_index = parts.index
    return []


def _safetensors_proof(reader: Reader, name: str) -> FileProof:
    """The proof in a safetensors header's ``__metadata__`` (format 2), if there is one."""
    where = reader.where
    if reader.size < 8:
        return FileProof(None)
    n = struct.unpack("<Q", reader.read(0, 8))[0]
    if not 2 <= n <= min(_MAX_ST_HEADER, reader.size - 8):
        return FileProof(None)
    header = reader.read(8, n)
    if not header.startswith(b"{"):
        return FileProof(None)
    try:
        doc = json.loads(header)
    except (ValueError, RecursionError):
        return FileProof(None)
    meta = doc.get("__metadata__") if isinstance(doc, dict) else None
    value = meta.get(PROOF_KEY) if isinstance(meta, dict) else None
    if not isinstance(value, str):
        return FileProof(None)
    try:
        manifest = parse_proof(value.rstrip(" ").encode(), where, name, reader.size)
    except ManifestError as exc:
        return FileProof(None, None, [str(exc)], 2)
    entry = manifest.files[0]
    if entry.kind != "safetensors" or entry.blank is None or entry.end != reader.size:
        return FileProof(None, None,
                         [f"{where}: its proof does not describe a whole safetensors file"], 2)
    at, length = entry.blank
    proof = value.rstrip(" ").encode()
    if at + length > 8 + n or reader.read(at, length) != proof_value(proof, length):
        return FileProof(None, None, [f"{where}: its proof is not where its proof says"], 2)
    return FileProof(manifest, None, [], 2, crc32(proof))


def chunk_problems(
    reader: Reader | None, manifest: Manifest, pool: cf.Executor | None = None,
    read: Callable[[int, int], memoryview | bytes] | None = None,
    indices: Iterable[int] | None = None, *, where: str | None = None,
    meanwhile: Callable[[], None] | None = None,
    done: Callable[[int, str | None], None] | None = None,
) -> list[str]:
    """Recompute every chunk digest of the (single) file ``manifest`` proves; the problems.

    The one chunk verifier: loads, ``verify()``, ``latest()``, the CLI, the sharded reader and
    copies to another tier all check chunks here. ``read(lo, n)`` overrides how bytes are read
    (bytes already in memory, a sharded load's window; then ``reader`` may be ``None`` and
    ``where`` names the file in messages); ``indices``: the chunks to check (default: all);
    ``meanwhile``: run on the calling thread once every chunk is handed to ``pool`` (every chunk
    is done with before this returns, whatever raises: :func:`run_chunks`); ``done(i,
    problem)``: called on the thread that checked chunk ``i`` (``problem``: ``"raised"`` if the
    check raised).
    """
    entry = manifest.files[0]
    if reader is not None:
        where = where or reader.where
        get = read or reader.read
    elif read is None or where is None:
        raise TypeError("chunk_problems needs a reader, or read= and where=")
    else:
        get = read
    blank = entry.blank

    def check(i: int) -> str | None:
        lo, hi = entry.chunk_range(i)
        data: memoryview | bytes | bytearray = get(lo, hi - lo)
        if len(data) != hi - lo:
            return f"{where}: truncated at byte {lo + len(data)} (expected {entry.end} bytes)"
        if blank is not None and lo < blank[0] + blank[1] and blank[0] < hi:
            b = bytearray(data)
            a, z = max(lo, blank[0]), min(hi, blank[0] + blank[1])
            b[a - lo : z - lo] = b" " * (z - a)
            data = b
        if digest(entry.algorithm, data) != entry.chunks[i]:
            return f"{where}: checksum mismatch in bytes [{lo}, {hi}) (chunk {i})"
        return None

    job = check if done is None else reporting(check, done)
    if indices is None:
        indices = range(len(entry.chunks))
    return [r for r in run_chunks(pool, job, indices, meanwhile) if r]


def reporting(job: Callable[[int], str | None],
              done: Callable[[int, str | None], None]) -> Callable[[int], str | None]:
    """``job`` that also calls ``done(i, its problem)`` when chunk ``i`` is finished (its problem
    ``"raised"`` where it raised)."""

    def run(i: int) -> str | None:
        problem: str | None = "raised"
        try:
            problem = job(i)
            return problem
        finally:
            done(i, problem)

    return run


def run_chunks(pool: cf.Executor | None, job: Callable[[int], str | None],
               indices: Iterable[int], meanwhile: Callable[[], None] | None = None,
               ) -> list[str | None]:
    """``job(i)`` for each chunk on ``pool`` (in order on this thread without one), ``meanwhile``
    on this thread while they run; what each returned, in order. Every job has finished before
    this returns or raises (a job's exception, the first in chunk order, or ``meanwhile``'s):
    the jobs write into memory, and read through descriptors, that the caller then frees."""
    if pool is None:
        if meanwhile is not None:
            meanwhile()
        return [job(i) for i in indices]
    futures = [pool.submit(job, i) for i in indices]
    try:
        if meanwhile is not None:
            meanwhile()
    finally:
        cf.wait(futures)
    return [f.result() for f in futures]
