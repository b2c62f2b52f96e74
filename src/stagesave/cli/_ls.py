"""``stagesave ls ROOT...``: checkpoints under one or more roots (tiers), newest first."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.table import Table

from ._common import Env, literal
from ._found import Row, find_rows, inside_a_checkpoint
from ._units import fmt_bytes

__all__ = ["add_parser", "fmt_time", "run"]

_STYLE = {"committed": "green", "unverified": "yellow", "corrupt": "bold red", "torn": "red"}


def fmt_time(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t > 0 else "-"
    except (OverflowError, OSError, ValueError):  # a proof may claim any time
        return "-"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "ls",
        help="list checkpoints under roots (local folders or URLs), newest first",
        description="List checkpoints (files and folders) directly under each ROOT, newest first "
        "in the order latest() considers them (sequence number of format-2 saves, then older "
        "formats by time): sequence number, step, size, creation time, status (committed, "
        "unverified = no proof, corrupt, torn = a save that crashed before publishing) and tier. "
        "Give several roots to see every tier.",
    )
    p.add_argument("roots", nargs="+", metavar="ROOT")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(env: Env, args: argparse.Namespace) -> int:
    rows: list[Row] = []
    in_progress = 0
    debris_count = 0
    inside: list[str] = []  # roots that are sub-folders of a folder checkpoint
    for root in args.roots:
        store = env.root(root)
        found, debris, kept = find_rows(store, env.root)
        above = inside_a_checkpoint(env.root, store, found)
        if above is not None:
            inside.append(f"{root} is not a checkpoint of its own: its files belong to the "
                          f"folder checkpoint {above}/ (`stagesave inspect {above}` shows it)")
            continue
        rows += found
        in_progress += len(kept)
        debris_count += len(debris) - sum(1 for r in found if r.status == "torn")
    rows.sort(key=Row.order, reverse=True)
    if args.json:
        env.print_json([r.to_dict() for r in rows])
        return 0
    for line in inside:
        env.say(line)
    if not rows:
        if len(inside) < len(args.roots):
            env.say(f"no checkpoints under {', '.join(args.roots)}")
    else:
        multi = len(args.roots) > 1
        t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        t.add_column("checkpoint", overflow="fold")
        t.add_column("seq", justify="right")
        t.add_column("step", justify="right")
        t.add_column("size", justify="right")
        t.add_column("created")
        t.add_column("status")
        t.add_column("format", justify="right")
        t.add_column("tier")
        for r in rows:
            name = (r.path if multi else r.name) + ("/" if r.is_dir else "")
            t.add_row(
                literal(name),
                "-" if r.seq is None else str(r.seq),
                "-" if r.step is None else str(r.step),
                fmt_bytes(r.size),
                fmt_time(r.created),
                literal(r.status, _STYLE.get(r.status, "")),
                str(r.format) if r.format else "-",
                literal(r.tier),
            )
        env.out.print(t)
        for r in rows:
            if r.status in ("corrupt", "torn"):
                for p in r.problems:
                    env.say(f"  {r.name}: {p}")
    if debris_count:
        env.say(f"{debris_count} leftovers of crashed saves (`stagesave gc` removes them)")
    if in_progress:
        env.say(f"{in_progress} stagesave files of saves in progress")
    return 0
