"""How long does laying out the file image (the plan) hold the training loop, and what does the
garbage-collector pause change?

The plan pickles the state's structure through ``torch.save`` (with ``skip_data``): for a state
of N tensors that is a few hundred thousand short-lived Python objects, enough to trigger the
cyclic collector several times, and a full collection visits every object of the process. A
training process holds millions (modules, datasets, tokenizers), simulated here by ``--objects``
small dicts kept alive. Both variants plan the same state, interleaved, ``--repeats`` times:

- ``collector on``: ``stagesave.saving.plan._plan_torch_file`` (the plan as it was before the
pause);
- ``collector paused``: ``stagesave.saving.plan.plan_torch_file`` (``gc_paused`` around it).

The states are ``common.transformer_state`` layouts with the tensor counts of the 2 GiB and
8 GiB sweep states (672 and 2,736 tensors), at 1/64 of the bytes (the plan never touches tensor
data, so only the count matters).

Usage: python benchmarks/bench_plan.py [--repeats 30] [--objects 0,2000000] [--markdown plan.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import common

# _plan_torch_file: the same plan without the collector pause, the variant compared here
from stagesave.saving.plan import _plan_torch_file, plan_torch_file

GIB = 1 << 30


def timed(fn, state) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn(state)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument(
        "--objects", default="0,2000000", help="Python objects kept alive beside the state"
    )
    ap.add_argument("--markdown", default=None, help="append the table to this file")
    args = ap.parse_args()
    rows = []
    keep: list[dict[str, list[int]]] = []
    for objects in [int(x) for x in args.objects.split(",")]:
        keep.extend({"x": [i]} for i in range(objects - len(keep)))
        for gib in (2, 8):
            n = gib * GIB
            state = common.transformer_state(n // 64, d_model=common.d_model_for(n) // 8)
            tensors = len(common.tensors_of(state))
            on: list[float] = []
            off: list[float] = []
            for _ in range(2):  # warm up both
                timed(_plan_torch_file, state), timed(plan_torch_file, state)
            for _ in range(args.repeats):
                on.append(timed(_plan_torch_file, state))
                off.append(timed(plan_torch_file, state))
            for name, xs in (("collector on", on), ("collector paused", off)):
                q = statistics.quantiles(xs, n=20)
                rows.append(
                    f"| {tensors} | {objects:,} | {name} | {statistics.median(xs) * 1e3:.1f} | "
                    f"{q[-1] * 1e3:.1f} | {max(xs) * 1e3:.1f} |"
                )
            print(rows[-2] + "\n" + rows[-1], flush=True)
    text = (
        f"\n`python benchmarks/bench_plan.py --repeats {args.repeats} --objects {args.objects}` "
        f"({time.strftime('%Y-%m-%d %H:%M')}), ms per plan:\n\n"
        "| tensors | objects alive | plan | median | p95 | max |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
