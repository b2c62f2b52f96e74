"""Checks for untrusted proof JSON: limits, checked arithmetic, and the field named when refused.

A proof read back is untrusted input (a checkpoint may come from anywhere), so the parsers check
everything before anything else uses it: size caps, names that stay inside the checkpoint,
integer fields in range, digests of the declared algorithm, storage records inside the file and
not overlapping, every entry of the tensor index typed and bounded (a shape's rank and element
count), metadata and telemetry free of NaN and infinities (JSON has none, but Python's parser
reads ``1e999`` as infinity) and nested at most :data:`MAX_DEPTH` deep. A proof that fails any
check is refused as corrupt, with the field named: whatever is called verified can be printed,
listed and written out as JSON as it is.

Every check here raises :class:`~stagesave.errors.ManifestError` (made by :func:`fail`).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import fields
from typing import Any

from ..errors import ManifestError
from ..stores.base import check_name
from ..telemetry import SaveTelemetry
from .checksum import ALGORITHMS, DIGEST_HEX_LEN
from .model import FileEntry, StorageRecord
from .names import MAX_FILE_BYTES, MAX_MANIFEST_BYTES

__all__ = [
    "MAX_CHUNK", "MAX_DEPTH", "MAX_ENTRIES", "MAX_NUMEL", "MAX_RANK", "MAX_SEQ", "MAX_TENSOR_NAME",
    "algorithm",
    "chunks", "fail", "file_entry", "file_name", "integer", "json_object", "kind", "load_json",
    "plain_json", "serialization_id", "storages", "string", "telemetry", "tensors",
]

#: Largest checksum chunk a proof may declare.
MAX_CHUNK = 1 << 40
#: Most entries of a list in a proof (tensors, storage records).
MAX_ENTRIES = 10_000_000
#: Largest sequence number.
MAX_SEQ = 1 << 62
#: Deepest nesting of a proof's metadata and telemetry (a user's metadata is JSON; nobody nests
#: it this deep, and every reader can print it without running out of stack).
MAX_DEPTH = 100
#: Most dimensions of a tensor in the index (torch itself sets no limit; no real tensor comes near).
MAX_RANK = 1024
#: Largest element count, dimension, stride and offset of a tensor in the index.
MAX_NUMEL = 1 << 62
#: Longest tensor name in the index.
MAX_TENSOR_NAME = 65_536
#: Telemetry integers stay within what converts to a float.
_MAX_TELEMETRY_INT = 1 << 63


def fail(where: str, problem: str) -> ManifestError:
    """The error that refuses the manifest read from ``where``."""
    return ManifestError(f"invalid manifest {where}: {problem}")


def integer(v: Any, what: str, where: str, lo: int = 0, hi: int = MAX_FILE_BYTES) -> int:
    """``v``, an integer (not a bool) in ``[lo, hi]``."""
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise fail(where, f"{what} must be an integer in [{lo}, {hi}], got {v!r:.60}")
    return v


def string(v: Any, what: str, where: str, max_len: int = 4096) -> str:
    """``v``, a string of at most ``max_len`` characters."""
    if not isinstance(v, str) or len(v) > max_len:
        raise fail(where, f"{what} must be a string of at most {max_len} characters")
    return v


def load_json(data: bytes, where: str) -> Any:
    """``data`` parsed as JSON: within the size cap, not empty, no NaN or infinity constants."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise fail(where, f"{len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    if not data.strip():
        raise fail(where, "the file is empty")
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise fail(where, f"not valid JSON ({exc})") from exc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def kind(v: Any, where: str) -> str:
    """A file kind: letters, digits and ``-``."""
    found = string(v, "kind", where, 32)
    if not found or not all(ch.isascii() and (ch.isalnum() or ch == "-") for ch in found):
        raise fail(where, f"kind {found!r} is not a file kind (letters, digits and '-')")
    return found


def _path(what: str, parts: tuple[str | int, ...]) -> str:
    return what + "".join(f"[{p}]" if isinstance(p, int) else f"[{p[:40]!r}]" for p in parts)


def plain_json(v: Any, what: str, where: str) -> None:
    """``v`` (read from JSON) holds finite numbers only and nests at most :data:`MAX_DEPTH` deep.

    Also used for values about to be written (``Checkpointer.save`` refuses metadata a reader
    would refuse).

    Raises:
        ManifestError: naming the first offending field.
    """
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(v, ())]
    while stack:
        x, parts = stack.pop()
        if isinstance(x, float):
            if not math.isfinite(x):
                raise fail(where, f"{_path(what, parts)} is {x!r}: JSON has no NaN or infinity "
                                  "(a number such as 1e999 reads as one)")
        elif isinstance(x, (dict, list)):
            if len(parts) >= MAX_DEPTH:
                raise fail(where, f"{_path(what, parts)} nests deeper than {MAX_DEPTH} levels")
            items = x.items() if isinstance(x, dict) else enumerate(x)
            stack.extend((item, (*parts, key)) for key, item in items)


def json_object(v: Any, what: str, where: str) -> dict[str, Any]:
    """``v``, an object that passes :func:`plain_json`."""
    if not isinstance(v, dict):
        raise fail(where, f"{what} must be an object, got {type(v).__name__}")
    plain_json(v, what, where)
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


def telemetry(v: Any, where: str) -> dict[str, Any]:
    """The save's telemetry: an object; its known fields of their type, numbers finite and in
    range."""
    tel = json_object(v, "telemetry", where)
    for key, value in tel.items():
        what = _path("telemetry", (key,))
        allowed = _TELEMETRY_TYPES.get(key)
        if allowed is not None and _json_type(value) not in allowed:
            raise fail(where, f"{what} must be {' or '.join(sorted(allowed))}, "
                              f"got {_json_type(value)}")
        if (isinstance(value, int) and not isinstance(value, bool)
                and abs(value) >= _MAX_TELEMETRY_INT):
            raise fail(where, f"{what} is out of range")
        if isinstance(value, str) and len(value) > 65_536:
            raise fail(where, f"{what} is longer than 65536 characters")
    return tel


_TENSOR_FIELDS = frozenset({"name", "dtype", "shape", "stride", "storage_offset", "storage"})


def _plain_tensor(t: Any) -> bool:
    """Whether ``t`` is the common entry, valid at a glance: the six fields, of plain types,
    within bounds (anything else is checked field by field, which names what is wrong)."""
    if type(t) is not dict or len(t) != 6:
        return False
    name, dtype, shape, stride = t.get("name"), t.get("dtype"), t.get("shape"), t.get("stride")
    offset, storage = t.get("storage_offset"), t.get("storage")
    if not (type(name) is str and len(name) <= MAX_TENSOR_NAME and type(dtype) is str
            and len(dtype) <= 64 and type(storage) is str and len(storage) <= 64
            and type(offset) is int and 0 <= offset <= MAX_NUMEL and type(shape) is list
            and type(stride) is list and len(stride) == len(shape) <= MAX_RANK):
        return False
    numel = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_NUMEL:
            return False
        numel = min(numel * d, MAX_NUMEL + 1)
    return numel <= MAX_NUMEL and all(type(d) is int and 0 <= d <= MAX_NUMEL for d in stride)


def _tensor(t: Any, i: int, where: str) -> dict[str, Any]:
    """One entry of the tensor index: typed, its shape's rank and element count bounded."""
    if _plain_tensor(t):
        return t  # type: ignore[no-any-return]
    what = f"tensors[{i}]"
    if not isinstance(t, dict):
        raise fail(where, f"{what} is not an object")
    string(t.get("name"), f"{what}.name", where, MAX_TENSOR_NAME)
    string(t.get("dtype"), f"{what}.dtype", where, 64)
    shape = t.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise fail(where, f"{what}.shape must be a list of at most {MAX_RANK} dimensions")
    numel = 1
    for d in shape:
        dim = integer(d, f"{what}.shape dimension", where, 0, MAX_NUMEL)
        numel = min(numel * dim, MAX_NUMEL + 1)
    if numel > MAX_NUMEL:
        raise fail(where, f"{what}.shape has more than {MAX_NUMEL} elements")
    stride = t.get("stride")
    if stride is not None:
        # []: not known (adopted)
        if not isinstance(stride, list) or len(stride) not in (0, len(shape)):
            raise fail(where, f"{what}.stride must be a list as long as its shape")
        for d in stride:
            integer(d, f"{what}.stride", where, 0, MAX_NUMEL)
    if t.get("storage_offset") is not None:
        integer(t["storage_offset"], f"{what}.storage_offset", where, 0, MAX_NUMEL)
    if t.get("storage") is not None:
        string(t["storage"], f"{what}.storage", where, 64)
    if not _TENSOR_FIELDS.issuperset(t):
        plain_json({k: v for k, v in t.items() if k not in _TENSOR_FIELDS}, what, where)
    return t


def tensors(v: Any, where: str) -> list[dict[str, Any]]:
    """The tensor index: a list of checked entries."""
    if not isinstance(v, list) or len(v) > MAX_ENTRIES:
        raise fail(where, "tensors must be a list")
    return [_tensor(t, i, where) for i, t in enumerate(v)]


def chunks(
    raw: Any, algorithm: str, n_bytes: int, chunk_bytes: int, what: str, where: str,
) -> tuple[str, ...]:
    """The chunk digests of ``n_bytes``: as many as the chunks, each of the algorithm's length."""
    expected = math.ceil(n_bytes / chunk_bytes) if n_bytes else 0
    if not isinstance(raw, list) or len(raw) != expected:
        raise fail(where, f"{what}: expected {expected} chunk digests for {n_bytes} bytes")
    hex_len = DIGEST_HEX_LEN[algorithm]
    for c in raw:
        if (not isinstance(c, str) or len(c) != hex_len
                or not all(ch in "0123456789abcdef" for ch in c)):
            raise fail(where, f"{what}: a chunk digest is not {hex_len} lowercase hex digits")
    return tuple(raw)


def algorithm(doc: dict[str, Any], where: str) -> str:
    """``doc``'s checksum algorithm, one this version knows."""
    found = string(doc.get("algorithm"), "algorithm", where, 32)
    if found not in ALGORITHMS:
        raise fail(where, f"unknown checksum algorithm {found!r}")
    return found


def storages(raw: Any, size: int, where: str, compact: bool) -> tuple[StorageRecord, ...]:
    """Storage records inside the first ``size`` bytes and not overlapping (``compact``: format
    2's ``[key, offset, nbytes]``; else format 1's objects)."""
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
        raise fail(where, "storages must be a list")
    out = []
    record = StorageRecord
    for s in raw:
        if compact and type(s) is list and len(s) == 3:  # the common record, valid at a glance
            key, off, n = s
            # (keys: torch's storage numbers, or a safetensors file's tensor names)
            if (type(key) is str and len(key) <= MAX_TENSOR_NAME and type(off) is int
                    and type(n) is int
                    and 0 <= off <= MAX_FILE_BYTES and 0 <= n <= MAX_FILE_BYTES
                    and off + n <= size):
                out.append(record(key, off, n))
                continue
        if compact:
            if not isinstance(s, list) or len(s) != 3:
                raise fail(where, "a storage record is not [key, offset, nbytes]")
            key, off, n = s
        else:
            if not isinstance(s, dict):
                raise fail(where, "a storage record is not an object")
            key, off, n = s.get("key"), s.get("offset"), s.get("nbytes")
        rec = StorageRecord(string(key, "storage key", where, MAX_TENSOR_NAME),
                            integer(off, "storage offset", where),
                            integer(n, "storage size", where))
        if rec.offset + rec.nbytes > size:
            raise fail(where, f"storage {rec.key} lies outside the file "
                              f"({rec.offset}+{rec.nbytes} > {size})")
        out.append(rec)
    for a, b in itertools.pairwise(sorted(out, key=lambda r: r.offset)):
        if a.offset + a.nbytes > b.offset:
            raise fail(where, f"storages {a.key} and {b.key} overlap")
    if len({r.key for r in out}) != len(out):
        seen: set[str] = set()
        for r in out:
            if r.key in seen:
                raise fail(where, f"storage {r.key} is recorded twice")
            seen.add(r.key)
    return tuple(out)


def file_name(v: Any, where: str) -> str:
    """A file name that stays inside the checkpoint."""
    name = string(v, "file name", where)
    try:
        check_name(name)
    except ValueError as exc:
        raise fail(where, f"file name {name!r} escapes the checkpoint "
                          "(absolute, '..' or URL)") from exc
    return name


def serialization_id(doc: dict[str, Any], size: int, where: str) -> tuple[str | None, int | None]:
    """A torch file's ``serialization_id`` and where it sits (inside ``size`` bytes)."""
    sid = doc.get("serialization_id")
    id_offset = doc.get("id_offset")
    if sid is None:
        if id_offset is not None:
            raise fail(where, "id_offset without serialization_id")
        return None, None
    sid = string(sid, "serialization_id", where, 64)
    if not sid.isalnum():
        raise fail(where, "serialization_id must be alphanumeric")
    return sid, integer(id_offset, "id_offset", where, 0, max(0, size - len(sid)))


def file_entry(doc: Any, where: str) -> FileEntry:
    """A file entry of format 1 (and of a folder's listed files): the whole file's checksums."""
    if not isinstance(doc, dict):
        raise fail(where, "a file entry is not an object")
    name = file_name(doc.get("name"), where)
    size = integer(doc.get("size"), "size", where)
    algo = algorithm(doc, where)
    chunk_bytes = integer(doc.get("chunk_bytes"), "chunk_bytes", where, 1, MAX_CHUNK)
    digests = chunks(doc.get("chunks"), algo, size, chunk_bytes, name, where)
    file_kind = kind(doc.get("kind", "torch"), where)
    sid, id_offset = serialization_id(doc, size, where)
    records = storages(doc.get("storages", []), size, where, compact=False)
    return FileEntry(name=name, size=size, algorithm=algo, chunk_bytes=chunk_bytes, chunks=digests,
                     kind=file_kind, serialization_id=sid, id_offset=id_offset, storages=records)
