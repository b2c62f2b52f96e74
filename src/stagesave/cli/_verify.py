"""``stagesave verify PATH|ROOT``: recompute every checksum; a non-zero exit names each problem."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._checksum import digest
from .._discovery import CheckpointInfo
from .._manifest import FileEntry
from .._store import Store
from ..errors import CheckpointNotFoundError, UnsafeCheckpointError
from ._common import CliError, Env
from ._found import (
    find_rows,
    folder_files,
    has_dir_manifest,
    needs_unsafe_global,
    resolve_target,
    torch_index,
)

__all__ = ["Outcome", "add_parser", "check_entries", "entries_of", "run", "verify_checkpoint"]

#: Chunks read and hashed at once.
THREADS = 4


@dataclass
class Outcome:
    """The verdict on one checkpoint."""

    path: str
    status: str  # verified | corrupt | unverified | torn
    size: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "status": self.status, "size": self.size, "problems": self.problems,
                "notes": self.notes}


def entries_of(ci: CheckpointInfo) -> list[tuple[str, FileEntry]]:
    """``(name in store, manifest entry)`` for every file of a committed checkpoint."""
    assert ci.manifest is not None
    if ci.is_dir:
        return [(f"{ci.name}/{e.name}", e) for e in ci.manifest.files]
    return [(ci.name, ci.manifest.file(ci.name.rpartition("/")[2]))]


def check_entries(
    store: Store, items: list[tuple[str, FileEntry]], advance: Callable[[float], None]
) -> list[str]:
    """Read every chunk of every file and compare digests; the problems, in file order."""
    tasks = [(name, e, i) for name, e in items for i in range(len(e.chunks))]

    def check(task: tuple[str, FileEntry, int]) -> str | None:
        name, e, i = task
        lo, hi = e.chunk_range(i)
        data = store.read_range(name, lo, hi - lo)
        advance(len(data))
        where = store.describe(name)
        if len(data) != hi - lo:
            return f"{where}: truncated at byte {lo + len(data)} (the manifest says {e.size} bytes)"
        if digest(e.algorithm, data) != e.chunks[i]:
            return f"{where}: checksum mismatch in bytes [{lo}, {hi}) (chunk {i} of {len(e.chunks)})"
        return None

    with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-verify") as pool:
        return [p for p in pool.map(check, tasks) if p]


def verify_checkpoint(env: Env, store: Store, ci: CheckpointInfo) -> Outcome:
    """Verify one checkpoint found by discovery."""
    out = Outcome(ci.path, ci.status, ci.size, list(ci.problems))
    if ci.status == "corrupt":
        return out
    if ci.status == "committed":
        items = entries_of(ci)
        with env.progress(f"verifying {ci.name}", sum(e.size for _, e in items)) as advance:
            out.problems = check_entries(store, items, advance)
        out.status = "corrupt" if out.problems else "verified"
        return out
    # No manifest: bytes cannot be proven, but the structure can be read (it must parse).
    out.problems = []
    out.notes.append("no manifest: bytes cannot be verified (`stagesave adopt` writes one)")
    files = [(f.name, f.size) for f in folder_files(store, ci.name)] if ci.is_dir else [(ci.name, ci.size)]
    for name, size in files:
        if name.endswith(".safetensors"):
            continue
        try:
            torch_index(store, name, size)
        except Exception as exc:  # noqa: BLE001 - any other parse failure means the file is damaged
            if needs_unsafe_global(exc):
                out.notes.append(f"{name.rpartition('/')[2]} needs classes off the safe allow-list: structure not parsed")
                continue
            cause = exc.__cause__ if isinstance(exc, UnsafeCheckpointError) and exc.__cause__ else exc
            out.status = "corrupt"
            out.problems.append(
                f"{store.describe(name)} cannot be read as a torch file: {first_line(cause)}"
            )
    return out


def first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    # torch's refusals bury the reason under boilerplate: keep the line that names it
    for ln in lines:
        if ln.startswith(("Unsupported", "Invalid", "invalid", "PytorchStreamReader")):
            return ln
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="recompute checksums of a checkpoint or of every checkpoint under a root",
        description="Read every byte of a checkpoint (file or folder) or of every checkpoint under "
        "ROOT and compare it with the manifest. Exits 1 and names each problem if anything is "
        "corrupt (with --strict, also if a checkpoint has no manifest or a save was torn).",
    )
    p.add_argument("path", metavar="PATH|ROOT")
    p.add_argument("--strict", action="store_true", help="fail on checkpoints without manifest and torn saves too")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _collect(env: Env, path: str) -> tuple[Store, list[CheckpointInfo], list[Outcome]]:
    target = env.target(path)
    if not target.is_dir:
        return target.store, [resolve_target(target.store, target.name, False)], []
    if has_dir_manifest(target.store, target.name):  # a folder checkpoint, intact or not
        return target.store, [resolve_target(target.store, target.name, True)], []
    store = env.root(path)
    rows, _, _ = find_rows(store)
    infos = [r.info for r in rows if r.info is not None]
    torn = [Outcome(r.path, "torn", r.size, list(r.problems)) for r in rows if r.status == "torn"]
    if not infos and not torn:
        raise CheckpointNotFoundError(f"no checkpoints under {store.url}")
    return store, infos, torn


def run(env: Env, args: argparse.Namespace) -> int:
    store, infos, torn = _collect(env, args.path)
    outcomes = [verify_checkpoint(env, store, ci) for ci in infos] + torn
    bad = [o for o in outcomes if o.status == "corrupt" or (args.strict and o.status in ("unverified", "torn"))]
    if args.json:
        env.print_json({"ok": not bad, "checkpoints": [o.to_dict() for o in outcomes]})
    else:
        for o in outcomes:
            label = {"verified": "OK", "corrupt": "CORRUPT", "unverified": "UNVERIFIED", "torn": "TORN"}[o.status]
            env.out.print(f"{label:<10} {o.path}", markup=False)
            for p in o.problems:
                env.out.print(f"           {p}", markup=False)
            for n in o.notes:
                env.out.print(f"           note: {n}", markup=False)
    if bad:
        first = bad[0]
        reason = first.problems[0] if first.problems else f"{first.path} is {first.status}"
        more = f" (and {len(bad) - 1} more checkpoints with problems)" if len(bad) > 1 else ""
        raise CliError(f"{reason}{more}")
    return 0
