"""What is in a root, as the commands show it: checkpoints, plain folders and torn saves.

The core's discovery (``restore/discovery.py``) decides what is committed, unverified or
corrupt, and in which order checkpoints are newest (format 2: the sequence number each save
records; older formats below, by time); this module adds what an operator also wants to see:
plain checkpoint folders without a proof (Accelerate's own ``save_state``), saves that crashed
before publishing ("torn": a format-2 temporary whose writer is gone and whose checkpoint does
not exist, or a format-1 manifest whose data never appeared), the step of each checkpoint, and
its tier. What the files hold (tensor indexes) is ``_tensor_index.py``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, ManifestError
from ..ondisk.manifest import Manifest, parse_manifest
from ..ondisk.names import (
    ASIDE_MARKER,
    DIR_MANIFEST,
    MAX_MANIFEST_BYTES,
    TMP_MARKER,
    split_manifest_name,
)
from ..restore.discovery import CHECKPOINT_SUFFIXES, CheckpointInfo, resolve, resolve_dir, scan
from ..restore.gc import Debris, find_debris, match_temporary
from ..restore.resolve_folder import MAX_FOLDER_DEPTH, carries, claimed_folder, claims_a_folder
from ..stores.base import ObjectInfo, Store

__all__ = [
    "FOLDER_FILE_SUFFIXES",
    "Row",
    "find_rows",
    "folder_above",
    "folder_files",
    "inside_a_checkpoint",
    "is_folder_checkpoint",
    "resolve_target",
    "sidecars_of",
    "step_of",
    "store_tier",
]

#: Files that make a folder without a proof look like a checkpoint (Accelerate's names too).
FOLDER_FILE_SUFFIXES = (*CHECKPOINT_SUFFIXES, ".safetensors", ".pkl")
_STEP_RE = re.compile(r"(?:global_step|step|checkpoint|ckpt)[=_-]?(\d+)", re.IGNORECASE)


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
    #: Format 2: the save's sequence number in its directory.
    seq: int | None = None
    #: 2: proof inside the file(s); 1: sidecar manifest; 0: none.
    format: int = 0

    def order(self) -> tuple[int, float, float, str]:
        """Newest first, as ``latest()`` considers them: format 2 by sequence number, above
        everything else; the rest by time."""
        if self.seq is not None:
            return (1, float(self.seq), self.created, self.name)
        return (0, self.created, 0.0, self.name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "status": self.status,
            "size": self.size,
            "created": self.created,
            "step": self.step,
            "seq": self.seq,
            "format": self.format,
            "tier": self.tier,
            "folder": self.is_dir,
            "problems": self.problems,
        }


def store_tier(store: Store) -> str:
    """``local`` for a directory, else the URL scheme (``s3``, ``memory``, ...)."""
    if store.local_path("") is not None:
        return "local"
    return store.url.split("://", 1)[0] if "://" in store.url else "remote"


def step_of(name: str, manifest: Manifest | None) -> int | None:
    """The training step: the proof's metadata when it says, else a number in the name."""
    if manifest is not None and isinstance(manifest.metadata, dict):
        for key in ("step", "global_step"):
            v = manifest.metadata.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63):
                return v
    matches = _STEP_RE.findall(name.rpartition("/")[2])
    return int(matches[-1][:18]) if matches else None


def folder_files(store: Store, name: str) -> list[ObjectInfo]:
    """The checkpoint-looking files directly in folder ``name``."""
    return [
        f for f in store.list(name)
        if f.name.rpartition("/")[2].endswith(FOLDER_FILE_SUFFIXES) and TMP_MARKER not in f.name
    ]


def sidecars_of(store: Store, name: str) -> list[str]:
    """Names of the files beside ``name`` that are named like its format-1 manifests."""
    directory, _, base = name.rpartition("/")
    out = []
    for info in store.list(directory):
        parsed = split_manifest_name(info.name.rpartition("/")[2])
        if parsed is not None and parsed[0] == base:
            out.append(info.name)
    return out


def is_folder_checkpoint(store: Store, name: str) -> bool:
    """Whether folder ``name`` is one checkpoint (a proof covers it: format 2 or 1, intact or
    not), rather than a root holding checkpoints."""
    return resolve_dir(store, name).format in (1, 2)


def resolve_target(store: Store, name: str, is_dir: bool) -> CheckpointInfo:
    """Status of a file or folder checkpoint (a folder without proof is ``unverified``).

    Raises:
        FileNotFoundError: a file that does not exist, or a folder with no checkpoint files.
    """
    if not is_dir:
        return resolve(store, name)
    ci = resolve_dir(store, name)
    if ci.format == 0 and not folder_files(store, name):
        raise FileNotFoundError(f"{store.describe(name)} holds no checkpoint files")
    return ci


def _row(ci: CheckpointInfo, tier: str) -> Row:
    return Row(
        ci.name, ci.path, ci.status, ci.size, ci.created, step_of(ci.name, ci.manifest),
        ci.tier or tier, ci.is_dir, list(ci.problems), ci, ci.seq, ci.format,
    )


def _plain_folder(store: Store, name: str) -> CheckpointInfo | None:
    files = folder_files(store, name)
    if not files:
        return None
    return CheckpointInfo(
        store.describe(name),
        name,
        "unverified",
        max(f.mtime for f in files),
        sum(f.size for f in files),
        problems=["no stagesave proof: completeness cannot be proven"],
        is_dir=True,
    )


def _read_sidecar(store: Store, name: str) -> Manifest:
    info = store.info(name)
    if info.size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"invalid manifest {store.describe(name)}: too large")
    return parse_manifest(store.read_range(name, 0, info.size), store.describe(name))


def _exists(store: Store, name: str) -> bool:
    try:
        store.info(name)
        return True
    except IsADirectoryError:
        return True
    except (FileNotFoundError, NotADirectoryError):
        return name in store.list_dirs("")


def _torn_row(store: Store, d: Debris, tier: str, listed: set[str]) -> Row | None:
    """A save that never published: the debris it left names a checkpoint that does not exist."""
    if "/" in d.name:
        return None
    if d.kind == "orphan-manifest":  # format 1: a manifest whose data file never appeared
        parsed = split_manifest_name(d.name)
        if parsed is None or parsed[0] in listed or _exists(store, parsed[0]):
            return None
        data = parsed[0]
        try:
            manifest: Manifest | None = _read_sidecar(store, d.name)
            assert manifest is not None
            size, created = sum(f.size for f in manifest.files), manifest.created_ns / 1e9
        except (ManifestError, OSError):
            manifest, size, created = None, 0, 0.0
        return Row(
            data,
            store.describe(data),
            "torn",
            size,
            created,
            step_of(data, manifest),
            tier,
            format=1,
            problems=[
                (f"the save of {data} crashed before publishing it (leftover {d.name}; "
                 "`stagesave gc` removes it)")
            ],
        )
    if d.kind in ("temporary", "temporary-dir"):  # format 2: an unfinished write, its writer gone
        m = match_temporary(d.name, is_dir=d.kind == "temporary-dir")
        if m is None or len(m.group("token")) != 8:  # 32 hex digits: a sharded save's marker
            return None
        data = m.group("data")
        if data in listed or _exists(store, data):
            return None  # the checkpoint exists (a replacement was interrupted): only debris
        return Row(
            data,
            store.describe(data),
            "torn",
            d.size,
            time.time() - d.age_s,
            step_of(data, None),
            tier,
            is_dir=d.kind == "temporary-dir",
            format=2,
            problems=[
                (
                    f"no {data} exists: a save (or removal) of it was interrupted ({d.reason}); it "
                    f"left {d.name}, which `stagesave gc` removes"
                )
            ],
        )
    return None


def folder_above(
    root_of: Callable[[str], Store], path: str, token: str, carrier: str,
) -> str | None:
    """The folder checkpoint (its path) above ``path`` whose carrier is ``carrier`` with the
    folder token ``token``, looked for up to :data:`MAX_FOLDER_DEPTH` + 1 folders up;
    ``root_of`` opens a folder's path as a store."""
    for _ in range(MAX_FOLDER_DEPTH + 1):
        path = path.rstrip("/").rpartition("/")[0]
        if not path or path.endswith(":/"):
            return None
        try:
            if carries(root_of(path), carrier, token):
                return path
        except (OSError, CheckpointError):
            return None
    return None


def inside_a_checkpoint(
    root_of: Callable[[str], Store], store: Store, rows: list[Row],
) -> str | None:
    """For a root in which :func:`find_rows` found nothing (its ``rows``) whose files say they
    belong to a folder checkpoint: when that one is above it (``ckpt/sub``), its path."""
    if rows:
        return None
    claimed = claimed_folder(store, "")
    return None if claimed is None else folder_above(root_of, store.describe(""), *claimed)


def _root_checkpoint(store: Store, listed: set[str]) -> CheckpointInfo | None:
    """The root itself, when it is a folder checkpoint, whole or not (``ls`` of a checkpoint
    folder, or a final model saved at the top of a run's folder beside its checkpoints): looked
    for only when a top-level file the scan left out (as it leaves out a folder save's files)
    says it belongs to a folder, one read of each such file."""
    names = [f.name for f in store.list("") if TMP_MARKER not in f.name]
    if DIR_MANIFEST not in names and not any(
        n not in listed and n.endswith(FOLDER_FILE_SUFFIXES) and claims_a_folder(store, n)
        for n in names
    ):
        return None
    whole = resolve_dir(store, "")
    return whole if whole.format in (1, 2) else None


def _its_own(ci: CheckpointInfo) -> set[str]:
    """The names (files, and the top folders of its files and nested parts) that the root's
    own checkpoint holds."""
    m = ci.manifest
    if m is None:
        return set()
    names = m.folder.names() | set(m.folder.nested) if m.folder is not None else {
        e.name for e in m.files}
    return names | {n.split("/")[0] for n in names}


def _above(root_of: Callable[[str], Store] | None, store: Store, ci: CheckpointInfo) -> bool:
    """Whether a folder judged corrupt for want of its carrier is part of a folder checkpoint
    above it (the store alone cannot see above its root)."""
    if root_of is None or not ci.is_dir or ci.status != "corrupt" or ci.manifest is not None:
        return False
    claimed = claimed_folder(store, ci.name)
    return claimed is not None and folder_above(root_of, ci.path, *claimed) is not None


def find_rows(
    store: Store, root_of: Callable[[str], Store] | None = None,
) -> tuple[list[Row], list[Debris], list[tuple[str, str]]]:
    """Checkpoints, plain checkpoint folders and torn saves directly in ``store``'s root, newest
    first; plus the debris found (for ``gc``) and stagesave temporaries still in use.

    The root itself is a row when it is a folder checkpoint; beside it, the checkpoints with
    proofs of their own, plain folders and torn saves (its files and the user's are not rows).
    ``root_of`` (a folder's path to its store): folders that are part of a folder checkpoint
    above are no rows. Every format-2 file's whole proof is read (its step, metadata and
    problems), not only its summary.
    """
    tier = store_tier(store)
    scanned = scan(store, full=True)
    found = [ci for ci in scanned if not _above(root_of, store, ci)]
    above = {ci.name for ci in scanned} - {ci.name for ci in found}  # (no plain folder rows)
    whole = _root_checkpoint(store, {ci.name for ci in found})
    if whole is not None and _above(root_of, store, whole):
        whole = None
    own: set[str] = set()  # what the root's own checkpoint holds: not listed as others
    rows = [_row(ci, tier) for ci in found]
    if whole is not None:
        own = _its_own(whole)
        row = _row(whole, tier)
        row.name = row.path.rstrip("/")
        rows = [row, *(r for r in rows if r.format in (1, 2))]
    listed = {r.name for r in rows} | own | above
    for leaf in store.list_dirs(""):
        if leaf in listed or leaf.startswith(".") or TMP_MARKER in leaf or ASIDE_MARKER in leaf:
            continue
        ci = _plain_folder(store, leaf)
        if ci is not None:
            rows.append(_row(ci, tier))
    debris, kept = find_debris(store, max_depth=0)  # this root's own leftovers: one listing
    listed = {r.name for r in rows}
    for d in debris:
        torn = _torn_row(store, d, tier, listed)
        if torn is not None:
            rows.append(torn)
            listed.add(torn.name)
    rows.sort(key=Row.order, reverse=True)
    return rows, debris, kept
