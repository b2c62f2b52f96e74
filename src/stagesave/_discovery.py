"""Finding checkpoints and proving them: list, resolve a file's manifest, verify bytes.

A data file is *committed* when a manifest beside it names its exact size and torch
serialization id (read from the file itself at the offset the manifest gives); *unverified* when
it has no manifest at all (a plain torch file: loadable, not provable); *corrupt* when manifests
exist but none matches, or when verification finds a chunk whose digest differs. A manifest whose
id matches no file is debris of a crashed save and is ignored.
"""

from __future__ import annotations

import concurrent.futures as cf
import warnings
from dataclasses import dataclass, field

from ._checksum import digest
from ._commit import sibling_manifests
from ._manifest import FileEntry, Manifest, parse_manifest
from ._names import MANIFEST_SUFFIX, MAX_MANIFEST_BYTES, is_temporary
from ._store import Store
from .errors import IntegrityError, ManifestError

__all__ = ["CheckpointInfo", "resolve", "scan", "verify_entry"]

#: Plain files with these suffixes are listed as (unverified) checkpoints.
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".tar")


@dataclass
class CheckpointInfo:
    """A checkpoint found in a store."""

    path: str
    name: str
    status: str  # "committed" | "verified" | "unverified" | "corrupt"
    created: float
    size: int
    manifest: Manifest | None = None
    manifest_name: str | None = None
    problems: list[str] = field(default_factory=list)
    tier: str | None = None

    @property
    def valid(self) -> bool:
        return self.status in ("committed", "verified", "unverified")


def _read_manifest(store: Store, name: str) -> Manifest:
    info = store.info(name)
    if info.size > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"invalid manifest {store.describe(name)}: {info.size} bytes exceeds the limit"
        )
    return parse_manifest(store.read_range(name, 0, info.size), store.describe(name))


def resolve(store: Store, name: str) -> CheckpointInfo:
    """Status of data file ``name`` (without reading its bytes beyond the id).

    Raises:
        FileNotFoundError: the file does not exist.
    """
    info = store.info(name)
    path = store.describe(name)
    candidates = sibling_manifests(store, name)
    if not candidates:
        return CheckpointInfo(path, name, "unverified", info.mtime, info.size)
    problems: list[str] = []
    parsed: list[tuple[Manifest, str]] = []
    for mname in candidates:
        try:
            parsed.append((_read_manifest(store, mname), mname))
        except (ManifestError, OSError) as exc:
            problems.append(str(exc))
    parsed.sort(key=lambda m: m[0].created_ns, reverse=True)
    base = name.rpartition("/")[2]
    for manifest, mname in parsed:
        try:
            entry = manifest.file(base)
        except KeyError:
            problems.append(f"{store.describe(mname)} does not describe {base}")
            continue
        if entry.size != info.size:
            problems.append(
                f"{path} is {info.size} bytes but its manifest says {entry.size} (truncated or replaced)"
            )
            continue
        if entry.serialization_id is not None and entry.id_offset is not None:
            got = store.read_range(name, entry.id_offset, len(entry.serialization_id))
            if got != entry.serialization_id.encode():
                problems.append(f"{path} does not carry the serialization id its manifest names")
                continue
        return CheckpointInfo(
            path, name, "committed", manifest.created_ns / 1e9, info.size, manifest, mname
        )
    if not problems:
        problems.append(f"no manifest matches {path}")
    return CheckpointInfo(path, name, "corrupt", info.mtime, info.size, problems=problems)


def scan(store: Store, directory: str = "", *, warn: bool = False) -> list[CheckpointInfo]:
    """Every checkpoint in ``directory`` of ``store``, newest first."""
    files = store.list(directory)
    out: list[CheckpointInfo] = []
    for f in files:
        leaf = f.name.rpartition("/")[2]
        if leaf.endswith(MANIFEST_SUFFIX) or is_temporary(leaf) or leaf.startswith("."):
            continue
        try:
            ci = resolve(store, f.name)
        except FileNotFoundError:  # removed while we listed
            continue
        if ci.status == "unverified" and not leaf.endswith(CHECKPOINT_SUFFIXES):
            continue
        if ci.status == "corrupt" and warn:
            warnings.warn(f"skipping checkpoint {ci.path}: {'; '.join(ci.problems)}", stacklevel=3)
        out.append(ci)
    out.sort(key=lambda c: c.created, reverse=True)
    return out


def verify_entry(
    store: Store, name: str, entry: FileEntry, pool: cf.Executor | None = None
) -> list[str]:
    """Recompute every chunk digest of ``name``; the list of problems (empty when intact)."""
    path = store.describe(name)
    problems: list[str] = []

    def check(i: int) -> str | None:
        lo, hi = entry.chunk_range(i)
        data = store.read_range(name, lo, hi - lo)
        if len(data) != hi - lo:
            return f"{path}: truncated at byte {lo + len(data)} (expected {entry.size} bytes)"
        if digest(entry.algorithm, data) != entry.chunks[i]:
            return f"{path}: checksum mismatch in bytes [{lo}, {hi}) (chunk {i})"
        return None

    indices = range(len(entry.chunks))
    results = pool.map(check, indices) if pool is not None else map(check, indices)
    problems.extend(r for r in results if r)
    return problems


def raise_if_corrupt(problems: list[str], path: str) -> None:
    if problems:
        raise IntegrityError(
            f"checkpoint {path} is corrupt: {problems[0]}"
            + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")
            + ". It was not loaded; use the previous checkpoint (stagesave.latest skips corrupt ones)."
        )
