"""``stagesave bench``: the ways of saving a checkpoint, side by side, on the user's own target.

Every chosen alternative saves the same synthetic transformer-like training state (weights plus
two Adam moments per parameter, in layers of attention and MLP matrices) to the same place:
``torch.save`` + fsync (what Lightning's and Accelerate's defaults do), stagesave, and with
``--alternatives all`` also DCP ``async_save`` (thread and process mode, with its stagers),
Lightning's ``AsyncCheckpointIO`` and Accelerate's ``save_state`` where those are installed.
Rounds interleave the alternatives (the order rotates), each set up afresh, warmed up and torn
down, so that drift of the machine hits all of them alike. Ratios are against floors measured
in the same run: the copy floor (the state's bytes copied once into a reused buffer) and, on a
local folder, the disk floor (the same bytes written with O_DIRECT + fsync).

With ``--loop`` a small CPU training loop (an MLP on torch's default threads) runs through the
background write, and the table adds the training time lost per save: the blocking time plus what
the loop lost while the write ran (steps slower than its baseline). A background writer that
competes with training for the cores costs more than its blocking time says.

Several state sizes, loads, cold caches and a plot: ``benchmarks/bench_sweep.py`` in the source
tree, which runs the same alternatives.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

import torch
from rich.table import Table
from rich.text import Text

from ..stores.targets import is_url
from ._bench_round import BenchTarget, Timing, measure_round
from ._bench_state import TrainLoop, state_bytes, state_tensors, synthetic_state
from ._common import CliError, Env, literal
from ._floors import copy_floor_s, disk_floor_s
from ._units import fmt_bytes, fmt_duration, fmt_rate, parse_size
from .alternatives import Alternative, available_alternatives, mem_available_bytes

__all__ = ["DEFAULT_ALTERNATIVES", "add_parser", "run"]

#: What ``stagesave bench`` compares unless told otherwise.
DEFAULT_ALTERNATIVES = ("torch.save+fsync", "stagesave")
#: Memory left free beyond the state and an alternative's copies of it.
HEADROOM_BYTES = 512 << 20


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="the ways of saving a checkpoint side by side (torch.save, stagesave, DCP, Lightning, "
        "Accelerate) on a target folder or URL",
        description=__doc__.split("\n\n")[0].replace("``", "") if __doc__ else None,
        epilog="Several sizes, loads, cold caches and a plot: benchmarks/bench_sweep.py in the "
               "source tree.",
    )
    p.add_argument("target", metavar="DIR|URL", nargs="?",
                   help="where to write (a folder, or e.g. s3://bucket/prefix)")
    p.add_argument(
        "--size", default="256MB", help="size of the synthetic training state (default 256MB)"
    )
    p.add_argument("--alternatives", default=",".join(DEFAULT_ALTERNATIVES), metavar="NAMES",
                   help="comma-separated alternatives to compare, or 'all' (default: %(default)s; "
                        "--list shows them)")
    p.add_argument(
        "--list", action="store_true", help="list the alternatives and whether they can run here"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="measured saves per alternative, one per round; the median is shown (default 3)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="uncounted saves before each measured one, for alternatives that reuse something "
        "across saves (stagesave's buffer, DCP's stager or daemon; default 1)",
    )
    p.add_argument(
        "--loop",
        action="store_true",
        help="run a small CPU training loop through each save and report the training time lost "
        "per save (blocking + what the loop lost while the write ran)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _select(spec: str) -> list[Alternative]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    builtin = {a.name for a in available_alternatives(plugins=False)}
    # the integrations' alternatives import Lightning / Accelerate: load them only when asked for
    known = available_alternatives(plugins=spec.strip() == "all" or not set(names) <= builtin)
    if spec.strip() == "all":
        return known
    by_name = {a.name: a for a in known}
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        failed = [
            f"{a.name}: {a.unavailable()}" for a in known if a.name.endswith("(failed to load)")
        ]
        raise CliError(f"unknown alternatives {unknown or [spec]}; known: {', '.join(by_name)}"
                       + (f"; not loaded: {'; '.join(failed)}" if failed else ""), 2)
    return [by_name[n] for n in dict.fromkeys(names)]


def _list(env: Env, args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = [
        {
            "name": a.name,
            "unavailable": a.unavailable(),
            "note": a.note,
            "durable": a.durable,
            "urls": a.urls,
        }
        for a in available_alternatives()
    ]
    if args.json:
        env.print_json({"alternatives": rows})
        return 0
    t = Table(title="stagesave bench --alternatives", title_justify="left", header_style="bold")
    for col in ("name", "runs here", "what it does"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            literal(r["name"]),
            literal("yes" if r["unavailable"] is None else f"no: {r['unavailable']}"),
            literal(r["note"]),
        )
    env.out.print(t)
    return 0


def run(env: Env, args: argparse.Namespace) -> int:
    if args.list:
        return _list(env, args)
    if args.target is None:
        raise CliError("bench needs a target folder or URL (or --list)", 2)
    if args.repeat < 1 or args.warmup < 0:
        raise CliError("--repeat must be at least 1 and --warmup at least 0", 2)
    alts = _select(args.alternatives)
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        raise CliError(str(exc), 2) from exc
    available = mem_available_bytes()
    if available is not None and size + HEADROOM_BYTES > available:
        raise CliError(
            f"a {fmt_bytes(size)} state does not fit in memory here ({fmt_bytes(available)} "
            "available); pick a smaller --size",
            2,
        )
    try:
        state = synthetic_state(size)
    except ValueError as exc:
        raise CliError(str(exc), 2) from exc
    root = args.target.rstrip("/") or "/"
    if not is_url(root):
        root = os.path.abspath(os.path.expanduser(root))
        if not os.path.isdir(root):
            raise CliError(f"{root} is not a folder; create it or pick another target")
    target = BenchTarget(env, root)
    nbytes = state_bytes(state)
    skipped: list[dict[str, str]] = []
    runnable: list[Alternative] = []
    available = mem_available_bytes()  # the state is built now
    for alt in alts:
        reason = alt.unavailable()
        if reason is None and target.url and not alt.urls:
            reason = "writes local paths only"
        if (
            reason is None
            and available is not None
            and nbytes * alt.copies + HEADROOM_BYTES > available
        ):
            reason = (f"needs {fmt_bytes(nbytes * alt.copies + HEADROOM_BYTES)} more memory, "
                      f"{fmt_bytes(available)} available")
        if reason is None:
            runnable.append(alt)
        else:
            skipped.append({"method": alt.label(target.url), "reason": reason})
    if not runnable:
        raise CliError("none of the chosen alternatives can run here: "
                       + "; ".join(f"{s['method']}: {s['reason']}" for s in skipped))
    floors: dict[str, Any] = {"copy_s": None, "disk_s": None, "disk_direct": None}
    if available is None or nbytes + HEADROOM_BYTES <= available:
        floors["copy_s"] = copy_floor_s(state_tensors(state))
    if not target.url:
        try:
            floors["disk_s"], floors["disk_direct"] = disk_floor_s(root, nbytes)
        except OSError as exc:
            raise CliError(
                f"cannot write {fmt_bytes(nbytes)} into {root} to measure the disk floor: {exc}"
            ) from exc
    timings = {a.name: Timing(a.label(target.url), durable=a.durable) for a in runnable}
    loop = TrainLoop() if args.loop else None
    if loop is not None:
        loop.baseline(0.2)  # warm its allocations and threads
    total = sum(nbytes * (1 + (args.warmup if a.warmup else 0)) for a in runnable) * args.repeat
    with env.progress("benchmarking", total) as advance, warnings.catch_warnings():
        # DCP warns on every single-process save, from its background thread too
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to save in a single process.*"
        )
        for r in range(args.repeat):
            order = runnable[r % len(runnable):] + runnable[: r % len(runnable)] if runnable else []
            for alt in order:
                measure_round(
                    env, target, alt, state, args, loop, timings[alt.name], advance, nbytes
                )
    results = [timings[a.name].to_dict(nbytes) for a in runnable]
    for res in results:
        if floors["copy_s"]:
            res["blocking_x_copy_floor"] = res["blocking_s"] / floors["copy_s"]
            if "lost_s" in res:
                res["lost_x_copy_floor"] = res["lost_s"] / floors["copy_s"]
        if floors["disk_s"]:
            res["durable_x_disk_floor"] = res["durable_s"] / floors["disk_s"]
    if args.json:
        env.print_json({"target": root, "state_bytes": nbytes, "floors": floors, "results": results,
                        "skipped": skipped, "torch_threads": torch.get_num_threads()})
        return 0
    _print_table(env, root, nbytes, args, floors, results, skipped, loop is not None)
    return 0


def _print_table(
    env: Env,
    root: str,
    nbytes: int,
    args: argparse.Namespace,
    floors: dict[str, Any],
    results: list[dict[str, Any]],
    skipped: list[dict[str, str]],
    with_loop: bool,
) -> None:
    ref = next(
        (r for r in results if r["method"].startswith("torch.save")),
        results[0] if results else None,
    )
    t = Table(
        title=literal(f"{fmt_bytes(nbytes)} training state -> {root} (median of {args.repeat})"),
        title_justify="left",
        header_style="bold",
    )
    cols = [
        "method",
        "training blocked",
        "blocked x copy floor",
        "complete after",
        "x disk floor",
        "throughput",
        f"stall vs {ref['method'] if ref else '-'}",
    ]
    if with_loop:
        cols += ["training lost", "lost x copy floor", "step time while writing (mean/p99)"]
    for col in cols:
        t.add_column(col, justify="left" if col == "method" else "right")

    def ratio(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.2f}x" if key in r else "-"

    for r in results:
        complete = fmt_duration(r["durable_s"]) + ("" if r["durable"] else " (not durable)")
        row: list[str | Text] = [
            literal(r["method"]),
            fmt_duration(r["blocking_s"]),
            ratio(r, "blocking_x_copy_floor"),
            complete,
            ratio(r, "durable_x_disk_floor"),
            fmt_rate(r["throughput_bytes_per_s"]),
            f"{r['blocking_s'] / ref['blocking_s']:.2f}x" if ref and ref["blocking_s"] > 0 else "-",
        ]
        if with_loop:
            row += [fmt_duration(r["lost_s"]), ratio(r, "lost_x_copy_floor"),
                    f"{r['step_mean_x']:.2f}x / {r['step_p99_x']:.2f}x"]
        t.add_row(*row)
    env.out.print(t)
    parts = []
    if floors["copy_s"]:
        parts.append(f"copy floor {fmt_duration(floors['copy_s'])}")
    if floors["disk_s"]:
        parts.append(
            f"disk floor {fmt_duration(floors['disk_s'])}"
            + (
                " (O_DIRECT + fsync)"
                if floors["disk_direct"]
                else " (buffered + fsync: O_DIRECT refused)"
            )
        )
    if parts:
        env.out.print("; ".join(parts))
    if with_loop and results:
        env.out.print(
            f"training loop: {results[0]['loop_ms_per_step']:.1f} ms per step at baseline, torch "
            f"on {torch.get_num_threads()} threads; lost = blocked + what the loop lost while the "
            "write ran"
        )
    for s in skipped:
        env.say(f"skipped {s['method']}: {s['reason']}")
