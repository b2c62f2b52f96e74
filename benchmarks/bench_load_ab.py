"""Loads of one file by this checkout and by an earlier one, alternated in one process.

Usage:
    git worktree add /tmp/before <commit>
    python benchmarks/bench_load_ab.py --before /tmp/before/src --shapes s8000 s100k --rounds 8
    python benchmarks/bench_load_ab.py --before /tmp/before/src --shapes s8000 --cold --rounds 6

The earlier checkout's package is copied under another name (``stagesave_before``: the package's
own imports are relative) and imported beside this one, so both load the same file in the same
process, the order alternated every round: on a machine whose speed moves by tens of percent
from minute to minute, only such a comparison shows a change of a few percent. Each shape
(``bench_shapes.SHAPES``) is saved once by this checkout; every round loads it with each
checkout, verified and not, after a collection (``--cold``: the page cache dropped before each
load, root only). Printed: medians of wall and CPU seconds; ``--json`` keeps every sample.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import common
from bench_shapes import SHAPES

import stagesave


def _import_before(src: str, scratch: str) -> Any:
    """The package under ``src`` (a checkout's ``src``) imported as ``stagesave_before``."""
    shutil.copytree(os.path.join(src, "stagesave"), os.path.join(scratch, "stagesave_before"))
    sys.path.insert(0, scratch)
    import stagesave_before

    return stagesave_before


def measure(shape: str, directory: str, before: Any, rounds: int, cold: bool) -> dict[str, Any]:
    root = os.path.join(directory, shape)
    state = SHAPES[shape][1]()
    with stagesave.Checkpointer(root, keep_last=1, writer="thread") as ck:
        ck.save(state, "a.ckpt").result()
    del state
    cks = {"before": before.Checkpointer(root, keep_last=1, writer="thread"),
           "after": stagesave.Checkpointer(root, keep_last=1, writer="thread")}
    out: dict[str, Any] = {f"{w}_{v}_{m}": [] for w in cks for v in ("verify", "unverified")
                           for m in ("wall_s", "cpu_s")}
    try:
        for i in range(rounds):
            for which in ("before", "after") if i % 2 else ("after", "before"):
                for verify in (True, False):
                    gc.collect()
                    if cold:
                        common.drop_caches()
                    c0, t0 = time.process_time(), time.perf_counter()
                    loaded = cks[which].load("a.ckpt", verify=verify)
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    del loaded
                    v = "verify" if verify else "unverified"
                    out[f"{which}_{v}_wall_s"].append(wall)
                    out[f"{which}_{v}_cpu_s"].append(cpu)
    finally:
        for ck in cks.values():
            ck.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="the earlier checkout's src folder")
    ap.add_argument("--shapes", nargs="+", default=["s8000", "s100k"], choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each load")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="bench-load-ab-")
    try:
        before = _import_before(args.before, scratch)
        results = {}
        for shape in args.shapes:
            directory = args.dir or scratch
            r = results[shape] = measure(shape, directory, before, args.rounds, args.cold)
            for v in ("verify", "unverified"):
                b, a = (statistics.median(r[f"{w}_{v}_wall_s"]) for w in ("before", "after"))
                bc, ac = (statistics.median(r[f"{w}_{v}_cpu_s"]) for w in ("before", "after"))
                print(f"{shape:6s} {v:10s} before {b:.3f} s (CPU {bc:.3f})  after {a:.3f} s "
                      f"(CPU {ac:.3f})  after/before {a / b:.2f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
