"""The proof of a checkpoint: what was committed, and how to check it.

Format 2 (written by this version) keeps the proof *inside* each file: a zip record of torch
files, a ``__metadata__`` entry of safetensors files, a trailer of files whose readers ignore
trailing bytes (sharded DCP files). A small *summary* closes every file that has a footer (torch
and trailer files): the save's sequence number and where the proof is, so that listing a
directory reads a few hundred bytes per checkpoint. Format 1 (sidecar ``*.stagesave.json``
files) is still read.

Both are untrusted input when read back (a checkpoint may come from anywhere), so the parsers
check everything before anything else uses it: size caps, schema version, names that stay
inside the checkpoint, integer fields in range, digests of the declared algorithm, storage
records inside the file and not overlapping, every entry of the tensor index typed and bounded
(a shape's rank and element count), metadata and telemetry free of NaN and infinities (JSON has
none, but Python's parser reads ``1e999`` as infinity) and nested at most :data:`MAX_DEPTH`
deep. A proof that fails any check is refused as corrupt, with the field named: whatever is
called verified can be printed, listed and written out as JSON as it is.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import ManifestError
from ..stores.base import check_name
from ..telemetry import SaveTelemetry
from .checksum import ALGORITHMS, CRYPTOGRAPHIC, DIGEST_HEX_LEN
from .names import FORMAT_TAG, MAX_FILE_BYTES, MAX_MANIFEST_BYTES, SCHEMA_VERSION
from .signing import check_doc
from .signing import current as signing_keys

__all__ = [
    "FileEntry", "FolderProof", "Manifest", "Member", "StorageRecord", "Summary", "parse_manifest",
    "parse_proof", "parse_summary",
]

_MAX_CHUNK = 1 << 40
_MAX_ENTRIES = 10_000_000
_MAX_SEQ = 1 << 62
#: Deepest nesting of a proof's metadata and telemetry (a user's metadata is JSON; nobody nests
#: it this deep, and every reader can print it without running out of stack).
MAX_DEPTH = 100
#: Most dimensions of a tensor in the index (torch itself sets no limit; no real tensor comes near).
MAX_RANK = 1024
#: Largest element count, dimension, stride and offset of a tensor in the index.
MAX_NUMEL = 1 << 62
#: Longest tensor name in the index.
_MAX_TENSOR_NAME = 65_536
#: Telemetry integers stay within what converts to a float.
_MAX_TELEMETRY_INT = 1 << 63
#: Schema of the embedded proof (format 2).
SCHEMA_EMBEDDED = 2


@dataclass(frozen=True)
class StorageRecord:
    key: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class FileEntry:
    """One data file and the checksums that prove it.

    ``chunks`` cover ``[0, covered)`` (``covered`` defaults to ``size``); a format-2 file's
    bytes past ``covered`` (the zip tail, the trailer) are checked by rebuilding them from the
    proof. ``blank`` is a region hashed as spaces (the proof's own place in a safetensors header).
    """

    name: str
    size: int
    algorithm: str
    chunk_bytes: int
    chunks: tuple[str, ...]
    kind: str = "torch"
    serialization_id: str | None = None
    id_offset: int | None = None
    storages: tuple[StorageRecord, ...] = ()
    covered: int | None = None
    blank: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        """End of the bytes the chunks cover."""
        return self.size if self.covered is None else self.covered

    def chunk_range(self, i: int) -> tuple[int, int]:
        lo = i * self.chunk_bytes
        return lo, min(self.end, lo + self.chunk_bytes)


@dataclass(frozen=True)
class Member:
    """A file of a folder checkpoint that carries its own proof, as the folder's carrier pins it."""

    name: str
    size: int
    proof_crc: int


@dataclass
class FolderProof:
    """What makes a folder one checkpoint (format 2): a token shared by its files, and, in the
    carrier (the file written last), every other file of the folder.

    ``members`` carry their own proofs (the carrier pins each by size and the CRC of its proof);
    ``listed`` are files stagesave did not lay out (hook files, raw files): the carrier holds
    their checksums; ``nested`` are sub-folders that are folder checkpoints of their own (an
    FSDP checkpoint's DCP parts), each proven by its own carrier. A file in the folder that none
    of them names makes the folder invalid.
    """

    token: str
    carrier: str
    members: list[Member] = field(default_factory=list)
    listed: list[FileEntry] = field(default_factory=list)
    nested: list[str] = field(default_factory=list)

    def names(self) -> set[str]:
        return {self.carrier, *(m.name for m in self.members), *(f.name for f in self.listed)}

    def to_doc(self, with_files: bool) -> dict[str, Any]:
        doc: dict[str, Any] = {"token": self.token, "carrier": self.carrier}
        if with_files:
            doc["members"] = [[m.name, m.size, m.proof_crc] for m in self.members]
            doc["listed"] = [_entry_doc(f) for f in self.listed]
            if self.nested:
                doc["nested"] = list(self.nested)
        return doc


@dataclass
class Manifest:
    files: list[FileEntry]
    created_ns: int
    tensors: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    telemetry: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION
    #: Format 2: the per-directory sequence number that orders checkpoints.
    seq: int | None = None
    #: Format 2, folder checkpoints: the folder's proof (from its carrier).
    folder: FolderProof | None = None
    #: Format 2, torch files: digests of the central directory and the index record.
    zip_digests: dict[str, str] | None = None

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_json(self) -> bytes:
        """The format-1 sidecar JSON (written only by ``stagesave adopt``)."""
        doc = {
            "format": FORMAT_TAG,
            "schema": SCHEMA_VERSION,
            "created_ns": self.created_ns,
            "files": [_entry_doc(f) for f in self.files],
            "tensors": self.tensors,
            "metadata": self.metadata,
            "telemetry": self.telemetry,
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _entry_doc(f: FileEntry) -> dict[str, Any]:
    doc = {k: v for k, v in asdict(f).items() if k not in ("chunks", "storages", "covered", "blank")}
    doc["chunks"] = list(f.chunks)
    doc["storages"] = [asdict(s) for s in f.storages]
    return doc


def proof_doc(
    entry: FileEntry, *, seq: int | None, created_ns: int, metadata: dict[str, Any],
    folder: dict[str, Any] | None, zip_digests: dict[str, str] | None,
) -> dict[str, Any]:
    """The format-2 proof of one file, as a JSON document."""
    return {
        "format": FORMAT_TAG,
        "schema": SCHEMA_EMBEDDED,
        "kind": entry.kind,
        "seq": seq,
        "created_ns": created_ns,
        "covered": entry.end,
        "algorithm": entry.algorithm,
        "chunk_bytes": entry.chunk_bytes,
        "chunks": list(entry.chunks),
        "serialization_id": entry.serialization_id,
        "id_offset": entry.id_offset,
        "storages": [[s.key, s.offset, s.nbytes] for s in entry.storages],
        "blank": list(entry.blank) if entry.blank is not None else None,
        "zip": zip_digests,
        "metadata": metadata,
        "folder": folder,
    }


def dumps(doc: Any) -> bytes:
    """Compact JSON, refusing NaN and infinities (they are not JSON)."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True)
class Summary:
    """The few facts a listing needs, at the end of every torch/trailer file of format 2."""

    kind: str
    #: ``None`` for the files of a folder other than its carrier (the carrier's counts).
    seq: int | None
    created_ns: int
    proof_offset: int
    proof_len: int
    proof_crc: int
    folder: str | None = None
    carrier: str | None = None

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "v": SCHEMA_EMBEDDED, "kind": self.kind, "seq": self.seq, "created_ns": self.created_ns,
            "proof": [self.proof_offset, self.proof_len, self.proof_crc],
        }
        if self.folder is not None:
            doc["folder"] = self.folder
            doc["carrier"] = self.carrier
        return dumps(doc)


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


def _json(data: bytes, where: str) -> Any:
    if len(data) > MAX_MANIFEST_BYTES:
        raise _fail(where, f"{len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    if not data.strip():
        raise _fail(where, "the file is empty")
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise _fail(where, f"not valid JSON ({exc})") from exc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _kind(v: Any, where: str) -> str:
    kind = _str(v, "kind", where, 32)
    if not kind or not all(ch.isascii() and (ch.isalnum() or ch == "-") for ch in kind):
        raise _fail(where, f"kind {kind!r} is not a file kind (letters, digits and '-')")
    return kind


def _path(what: str, parts: tuple[str | int, ...]) -> str:
    return what + "".join(f"[{p}]" if isinstance(p, int) else f"[{p[:40]!r}]" for p in parts)


def _plain_json(v: Any, what: str, where: str) -> None:
    """``v`` (read from JSON) holds finite numbers only and nests at most :data:`MAX_DEPTH` deep.

    Raises:
        ManifestError: naming the first offending field.
    """
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(v, ())]
    while stack:
        x, parts = stack.pop()
        if isinstance(x, float):
            if not math.isfinite(x):
                raise _fail(where, f"{_path(what, parts)} is {x!r}: JSON has no NaN or infinity "
                                   "(a number such as 1e999 reads as one)")
        elif isinstance(x, (dict, list)):
            if len(parts) >= MAX_DEPTH:
                raise _fail(where, f"{_path(what, parts)} nests deeper than {MAX_DEPTH} levels")
            items = x.items() if isinstance(x, dict) else enumerate(x)
            stack.extend((item, (*parts, key)) for key, item in items)


#: ``plain_json(value, what, where)``: the check above, for values about to be written
#: (``Checkpointer.save`` refuses metadata a reader would refuse).
plain_json = _plain_json


def _object(v: Any, what: str, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _fail(where, f"{what} must be an object, got {type(v).__name__}")
    _plain_json(v, what, where)
    return v


def _telemetry_types() -> dict[str, frozenset[str]]:
    """The JSON types each field of :class:`SaveTelemetry` may hold (from its annotations)."""
    out = {}
    for f in fields(SaveTelemetry):
        names = {n.strip() for n in str(f.type).split("|")}
        out[f.name] = frozenset(names | ({"int"} if "float" in names else set()))
    return out


_TELEMETRY_TYPES = _telemetry_types()


def _json_type(v: Any) -> str:
    if v is None:
        return "None"
    if isinstance(v, bool):
        return "bool"
    return type(v).__name__


def _telemetry(v: Any, where: str) -> dict[str, Any]:
    """The save's telemetry: an object; its known fields of their type, numbers finite and in range."""
    tel = _object(v, "telemetry", where)
    for key, value in tel.items():
        what = _path("telemetry", (key,))
        allowed = _TELEMETRY_TYPES.get(key)
        if allowed is not None and _json_type(value) not in allowed:
            raise _fail(where, f"{what} must be {' or '.join(sorted(allowed))}, got {_json_type(value)}")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _MAX_TELEMETRY_INT:
            raise _fail(where, f"{what} is out of range")
        if isinstance(value, str) and len(value) > 65_536:
            raise _fail(where, f"{what} is longer than 65536 characters")
    return tel


_TENSOR_FIELDS = frozenset({"name", "dtype", "shape", "stride", "storage_offset", "storage"})


def _tensor(t: Any, i: int, where: str) -> dict[str, Any]:
    """One entry of the tensor index: typed, its shape's rank and element count bounded."""
    what = f"tensors[{i}]"
    if not isinstance(t, dict):
        raise _fail(where, f"{what} is not an object")
    _str(t.get("name"), f"{what}.name", where, _MAX_TENSOR_NAME)
    _str(t.get("dtype"), f"{what}.dtype", where, 64)
    shape = t.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise _fail(where, f"{what}.shape must be a list of at most {MAX_RANK} dimensions")
    numel = 1
    for d in shape:
        numel = min(numel * _int(d, f"{what}.shape dimension", where, 0, MAX_NUMEL), MAX_NUMEL + 1)
    if numel > MAX_NUMEL:
        raise _fail(where, f"{what}.shape has more than {MAX_NUMEL} elements")
    stride = t.get("stride")
    if stride is not None:
        if not isinstance(stride, list) or len(stride) not in (0, len(shape)):  # []: not known (adopted)
            raise _fail(where, f"{what}.stride must be a list as long as its shape")
        for d in stride:
            _int(d, f"{what}.stride", where, 0, MAX_NUMEL)
    if t.get("storage_offset") is not None:
        _int(t["storage_offset"], f"{what}.storage_offset", where, 0, MAX_NUMEL)
    if t.get("storage") is not None:
        _str(t["storage"], f"{what}.storage", where, 64)
    if not _TENSOR_FIELDS.issuperset(t):
        _plain_json({k: v for k, v in t.items() if k not in _TENSOR_FIELDS}, what, where)
    return t


def _tensors(v: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(v, list) or len(v) > _MAX_ENTRIES:
        raise _fail(where, "tensors must be a list")
    return [_tensor(t, i, where) for i, t in enumerate(v)]


def _chunks(chunks: Any, algorithm: str, n_bytes: int, chunk_bytes: int, what: str, where: str) -> tuple[str, ...]:
    expected = math.ceil(n_bytes / chunk_bytes) if n_bytes else 0
    if not isinstance(chunks, list) or len(chunks) != expected:
        raise _fail(where, f"{what}: expected {expected} chunk digests for {n_bytes} bytes")
    hex_len = DIGEST_HEX_LEN[algorithm]
    for c in chunks:
        if not isinstance(c, str) or len(c) != hex_len or not all(ch in "0123456789abcdef" for ch in c):
            raise _fail(where, f"{what}: a chunk digest is not {hex_len} lowercase hex digits")
    return tuple(chunks)


def _algorithm(doc: dict[str, Any], where: str) -> str:
    algorithm = _str(doc.get("algorithm"), "algorithm", where, 32)
    if algorithm not in ALGORITHMS:
        raise _fail(where, f"unknown checksum algorithm {algorithm!r}")
    return algorithm


def _storages(raw: Any, size: int, where: str, compact: bool) -> tuple[StorageRecord, ...]:
    if not isinstance(raw, list) or len(raw) > _MAX_ENTRIES:
        raise _fail(where, "storages must be a list")
    out = []
    for s in raw:
        if compact:
            if not isinstance(s, list) or len(s) != 3:
                raise _fail(where, "a storage record is not [key, offset, nbytes]")
            key, off, n = s
        else:
            if not isinstance(s, dict):
                raise _fail(where, "a storage record is not an object")
            key, off, n = s.get("key"), s.get("offset"), s.get("nbytes")
        rec = StorageRecord(_str(key, "storage key", where, 64), _int(off, "storage offset", where),
                            _int(n, "storage size", where))
        if rec.offset + rec.nbytes > size:
            raise _fail(where, f"storage {rec.key} lies outside the file ({rec.offset}+{rec.nbytes} > {size})")
        out.append(rec)
    for a, b in itertools.pairwise(sorted(out, key=lambda r: r.offset)):
        if a.offset + a.nbytes > b.offset:
            raise _fail(where, f"storages {a.key} and {b.key} overlap")
    return tuple(out)


def _name(v: Any, where: str) -> str:
    name = _str(v, "file name", where)
    try:
        check_name(name)
    except ValueError as exc:
        raise _fail(where, f"file name {name!r} escapes the checkpoint (absolute, '..' or URL)") from exc
    return name


def _serialization_id(doc: dict[str, Any], size: int, where: str) -> tuple[str | None, int | None]:
    """A torch file's ``serialization_id`` and where it sits (inside ``size`` bytes)."""
    sid = doc.get("serialization_id")
    id_offset = doc.get("id_offset")
    if sid is None:
        if id_offset is not None:
            raise _fail(where, "id_offset without serialization_id")
        return None, None
    sid = _str(sid, "serialization_id", where, 64)
    if not sid.isalnum():
        raise _fail(where, "serialization_id must be alphanumeric")
    return sid, _int(id_offset, "id_offset", where, 0, max(0, size - len(sid)))


def _parse_file(doc: Any, where: str) -> FileEntry:
    if not isinstance(doc, dict):
        raise _fail(where, "a file entry is not an object")
    name = _name(doc.get("name"), where)
    size = _int(doc.get("size"), "size", where)
    algorithm = _algorithm(doc, where)
    chunk_bytes = _int(doc.get("chunk_bytes"), "chunk_bytes", where, 1, _MAX_CHUNK)
    chunks = _chunks(doc.get("chunks"), algorithm, size, chunk_bytes, name, where)
    kind = _kind(doc.get("kind", "torch"), where)
    sid, id_offset = _serialization_id(doc, size, where)
    storages = _storages(doc.get("storages", []), size, where, compact=False)
    return FileEntry(name=name, size=size, algorithm=algorithm, chunk_bytes=chunk_bytes, chunks=chunks,
                     kind=kind, serialization_id=sid, id_offset=id_offset, storages=storages)


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate a format-1 sidecar manifest read from ``where``.

    Raises:
        ManifestError: anything is wrong; the message names the manifest and the problem.
    """
    doc = _json(data, where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_TAG:
        raise _fail(where, "not a stagesave manifest")
    keys = signing_keys()
    if keys is not None and keys.require:
        raise _fail(where, "format 1 cannot be signed, and signatures are required (stagesave migrate rewrites it)")
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
    tensors = _tensors(doc.get("tensors", []), where)
    metadata = _object(doc.get("metadata", {}), "metadata", where)
    telemetry = _telemetry(doc.get("telemetry", {}), where)
    return Manifest(files, created, tensors, metadata, telemetry, schema)


def _as_proof_error(fn: Any) -> Any:
    """Say "proof" rather than "manifest" in the errors of the format-2 parsers."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ManifestError as exc:
            raise ManifestError(str(exc).replace("invalid manifest ", "invalid proof ", 1)) from None

    return wrapper


@_as_proof_error
def parse_summary(data: bytes, where: str) -> Summary:
    """Parse the summary at the end of a format-2 file.

    Raises:
        ManifestError: not a valid summary.
    """
    doc = _json(data, where)
    if not isinstance(doc, dict) or doc.get("v") != SCHEMA_EMBEDDED:
        raise _fail(where, "the summary is not of stagesave format 2 (written by a newer stagesave?)")
    proof = doc.get("proof")
    if not isinstance(proof, list) or len(proof) != 3:
        raise _fail(where, "the summary does not locate the proof")
    folder = doc.get("folder")
    carrier = doc.get("carrier")
    if folder is not None:
        folder = _str(folder, "folder token", where, 64)
        carrier = _name(carrier, where)
    seq = doc.get("seq")
    if seq is not None or folder is None:
        seq = _int(seq, "seq", where, 0, _MAX_SEQ)
    return Summary(
        kind=_kind(doc.get("kind"), where),
        seq=seq,
        created_ns=_int(doc.get("created_ns"), "created_ns", where, 0, 1 << 64),
        proof_offset=_int(proof[0], "proof offset", where),
        proof_len=_int(proof[1], "proof length", where, 1, MAX_MANIFEST_BYTES),
        proof_crc=_int(proof[2], "proof crc", where, 0, 0xFFFFFFFF),
        folder=folder,
        carrier=carrier,
    )


def _folder(doc: Any, where: str) -> FolderProof | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise _fail(where, "folder must be an object")
    token = _str(doc.get("token"), "folder token", where, 64)
    carrier = _name(doc.get("carrier"), where)
    members = []
    raw_members = doc.get("members", [])
    if not isinstance(raw_members, list) or len(raw_members) > 1_000_000:
        raise _fail(where, "folder members must be a list")
    for m in raw_members:
        if not isinstance(m, list) or len(m) != 3:
            raise _fail(where, "a folder member is not [name, size, proof_crc]")
        members.append(Member(_name(m[0], where), _int(m[1], "member size", where),
                              _int(m[2], "member proof crc", where, 0, 0xFFFFFFFF)))
    raw_listed = doc.get("listed", [])
    if not isinstance(raw_listed, list) or len(raw_listed) > 1_000_000:
        raise _fail(where, "folder listed files must be a list")
    listed = [_parse_file(f, where) for f in raw_listed]
    raw_nested = doc.get("nested", [])
    if not isinstance(raw_nested, list) or len(raw_nested) > 100_000:
        raise _fail(where, "nested folders must be a list")
    nested = [_name(n, where) for n in raw_nested]
    proof = FolderProof(token, carrier, members, listed, nested)
    names = [carrier, *(m.name for m in members), *(f.name for f in listed), *nested]
    if len(set(names)) != len(names):
        raise _fail(where, "a folder file is named twice")
    return proof


@_as_proof_error
def parse_proof(data: bytes, where: str, name: str, size: int) -> Manifest:
    """Parse and validate a format-2 proof of the file ``name`` of ``size`` bytes.

    Raises:
        ManifestError: anything is wrong; the message names the file and the problem.
    """
    doc = _json(data, where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_TAG:
        raise _fail(where, "not a stagesave proof")
    if doc.get("schema") != SCHEMA_EMBEDDED:
        raise _fail(where, f"schema {doc.get('schema')!r} is not supported by this stagesave; upgrade it")
    kind = _kind(doc.get("kind"), where)
    covered = _int(doc.get("covered"), "covered", where, 0, size)
    algorithm = _algorithm(doc, where)
    check_doc(doc, where, signing_keys(), cryptographic=algorithm in CRYPTOGRAPHIC)
    chunk_bytes = _int(doc.get("chunk_bytes"), "chunk_bytes", where, 1, _MAX_CHUNK)
    chunks = _chunks(doc.get("chunks"), algorithm, covered, chunk_bytes, name, where)
    sid, id_offset = _serialization_id(doc, covered, where)
    blank = doc.get("blank")
    if blank is not None:
        if not isinstance(blank, list) or len(blank) != 2:
            raise _fail(where, "blank must be [offset, length]")
        lo = _int(blank[0], "blank offset", where, 0, covered)
        blank = (lo, _int(blank[1], "blank length", where, 0, covered - lo))
    zip_digests = doc.get("zip")
    hex_len = DIGEST_HEX_LEN[algorithm]
    if zip_digests is not None and (
        not isinstance(zip_digests, dict) or set(zip_digests) != {"cd", "index"}
        or not all(isinstance(v, str) and len(v) == hex_len for v in zip_digests.values())
    ):
        raise _fail(where, "zip must hold the digests of the central directory and the index")
    metadata = _object(doc.get("metadata", {}), "metadata", where)
    entry = FileEntry(
        name=name, size=size, algorithm=algorithm, chunk_bytes=chunk_bytes, chunks=chunks, kind=kind,
        serialization_id=sid, id_offset=id_offset,
        storages=_storages(doc.get("storages", []), covered, where, compact=True),
        covered=covered, blank=blank,
    )
    manifest = Manifest(
        files=[entry], created_ns=_int(doc.get("created_ns"), "created_ns", where, 0, 1 << 64),
        metadata=metadata, schema=SCHEMA_EMBEDDED, folder=_folder(doc.get("folder"), where),
        zip_digests=zip_digests,
    )
    seq = doc.get("seq")
    if seq is not None or manifest.folder is None:
        manifest.seq = _int(seq, "seq", where, 0, _MAX_SEQ)
    return manifest


@_as_proof_error
def parse_index(data: bytes, where: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The tensor index and telemetry of a format-2 torch file.

    Raises:
        ManifestError: not valid.
    """
    doc = _json(data, where)
    if not isinstance(doc, dict):
        raise _fail(where, "the index is not an object")
    return _tensors(doc.get("tensors", []), where), _telemetry(doc.get("telemetry", {}), where)
