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
from ._names import ASIDE_MARKER, DIR_MANIFEST, MANIFEST_SUFFIX, MAX_MANIFEST_BYTES, is_temporary
from ._store import Store
from .errors import IntegrityError, ManifestError

__all__ = ["CheckpointInfo", "resolve", "resolve_dir", "scan", "verify_entry"]

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
    is_dir: bool = False
    #: Whether the file has stagesave manifests (matching or not).
    problems_from_manifest: bool = False
    #: The name that was judged: the target when ``name`` is a link inside the root.
    judged: str | None = None

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
    target = store.canonical(name)
    if target != name:  # a link inside the root (Lightning's save_last="link"): judge its target
        ci = resolve(store, target)
        ci.path, ci.name, ci.judged = store.describe(name), name, target
        return ci
    info = store.info(name)
    path = store.describe(name)
    candidates = sibling_manifests(store, name)
    directory = name.rpartition("/")[0]
    if not candidates and name.rpartition("/")[2] != DIR_MANIFEST:
        dir_manifest = f"{directory}/{DIR_MANIFEST}" if directory else DIR_MANIFEST
        try:
            store.info(dir_manifest)
            candidates = [dir_manifest]
        except FileNotFoundError:
            pass
    if not candidates:
        problem = _plain_file_problem(store, name, info.size)
        if problem:
            return CheckpointInfo(path, name, "corrupt", info.mtime, info.size, problems=[problem])
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
    return CheckpointInfo(path, name, "corrupt", info.mtime, info.size, problems=problems,
                          problems_from_manifest=True)


def _plain_file_problem(store: Store, name: str, size: int) -> str | None:
    """For a torch file without manifest: is it at least a complete zip (not torn)?"""
    if size < 22:
        return f"{store.describe(name)} is {size} bytes: too short to be a checkpoint"
    head = store.read_range(name, 0, 4)
    if head != b"PK\x03\x04":
        return None  # not a zip: a legacy torch file or another format, loadable as such
    tail = store.read_range(name, max(0, size - 65_558), min(size, 65_558))
    if b"PK\x05\x06" not in tail:
        return f"{store.describe(name)} is a truncated zip (no end-of-archive record): a torn write"
    return None


def resolve_dir(store: Store, directory: str) -> CheckpointInfo:
    """Status of a directory checkpoint (committed when its manifest and every file agree)."""
    path = store.describe(directory)
    mname = f"{directory}/{DIR_MANIFEST}"
    try:
        manifest = _read_manifest(store, mname)
    except FileNotFoundError:
        return CheckpointInfo(path, directory, "unverified", 0.0, 0, is_dir=True,
                              problems=["no stagesave manifest: completeness cannot be proven"])
    except (ManifestError, OSError) as exc:
        return CheckpointInfo(path, directory, "corrupt", 0.0, 0, is_dir=True, problems=[str(exc)])
    problems = []
    total = 0
    for entry in manifest.files:
        fname = f"{directory}/{entry.name}"
        try:
            info = store.info(fname)
        except (FileNotFoundError, IsADirectoryError):
            problems.append(f"{store.describe(fname)} is missing")
            continue
        except OSError as exc:
            problems.append(f"{store.describe(fname)}: {exc.strerror or exc}")
            continue
        total += info.size
        if info.size != entry.size:
            problems.append(f"{store.describe(fname)} is {info.size} bytes, manifest says {entry.size}")
        elif entry.serialization_id and entry.id_offset is not None:
            got = store.read_range(fname, entry.id_offset, len(entry.serialization_id))
            if got != entry.serialization_id.encode():
                problems.append(f"{store.describe(fname)} does not carry the id its manifest names")
    status = "corrupt" if problems else "committed"
    return CheckpointInfo(path, directory, status, manifest.created_ns / 1e9, total, manifest, mname,
                          problems, is_dir=True)


def scan(store: Store, directory: str = "", *, warn: bool = False) -> list[CheckpointInfo]:
    """Every checkpoint in ``directory`` of ``store`` (files and folders), newest first."""
    files = store.list(directory)
    out: list[CheckpointInfo] = []
    for leaf in store.list_dirs(directory):
        if leaf.startswith(".") or is_temporary(leaf) or leaf.endswith(ASIDE_MARKER):
            continue
        sub = f"{directory}/{leaf}" if directory else leaf
        ci = resolve_dir(store, sub)
        if ci.status == "unverified":
            continue  # a plain folder: not listed as a checkpoint (it may be torn)
        if ci.status == "corrupt" and warn:
            warnings.warn(f"skipping checkpoint {ci.path}: {'; '.join(ci.problems)}", stacklevel=3)
        out.append(ci)
    for f in files:
        leaf = f.name.rpartition("/")[2]
        if leaf.endswith(MANIFEST_SUFFIX) or is_temporary(leaf) or leaf.startswith("."):
            continue
        try:
            ci = resolve(store, f.name)
        except FileNotFoundError:  # removed while we listed
            continue
        except OSError as exc:  # e.g. a symbolic link out of the root: listed, never followed
            ci = CheckpointInfo(store.describe(f.name), f.name, "corrupt", f.mtime, f.size,
                                problems=[f"{store.describe(f.name)}: {exc.strerror or exc}"])
        if ci.manifest is None and not ci.problems_from_manifest and not leaf.endswith(CHECKPOINT_SUFFIXES):
            continue  # a plain file that is not named like a checkpoint (notes, logs, configs)
        if ci.status == "corrupt" and warn:
            warnings.warn(f"skipping checkpoint {ci.path}: {'; '.join(ci.problems)}", stacklevel=3)
        out.append(ci)
    tier_of = getattr(store, "tier_of", None)
    if tier_of is not None:  # a tiered root: say where each checkpoint is read from
        for ci in out:
            ci.tier = tier_of(ci.name)
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
