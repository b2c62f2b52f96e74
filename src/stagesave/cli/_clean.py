"""``stagesave gc ROOT``: remove the debris of crashed saves (see ``stagesave.restore.gc``)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from ..agent.segments import abandoned_segments, remove_segment
from ..restore.gc import collect_garbage
from ._common import CliError, Env, literal
from ._units import fmt_bytes, fmt_duration, parse_duration

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "gc",
        help="remove debris of crashed saves (temporaries, stale format-1 manifests, stale "
             "multipart uploads)",
        description="Find what crashed saves left under ROOT and its sub-folders: stagesave "
        "temporaries (recognised by the exact names stagesave gives them) whose writer is dead or "
        "that were untouched for --older-than, format-1 sidecar manifests that are stale (they "
        "parse as stagesave's, and their file is missing or now carries its own proof), folders "
        "left aside by an interrupted replacement, and on s3:// stale multipart uploads; then "
        "remove them. Nothing else is ever touched (a user's file that only looks similar is left "
        "alone) and symlinks are never followed. --dry-run only lists.",
    )
    p.add_argument("root", metavar="ROOT", nargs="?",
                   help="checkpoint directory or URL (optional with --shm)")
    p.add_argument(
        "--shm", action="store_true",
        help="also remove this user's shared-memory segments of writer agents (writer='process') "
             "that no process maps any more: what a trainer and its agent both killed left, and "
             "snapshots no restart loaded (in $STAGESAVE_SHM_DIR, default /dev/shm)",
    )
    p.add_argument(
        "--dry-run", "-n", action="store_true", help="list what would be done, change nothing"
    )
    p.add_argument(
        "--older-than",
        default="1h",
        help="age after which a temporary or upload counts as abandoned even without pid proof "
             "(default 1h)",
    )
    p.add_argument(
        "--no-pid-check",
        action="store_true",
        help="do not trust pids (a filesystem shared by several hosts): rely on age only",
    )
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also list stagesave files kept and look-alike files ignored, and why")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _shm(env: Env, args: argparse.Namespace) -> None:
    found = abandoned_segments()
    for path, size, what in found:
        if not args.dry_run:
            remove_segment(path)
        if not args.json:
            env.out.print(f"{'would remove' if args.dry_run else 'removed'} {what} "
                              f"{literal(path)} ({fmt_bytes(size)})")
    if args.json and args.root is None:
        env.print_json({"dry_run": args.dry_run,
                        "segments": [{"path": p, "bytes": n, "what": w} for p, n, w in found]})
    elif not found and not args.json:
        env.out.print("no abandoned shared-memory segments")


def run(env: Env, args: argparse.Namespace) -> int:
    try:
        older_than = parse_duration(args.older_than)
    except ValueError as exc:
        raise CliError(str(exc), 2) from exc
    if args.shm:
        _shm(env, args)
    if args.root is None:
        if not args.shm:
            raise CliError("gc needs ROOT (or --shm)", 2)
        return 0
    store = env.root(args.root)
    report = collect_garbage(
        store, dry_run=args.dry_run, older_than_s=older_than, check_pids=not args.no_pid_check,
        storage_options=env.storage_options,
    )
    if args.json:
        env.print_json({
            "root": report.root, "dry_run": report.dry_run,
            "found": [vars(d) for d in report.found], "done": [vars(d) for d in report.done],
            "kept": [{"name": n, "why": w} for n, w in report.kept],
            "ignored": [{"name": n, "why": w} for n, w in report.ignored], "errors": report.errors,
        })
    else:
        if report.found:
            t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
            for col in ("action", "what", "size", "age", "why"):
                t.add_column(
                    col, justify="right" if col in ("size", "age") else "left", overflow="fold"
                )
            done = {id(d) for d in report.done}
            for d in report.found:
                action = d.action if (args.dry_run or id(d) in done) else f"{d.action} FAILED"
                t.add_row(
                    ("would " if args.dry_run else "") + action + " " + d.kind,
                    literal(d.name),
                    fmt_bytes(d.size) if d.size else "-",
                    fmt_duration(d.age_s) if d.age_s else "-",
                    literal(d.reason),
                )
            env.out.print(t)
        verb = "would reclaim" if args.dry_run else "reclaimed"
        n = len(report.found) if args.dry_run else len(report.done)
        size = sum(d.size for d in report.found) if args.dry_run else report.reclaimed_bytes
        env.say(f"{n} leftovers of crashed saves under {report.root}; {verb} {fmt_bytes(size)}")
        if report.kept:
            env.say(f"{len(report.kept)} stagesave files kept (saves in progress or too recent)")
            if args.verbose:
                for name, why in report.kept:
                    env.say(f"  kept {name}: {why}")
        if report.ignored:
            env.say(f"{len(report.ignored)} files only named like stagesave's left alone")
            if args.verbose:
                for name, why in report.ignored:
                    env.say(f"  ignored {name}: {why}")
    if report.errors:
        raise CliError(f"{len(report.errors)} items could not be cleaned: {report.errors[0]}")
    return 0
