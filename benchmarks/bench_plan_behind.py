"""The first save of a structure planned behind the caller (``plan_behind``) or on its time.

Usage:
    python benchmarks/bench_plan_behind.py                          # s200 s8000 s100k, 4 rounds
    python benchmarks/bench_plan_behind.py --shapes s100k --rounds 6 --writer process

For each shape (``bench_shapes.py``'s), in one process, ``--rounds`` rounds alternating the two
modes (``behind``: ``plan_behind=True``; ``caller``: ``plan_behind=False``), each round a new
Checkpointer with nothing planned (the zip layout cache emptied too): the first save's blocking
time and its time until committed, then three saves of the same structure (the first of them
finds a held save's template at other addresses and checks the storages again), each finished
before the next. Medians; the ratio of the first save to the median of the last two saves
(steady). ``--json`` writes every sample.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import bench_shapes

import stagesave
from stagesave.saving import ziplayout

MODES = {"behind": True, "caller": False}


def one_round(state: Any, root: str, behind: bool, writer: str) -> dict[str, Any]:
    ziplayout.forget_layouts()
    with stagesave.Checkpointer(root, keep_last=None, writer=writer, plan_behind=behind) as ck:
        t0 = time.perf_counter()
        handle = ck.save(state, "first.ckpt")
        blocking = time.perf_counter() - t0
        handle.result()
        committed = time.perf_counter() - t0
        tel = handle.telemetry
        after = []
        for i in range(3):
            bench_shapes._bump(state, i + 1)
            t0 = time.perf_counter()
            h = ck.save(state, f"next-{i}.ckpt")
            after.append(time.perf_counter() - t0)
            h.result()
    shutil.rmtree(root, ignore_errors=True)
    return {"first_s": blocking, "committed_s": committed, "plan_s": tel.plan_s,
            "plan_behind_s": tel.plan_behind_s, "after_s": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["s200", "s8000", "s100k"],
                    choices=list(bench_shapes.SHAPES))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--writer", default="thread", choices=["thread", "process"])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-behind-", dir=args.dir)
    med = statistics.median
    results: dict[str, Any] = {"writer": args.writer}
    try:
        for key in args.shapes:
            label, make = bench_shapes.SHAPES[key]
            state = make()
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for i in range(args.rounds):
                order = list(MODES) if i % 2 == 0 else list(MODES)[::-1]
                for mode in order:
                    runs[mode].append(one_round(state, os.path.join(base, f"{key}-{mode}-{i}"),
                                                MODES[mode], args.writer))
            results[key] = {"label": label, **runs}
            print(label, flush=True)
            for mode, rs in runs.items():
                first = med(r["first_s"] for r in rs)
                steady = med(med(r["after_s"][1:]) for r in rs)
                print(f"  {mode:<7} first {first * 1e3:8.1f} ms ({first / steady:5.2f}x steady "
                      f"{steady * 1e3:.1f} ms), committed {med(r['committed_s'] for r in rs):6.2f}"
                      f" s, next save {med(r['after_s'][0] for r in rs) * 1e3:8.1f} ms, planned "
                      f"behind {med(r['plan_behind_s'] for r in rs):5.2f} s", flush=True)
    finally:
        bench_shapes._finish(base, results, args.json)  # the folder removed, every sample kept


if __name__ == "__main__":
    main()
