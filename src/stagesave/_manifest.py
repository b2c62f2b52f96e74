"""The sidecar manifest: what was committed, and how to prove it.

The manifest is untrusted input when read back (a checkpoint may come from anywhere), so
:func:`parse_manifest` checks everything before anything else uses it: size caps, schema
version, names that stay inside the checkpoint, integer fields in range, digests of the declared
algorithm, storage records inside the file and not overlapping.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ._checksum import ALGORITHMS, DIGEST_HEX_LEN
from ._names import FORMAT_TAG, MAX_FILE_BYTES, MAX_MANIFEST_BYTES, SCHEMA_VERSION
from ._store import check_name
from .errors import ManifestError

__all__ = ["FileEntry", "Manifest", "StorageRecord", "parse_manifest"]

_MAX_CHUNK = 1 << 40
_MAX_ENTRIES = 10_000_000


@dataclass(frozen=True)
class StorageRecord:
    key: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class FileEntry:
    """One committed data file."""

    name: str
    size: int
    algorithm: str
    chunk_bytes: int
    chunks: tuple[str, ...]
    kind: str = "torch"
    serialization_id: str | None = None
    id_offset: int | None = None
    storages: tuple[StorageRecord, ...] = ()

    def chunk_range(self, i: int) -> tuple[int, int]:
        lo = i * self.chunk_bytes
        return lo, min(self.size, lo + self.chunk_bytes)


@dataclass
class Manifest:
    files: list[FileEntry]
    created_ns: int
    tensors: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    telemetry: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_TAG,
            "schema": self.schema,
            "created_ns": self.created_ns,
            "files": [
                {
                    **{k: v for k, v in asdict(f).items() if k not in ("chunks", "storages")},
                    "chunks": list(f.chunks),
                    "storages": [asdict(s) for s in f.storages],
                }
                for f in self.files
            ],
            "tensors": self.tensors,
            "metadata": self.metadata,
            "telemetry": self.telemetry,
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _fail(where: str, problem: str) -> ManifestError:
    return ManifestError(f"invalid manifest {where}: {problem}")


def _int(v: Any, what: str, where: str, lo: int = 0, hi: int = MAX_FILE_BYTES) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _fail(where, f"{what} must be an integer in [{lo}, {hi}], got {v!r:.60}")
    return v


def _str(v: Any, what: str, where: str, max_len: int = 4096) -> str:
    if not isinstance(v, str) or len(v) > max_len:
        raise _fail(where, f"{what} must be a string of at most {max_len} characters")
    return v


def _parse_file(doc: Any, where: str) -> FileEntry:
    if not isinstance(doc, dict):
        raise _fail(where, "a file entry is not an object")
    name = _str(doc.get("name"), "file name", where)
    try:
        check_name(name)
    except ValueError as exc:
        raise _fail(where, f"file name {name!r} escapes the checkpoint (absolute, '..' or URL)") from exc
    size = _int(doc.get("size"), "size", where)
    algorithm = _str(doc.get("algorithm"), "algorithm", where, 32)
    if algorithm not in ALGORITHMS:
        raise _fail(where, f"unknown checksum algorithm {algorithm!r}")
    chunk_bytes = _int(doc.get("chunk_bytes"), "chunk_bytes", where, 1, _MAX_CHUNK)
    chunks = doc.get("chunks")
    expected = math.ceil(size / chunk_bytes) if size else 0
    if not isinstance(chunks, list) or len(chunks) != expected:
        raise _fail(where, f"{name}: expected {expected} chunk digests for {size} bytes")
    hex_len = DIGEST_HEX_LEN[algorithm]
    for c in chunks:
        if not isinstance(c, str) or len(c) != hex_len or not all(ch in "0123456789abcdef" for ch in c):
            raise _fail(where, f"{name}: a chunk digest is not {hex_len} lowercase hex digits")
    kind = _str(doc.get("kind", "torch"), "kind", where, 32)
    sid = doc.get("serialization_id")
    id_offset = doc.get("id_offset")
    if sid is not None:
        sid = _str(sid, "serialization_id", where, 64)
        if not sid.isalnum():
            raise _fail(where, "serialization_id must be alphanumeric")
        id_offset = _int(id_offset, "id_offset", where, 0, max(0, size - len(sid)))
    elif id_offset is not None:
        raise _fail(where, "id_offset without serialization_id")
    raw_storages = doc.get("storages", [])
    if not isinstance(raw_storages, list) or len(raw_storages) > _MAX_ENTRIES:
        raise _fail(where, "storages must be a list")
    storages = []
    for s in raw_storages:
        if not isinstance(s, dict):
            raise _fail(where, "a storage record is not an object")
        rec = StorageRecord(
            key=_str(s.get("key"), "storage key", where, 64),
            offset=_int(s.get("offset"), "storage offset", where),
            nbytes=_int(s.get("nbytes"), "storage size", where),
        )
        if rec.offset + rec.nbytes > size:
            raise _fail(where, f"storage {rec.key} lies outside the file ({rec.offset}+{rec.nbytes} > {size})")
        storages.append(rec)
    ordered = sorted(storages, key=lambda r: r.offset)
    for a, b in itertools.pairwise(ordered):
        if a.offset + a.nbytes > b.offset:
            raise _fail(where, f"storages {a.key} and {b.key} overlap")
    return FileEntry(
        name=name,
        size=size,
        algorithm=algorithm,
        chunk_bytes=chunk_bytes,
        chunks=tuple(chunks),
        kind=kind,
        serialization_id=sid,
        id_offset=id_offset,
        storages=tuple(storages),
    )


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes read from ``where``.

    Raises:
        ManifestError: anything is wrong; the message names the manifest and the problem.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise _fail(where, f"{len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    if not data.strip():
        raise _fail(where, "the file is empty")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _fail(where, f"not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_TAG:
        raise _fail(where, "not a stagesave manifest")
    schema = doc.get("schema")
    if schema != SCHEMA_VERSION:
        raise _fail(
            where,
            f"schema {schema!r} is not supported by this stagesave (reads schema {SCHEMA_VERSION}); "
            "upgrade stagesave to read it",
        )
    created = _int(doc.get("created_ns"), "created_ns", where, 0, 1 << 64)
    files_doc = doc.get("files")
    if not isinstance(files_doc, list) or not files_doc or len(files_doc) > 1_000_000:
        raise _fail(where, "files must be a non-empty list")
    files = [_parse_file(f, where) for f in files_doc]
    if len({f.name for f in files}) != len(files):
        raise _fail(where, "a file is listed twice")
    tensors = doc.get("tensors", [])
    metadata = doc.get("metadata", {})
    telemetry = doc.get("telemetry", {})
    if not isinstance(tensors, list) or not isinstance(metadata, dict) or not isinstance(telemetry, dict):
        raise _fail(where, "tensors must be a list, metadata and telemetry objects")
    return Manifest(files, created, tensors, metadata, telemetry, schema)
