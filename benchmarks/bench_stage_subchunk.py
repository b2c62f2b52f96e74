"""How big should the piece be that one staging thread copies before hashing it?

``stagesave.saving.stage.stage_and_hash`` copies a host-memory state into the staging buffer and
hashes
every byte right after copying it, a sub-chunk at a time, so that the hash reads the bytes from
the core's cache instead of memory. The sub-chunk must fit that cache together with the source it
was read from. This runs the real ``stage_and_hash`` on a ``common.transformer_state`` of
``--gib`` GiB with each sub-chunk size, interleaved with the copy floor (every tensor copied once
into a reused buffer, ``stagesave.cli._floors.copy_floor_s``) and ``stage_image`` (the copy
without hashing), ``--repeats`` rounds in a rotating order, and prints the median and range of
each one's time and of its ratio to the same round's copy floor.

With ``--dir DIR`` it instead saves the state with a real ``stagesave.Checkpointer`` into DIR,
alternating the sub-chunk sizes, and reports the save's own telemetry (plan, staging and blocking
time) against the copy floor measured right after each save.

Usage: python benchmarks/bench_stage_subchunk.py [--gib 2] [--repeats 9] [--sizes 1024,512,256,128]
                                                 [--dir DIR] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import common

import stagesave.saving.crc_pass as crc_mod
import stagesave.saving.stage as stage_mod
from stagesave.cli._floors import copy_floor_s  # the CLI bench's floor: the reference here
from stagesave.saving.buffers import HostBuffer
from stagesave.saving.plan import plan_torch_file

GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--sizes", default="1024,512,256,128", help="sub-chunk sizes in KiB")
    ap.add_argument(
        "--threads", type=int, default=2, help="staging threads (stagesave uses the cores)"
    )
    ap.add_argument(
        "--dir", default=None, help="save through a Checkpointer into this folder instead"
    )
    ap.add_argument("--markdown", default=None, help="append the table to this file")
    args = ap.parse_args()
    if args.dir:
        checkpointer_rounds(args)
        return

    n = int(args.gib * GIB)
    state = common.transformer_state(n, d_model=common.d_model_for(n))
    tensors = common.tensors_of(state)
    image = plan_torch_file(state)
    buf = HostBuffer.allocate(image.size, pinned=False)
    buf.tensor.fill_(0)  # touched once, as a pooled buffer is after its first save
    pool = cf.ThreadPoolExecutor(args.threads)
    default = crc_mod.SUB_CHUNK

    def fused(sub: int) -> None:
        crc_mod.SUB_CHUNK = sub
        try:
            stage_mod.stage_and_crc(
                image, buf, 0, chunk_bytes=32 << 20, pool=pool
            )
        finally:
            crc_mod.SUB_CHUNK = default

    def staged() -> None:
        stage_mod.stage_image(image, buf)

    cases: dict[str, object] = {"copy floor": lambda: copy_floor_s(tensors, repeats=1),
                                "stage_image (copy, no hash)": staged}
    for kib in [int(x) for x in args.sizes.split(",")]:
        label = f"stage_and_hash, {kib} KiB" + (
            " (this machine's default)" if kib << 10 == default else ""
        )
        cases[label] = functools.partial(fused, kib << 10)
    names = list(cases)
    times: dict[str, list[float]] = {k: [] for k in names}
    ratios: dict[str, list[float]] = {k: [] for k in names}
    for name in names:  # warm up
        cases[name]()  # type: ignore[operator]
    for r in range(args.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        got = {}
        for name in order:
            t0 = time.perf_counter()
            measured = cases[name]()  # type: ignore[operator]
            # the copy floor times its own copy (not the allocation of its buffer)
            got[name] = measured if isinstance(measured, float) else time.perf_counter() - t0
        for name in names:
            times[name].append(got[name])
            ratios[name].append(got[name] / got["copy floor"])
    rows = []
    for name in names:
        xs, rs = times[name], ratios[name]
        rows.append(
            f"| {name} | {statistics.median(xs) * 1e3:.1f} "
            f"({min(xs) * 1e3:.1f}–{max(xs) * 1e3:.1f}) | "
            f"{statistics.median(rs):.2f} ({min(rs):.2f}–{max(rs):.2f}) |"
        )
    text = (
        f"\n`python benchmarks/bench_stage_subchunk.py --gib {args.gib:g} --repeats {args.repeats} "
        f"--sizes {args.sizes}` ({time.strftime('%Y-%m-%d %H:%M')}; {len(tensors)} tensors, "
        f"{image.size / GIB:.2f} GiB image, {args.threads} threads, L2 per core "
        f"{(crc_mod._l2_cache_bytes() or 0) >> 10} KiB):\n\n"
        "| staging | ms, median (min–max) | × copy floor, median of the rounds (min–max) "
        "|\n|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text)


def checkpointer_rounds(args: argparse.Namespace) -> None:
    """Real saves, sub-chunk sizes alternated, each save's telemetry against the copy floor."""
    from stagesave import Checkpointer

    n = int(args.gib * GIB)
    state = common.transformer_state(n, d_model=common.d_model_for(n))
    tensors = common.tensors_of(state)
    sizes = [int(x) << 10 for x in args.sizes.split(",")]
    default = crc_mod.SUB_CHUNK
    got: dict[int, list[tuple[float, float, float]]] = {s: [] for s in sizes}
    with Checkpointer(args.dir, keep_last=1) as ck:
        for r in range(args.repeats + 1):  # the first round warms up (allocates the buffer)
            order = sizes[r % len(sizes):] + sizes[: r % len(sizes)]
            for sub in order:
                crc_mod.SUB_CHUNK = sub
                try:
                    tel = ck.save(state, f"bench-{r}-{sub}.pt").telemetry
                    ck.wait()
                finally:
                    crc_mod.SUB_CHUNK = default
                floor = copy_floor_s(tensors)
                if r:
                    got[sub].append(
                        (tel.plan_s / floor, tel.stage_s / floor, tel.blocking_s / floor)
                    )
    rows = []
    for sub in sizes:
        med = [statistics.median(x[i] for x in got[sub]) for i in range(3)]
        mark = " (this machine's default)" if sub == default else ""
        rows.append(f"| {sub >> 10} KiB{mark} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} |")
    text = (
        f"\n`python benchmarks/bench_stage_subchunk.py --gib {args.gib:g} --repeats {args.repeats} "
        f"--sizes {args.sizes} --dir DIR` ({time.strftime('%Y-%m-%d %H:%M')}; {len(tensors)} "
        "tensors, "
        "a Checkpointer's own telemetry, medians of the rounds):\n\n"
        "| sub-chunk | plan × copy floor | staging × copy floor | blocking × copy floor "
        "|\n|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
