"""What is in a root, as the commands show it: checkpoints, torn saves, and tensor indexes.

The core's discovery (``_discovery.py``) decides what is committed, unverified or corrupt; this
module adds what an operator also wants to see: plain checkpoint folders without a manifest
(Accelerate's own ``save_state``), saves that crashed before publishing ("torn": a manifest whose
data never appeared), the step of each checkpoint, and which tier it lives on.
"""

from __future__ import annotations

import io
import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from .._commit import sibling_manifests
from .._discovery import (
    CHECKPOINT_SUFFIXES,
    CheckpointInfo,
    _read_manifest,
    resolve,
    resolve_dir,
    scan,
)
from .._gc import Debris, find_debris
from .._manifest import Manifest
from .._names import ASIDE_MARKER, DIR_MANIFEST, TMP_MARKER, split_manifest_name
from .._store import ObjectInfo, Store
from ..errors import ManifestError, UnsafeCheckpointError
from ..safety import safe_torch_load

__all__ = ["Row", "find_rows", "resolve_target", "store_tier", "tensor_index"]

#: Files that make a folder without a manifest look like a checkpoint (Accelerate's names too).
FOLDER_FILE_SUFFIXES = (*CHECKPOINT_SUFFIXES, ".safetensors", ".pkl")
_STEP_RE = re.compile(r"(?:global_step|step|checkpoint|ckpt)[=_-]?(\d+)", re.IGNORECASE)
#: Largest safetensors header we agree to parse (the library's own cap is 100 MB).
_MAX_ST_HEADER = 100_000_000


@dataclass
class Row:
    """One line of ``ls``: a checkpoint, a plain folder, or a torn save."""

    name: str
    path: str
    status: str  # committed | unverified | corrupt | torn
    size: int
    created: float
    step: int | None
    tier: str
    is_dir: bool = False
    problems: list[str] = field(default_factory=list)
    info: CheckpointInfo | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "path": self.path, "status": self.status, "size": self.size,
            "created": self.created, "step": self.step, "tier": self.tier, "folder": self.is_dir,
            "problems": self.problems,
        }


def store_tier(store: Store) -> str:
    """``local`` for a directory, else the URL scheme (``s3``, ``memory``, ...)."""
    if store.local_path("") is not None:
        return "local"
    return store.url.split("://", 1)[0] if "://" in store.url else "remote"


def step_of(name: str, manifest: Manifest | None) -> int | None:
    """The training step: the manifest's metadata when it says, else a number in the name."""
    if manifest is not None:
        for key in ("step", "global_step"):
            v = manifest.metadata.get(key)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    matches = _STEP_RE.findall(name.rpartition("/")[2])
    return int(matches[-1]) if matches else None


def folder_files(store: Store, name: str) -> list[ObjectInfo]:
    """The checkpoint-looking files directly in folder ``name``."""
    return [
        f for f in store.list(name)
        if f.name.rpartition("/")[2].endswith(FOLDER_FILE_SUFFIXES) and TMP_MARKER not in f.name
    ]


def _plain_folder(store: Store, name: str) -> CheckpointInfo | None:
    files = folder_files(store, name)
    if not files:
        return None
    return CheckpointInfo(
        store.describe(name), name, "unverified", max(f.mtime for f in files), sum(f.size for f in files),
        problems=["no stagesave manifest: completeness cannot be proven"], is_dir=True,
    )


def has_dir_manifest(store: Store, name: str) -> bool:
    try:
        store.info(f"{name}/{DIR_MANIFEST}" if name else DIR_MANIFEST)
        return True
    except (FileNotFoundError, IsADirectoryError):
        return False


def resolve_target(store: Store, name: str, is_dir: bool) -> CheckpointInfo:
    """Status of a file or folder checkpoint (a folder without manifest is ``unverified``).

    Raises:
        FileNotFoundError: a file that does not exist, or a folder with no checkpoint files.
    """
    if not is_dir:
        return resolve(store, name)
    if has_dir_manifest(store, name):
        return resolve_dir(store, name)
    info = _plain_folder(store, name)
    if info is None:
        raise FileNotFoundError(f"{store.describe(name)} holds no checkpoint files")
    return info


def _row(store: Store, ci: CheckpointInfo, tier: str) -> Row:
    return Row(
        ci.name, ci.path, ci.status, ci.size, ci.created, step_of(ci.name, ci.manifest),
        ci.tier or tier, ci.is_dir, list(ci.problems), ci,
    )


def _torn_row(store: Store, d: Debris, tier: str) -> Row | None:
    """A top-level manifest whose data file does not exist: a save that never published."""
    parsed = split_manifest_name(d.name)
    if "/" in d.name or parsed is None:
        return None
    data = parsed[0]
    try:
        store.info(data)
        return None  # the file exists (committed under another manifest): only debris
    except (FileNotFoundError, IsADirectoryError):
        pass
    try:
        manifest: Manifest | None = _read_manifest(store, d.name)
        assert manifest is not None
        size, created = sum(f.size for f in manifest.files), manifest.created_ns / 1e9
    except (ManifestError, OSError):
        manifest, size, created = None, 0, 0.0
    return Row(
        data, store.describe(data), "torn", size, created, step_of(data, manifest), tier,
        problems=[f"the save of {data} crashed before publishing it (leftover {d.name}; `stagesave gc` removes it)"],
    )


def _is_checkpoint(store: Store, ci: CheckpointInfo) -> bool:
    """Discovery calls any short file without a manifest corrupt; show only checkpoint-like ones."""
    if ci.is_dir or ci.manifest is not None or ci.name.endswith(FOLDER_FILE_SUFFIXES):
        return True
    return bool(sibling_manifests(store, ci.name))


def find_rows(store: Store) -> tuple[list[Row], list[Debris], list[tuple[str, str]]]:
    """Checkpoints, plain checkpoint folders and torn saves directly in ``store``'s root, newest
    first; plus the debris found (for ``gc``) and stagesave temporaries still in use."""
    tier = store_tier(store)
    rows = [_row(store, ci, tier) for ci in scan(store) if _is_checkpoint(store, ci)]
    listed = {r.name for r in rows}
    for leaf in store.list_dirs(""):
        if leaf in listed or leaf.startswith(".") or TMP_MARKER in leaf or leaf.endswith(ASIDE_MARKER):
            continue
        ci = _plain_folder(store, leaf)
        if ci is not None:
            rows.append(_row(store, ci, tier))
    debris, kept = find_debris(store, max_depth=0)  # this root's own leftovers: one listing
    for d in debris:
        if d.kind == "orphan-manifest":
            torn = _torn_row(store, d, tier)
            if torn is not None:
                rows.append(torn)
    rows.sort(key=lambda r: r.created, reverse=True)
    return rows, debris, kept


_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "C64": "complex64",
}


def _safetensors_index(store: Store, name: str) -> list[dict[str, Any]]:
    head = store.read_range(name, 0, 8)
    if len(head) != 8:
        raise ValueError(f"{store.describe(name)} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_ST_HEADER:
        raise ValueError(f"{store.describe(name)}: safetensors header of {n} bytes is over the limit")
    header = json.loads(store.read_range(name, 8, n))
    out = []
    for key, spec in header.items():
        if key == "__metadata__" or not isinstance(spec, dict):
            continue
        lo, hi = spec.get("data_offsets", (0, 0))
        out.append({
            "name": key, "dtype": _ST_DTYPES.get(spec.get("dtype", ""), spec.get("dtype")),
            "shape": list(spec.get("shape", [])), "bytes": int(hi) - int(lo),
        })
    return out


class _StoreReader(io.RawIOBase):
    """A seekable file over ``store.read_range`` (so torch reads only what it needs)."""

    def __init__(self, store: Store, name: str, size: int) -> None:
        super().__init__()
        self.store, self.name, self.size, self.pos = store, name, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        data = self.store.read_range(self.name, self.pos, min(len(view), max(0, self.size - self.pos)))
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _walk(obj: Any, prefix: str, out: list[dict[str, Any]], depth: int = 0) -> None:
    if isinstance(obj, torch.Tensor):
        out.append({
            "name": prefix, "dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape),
            "bytes": obj.numel() * obj.element_size(),
        })
    elif depth < 64 and isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    elif depth < 64 and isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{prefix}.{i}" if prefix else str(i), out, depth + 1)


def needs_unsafe_global(exc: BaseException) -> bool:
    """Whether a refused load was refused for a class off the allow-list (the file is fine),
    rather than for a pickle that does not parse (the file is damaged)."""
    if not isinstance(exc, UnsafeCheckpointError):
        return False
    return "GLOBAL" in str(exc.__cause__ or "")  # torch: "Unsupported global: GLOBAL mod.Class"


def torch_index(store: Store, name: str, size: int, *, trusted: bool = False) -> list[dict[str, Any]]:
    """Tensors of a torch file, read without their data (``map_location="meta"``).

    Raises:
        UnsafeCheckpointError: the structure needs a global off the allow-list (and not trusted).
    """
    source = io.BufferedReader(_StoreReader(store, name, size), 1 << 20)
    state = safe_torch_load(source, map_location="meta", trusted=trusted, where=store.describe(name))
    out: list[dict[str, Any]] = []
    _walk(state, "", out)
    return out


def tensor_index(
    store: Store, name: str, kind: str, size: int, *, trusted: bool = False
) -> list[dict[str, Any]]:
    """Name, dtype, shape and bytes of every tensor in one file (safetensors or torch)."""
    if kind == "safetensors" or name.endswith(".safetensors"):
        return _safetensors_index(store, name)
    return torch_index(store, name, size, trusted=trusted)


def manifest_tensors(manifest: Manifest) -> list[dict[str, Any]]:
    """The manifest's tensor index, with bytes computed from dtype and shape."""
    out = []
    for t in manifest.tensors:
        shape = [int(s) for s in t.get("shape", [])]
        dtype = str(t.get("dtype", "?"))
        try:
            itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        except (AttributeError, TypeError):
            itemsize = 0
        numel = 1
        for s in shape:
            numel *= s
        out.append({"name": t.get("name", "?"), "dtype": dtype, "shape": shape, "bytes": numel * itemsize})
    return out
