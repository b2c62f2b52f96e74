"""What a steady save's walk costs: the walk of the state, its tensors' data addresses and (where
the checkout has them) its tensors' storage objects, medians of 9 in one process.

Usage (two checkouts alternated, each in its own process)::

    PYTHONPATH=<checkout before>/src python benchmarks/bench_walk_checks.py
    python benchmarks/bench_walk_checks.py

The states are ``bench_shapes.py``'s (``--shapes``). A checkout whose walk has no
``storage_ids`` (before 2026-12-07's review of the steady save) is timed without them.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_shapes import SHAPES

from stagesave.saving.walk import Walked, walk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["s8000", "s100k"], choices=list(SHAPES))
    args = ap.parse_args()
    checks = hasattr(Walked, "storage_ids")
    for key in args.shapes:
        label, make = SHAPES[key]
        state = make()
        gc.disable()  # as in a save, whose planning pauses the collector
        times = []
        for _ in range(9):
            t = time.perf_counter()
            walked = walk(state)
            walked.addresses  # noqa: B018 - cached properties, computed here
            if checks:
                walked.storage_ids  # noqa: B018
            times.append(time.perf_counter() - t)
        gc.enable()
        what = "walk, addresses, storage objects" if checks else "walk, addresses"
        print(f"{label:<58} {what}: {statistics.median(times) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
