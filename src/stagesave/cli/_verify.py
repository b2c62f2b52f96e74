"""``stagesave verify PATH|ROOT``: recompute every checksum; a non-zero exit names each problem.

Works on files and folders of both formats: a format-2 file is checked against the proof inside
it (read through the same open file as its bytes), a format-2 folder file by file against the
proofs its carrier pins (files the carrier does not list are the user's: named in a note), a
format-1 checkpoint against its sidecar manifest. A file without any proof can only be parsed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointNotFoundError, UnsafeCheckpointError
from ..ondisk.manifest import Manifest
from ..restore.discovery import CheckpointInfo, folder_entries, resolve_dir, resolve_reader
from ..restore.proof import chunk_problems
from ..restore.verify import folder_files_problems
from ..stores.base import Reader, Store
from ._common import CliError, Env
from ._found import (
    Row,
    find_rows,
    folder_files,
    inside_a_checkpoint,
    is_folder_checkpoint,
    resolve_target,
)
from ._tensor_index import needs_unsafe_global, torch_index

__all__ = ["THREADS", "Outcome", "add_parser", "run", "verify_checkpoint"]

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
    seq: int | None = None
    format: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "status": self.status,
            "size": self.size,
            "seq": self.seq,
            "format": self.format,
            "problems": self.problems,
            "notes": self.notes,
        }


def _check(
    reader: Reader, manifest: Manifest, pool: cf.Executor, advance: Callable[[float], None]
) -> list[str]:
    """Every chunk of one file against its proof, through ``reader``."""

    def read(lo: int, n: int) -> bytes:
        data = reader.read(lo, n)
        advance(len(data))
        return data

    return chunk_problems(reader, manifest, pool, read=read)


def _verify_file(
    env: Env, store: Store, ci: CheckpointInfo, pool: cf.Executor
) -> tuple[str, list[str]]:
    """``(status, problems)`` of a file: its proof and its bytes read through one open file."""
    judged = ci.judged or ci.name
    try:
        reader = store.open(judged)
    except OSError as exc:
        return "corrupt", [f"{store.describe(judged)}: {exc.strerror or exc}"]
    with reader:
        info = resolve_reader(store, judged, reader)
        if info.status != "committed" or info.manifest is None:
            return info.status, list(info.problems)
        with env.progress(f"verifying {ci.name}", info.manifest.files[0].end) as advance:
            problems = _check(reader, info.manifest, pool, advance)
    return ("corrupt" if problems else "verified"), problems


def _verify_folder(
    env: Env, store: Store, ci: CheckpointInfo, pool: cf.Executor
) -> tuple[str, list[str]]:
    """``(status, problems)`` of a folder: the set of files, then every file against its proof."""
    info = resolve_dir(store, ci.name)
    if info.status != "committed" or info.manifest is None:
        return info.status, list(info.problems)
    entries, problems = folder_entries(store, info)
    with env.progress(f"verifying {ci.name}", info.size) as advance:
        problems += folder_files_problems(
            store, ci.name, entries, lambda reader, proof: _check(reader, proof, pool, advance))
    return ("corrupt" if problems else "verified"), problems


def verify_checkpoint(env: Env, store: Store, ci: CheckpointInfo) -> Outcome:
    """Verify one checkpoint found by discovery."""
    out = Outcome(ci.path, ci.status, ci.size, list(ci.problems), seq=ci.seq, format=ci.format)
    if ci.beside:
        n = len(ci.beside)
        shown = ", ".join(ci.beside[:5]) + (f" and {n - 5} more" if n > 5 else "")
        out.notes.append(f"{n} file{'s' if n > 1 else ''} beside it that "
                         f"{'are' if n > 1 else 'is'} not part of the checkpoint (kept, never "
                         f"read): {shown}")
    if ci.status == "corrupt":
        return out
    if ci.status == "committed":
        with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-verify") as pool:
            verify = _verify_folder if ci.is_dir else _verify_file
            out.status, out.problems = verify(env, store, ci, pool)
        return out
    # No proof: bytes cannot be proven, but the structure can be read (it must parse).
    out.problems = []
    out.notes.append(
        "no proof: bytes cannot be verified (`stagesave adopt` writes a manifest for a file)"
    )
    files = (
        [(f.name, f.size) for f in folder_files(store, ci.name)]
        if ci.is_dir
        else [(ci.name, ci.size)]
    )
    for name, size in files:
        if name.endswith(".safetensors"):
            continue
        try:
            torch_index(store, name, size)
        except Exception as exc:  # noqa: BLE001, RUF100 - any other parse failure means the file is damaged
            if needs_unsafe_global(exc):
                out.notes.append(
                    f"{name.rpartition('/')[2]} needs classes off the safe allow-list: structure "
                    "not parsed"
                )
                continue
            cause = (
                exc.__cause__ if isinstance(exc, UnsafeCheckpointError) and exc.__cause__ else exc
            )
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
        description="Read every byte of a checkpoint (file or folder, format 2 or 1) or of every "
        "checkpoint under ROOT and compare it with its proof. Exits 1 and names each problem if "
        "anything is corrupt (with --strict, also if a checkpoint has no proof or a save was "
        "torn).",
    )
    p.add_argument("path", metavar="PATH|ROOT")
    p.add_argument(
        "--strict", action="store_true", help="fail on checkpoints without proof and torn saves too"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _collect(
    env: Env, path: str,
) -> tuple[list[tuple[Store, CheckpointInfo]], list[Outcome]]:
    target = env.target(path)
    if not target.is_dir:
        return [(target.store, resolve_target(target.store, target.name, False))], []
    own: list[tuple[Store, CheckpointInfo]] = []
    if is_folder_checkpoint(target.store, target.name):  # a folder checkpoint, intact or not
        own = _with_parts(target.store, resolve_target(target.store, target.name, True))
    store = env.root(path)
    rows, _, _ = find_rows(store, env.root)
    if own:  # and what is in it beside its files, each verified on its own
        seen = {ci.path.rstrip("/") for _, ci in own}
        return own + [pair for r in rows if r.info is not None
                      and r.path.rstrip("/") not in seen
                      for pair in _with_parts(store, r.info)], _torn(rows)
    above = inside_a_checkpoint(env.root, store, rows)
    if above is not None:
        raise CheckpointNotFoundError(
            f"{store.describe('')} is not a checkpoint of its own: its files belong to the "
            f"folder checkpoint {above}/ (verify that)"
        )
    infos = [pair for r in rows if r.info is not None for pair in _with_parts(store, r.info)]
    torn = _torn(rows)
    if not infos and not torn:
        raise CheckpointNotFoundError(f"no checkpoints under {store.url}")
    return infos, torn


def _with_parts(store: Store, ci: CheckpointInfo) -> list[tuple[Store, CheckpointInfo]]:
    """A checkpoint, and for a folder its parts that are folder checkpoints of their own
    (``nested``: an FSDP checkpoint's DCP parts), each to be verified whole."""
    out = [(store, ci)]
    m = ci.manifest
    for part in m.folder.nested if ci.is_dir and m is not None and m.folder is not None else []:
        try:
            out.append((store, resolve_target(store, f"{ci.name}/{part}" if ci.name else part,
                                               True)))
        except FileNotFoundError:
            continue  # (the folder's own check names it missing)
    return out


def _torn(rows: list[Row]) -> list[Outcome]:
    return [Outcome(r.path, "torn", r.size, list(r.problems), format=r.format)
            for r in rows if r.status == "torn"]


def run(env: Env, args: argparse.Namespace) -> int:
    infos, torn = _collect(env, args.path)
    outcomes = [verify_checkpoint(env, store, ci) for store, ci in infos] + torn
    bad = [
        o
        for o in outcomes
        if o.status == "corrupt" or (args.strict and o.status in ("unverified", "torn"))
    ]
    if args.json:
        env.print_json({"ok": not bad, "checkpoints": [o.to_dict() for o in outcomes]})
    else:
        for o in outcomes:
            label = {
                "verified": "OK",
                "corrupt": "CORRUPT",
                "unverified": "UNVERIFIED",
                "torn": "TORN",
            }.get(o.status, o.status.upper())
            env.say(f"{label:<10} {o.path}")
            for p in o.problems:
                env.say(f"           {p}")
            for n in o.notes:
                env.say(f"           note: {n}")
    if bad:
        first = bad[0]
        reason = first.problems[0] if first.problems else f"{first.path} is {first.status}"
        more = f" (and {len(bad) - 1} more checkpoints with problems)" if len(bad) > 1 else ""
        raise CliError(f"{reason}{more}")
    return 0
