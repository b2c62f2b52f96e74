"""Accelerate benchmark: how long ``accelerator.save_state()`` blocks, with and without stagesave.

Usage::

    python benchmarks/bench_accelerate.py --param-gib 1 --repeats 3 --dir /path/on/the/disk

A real ``Accelerator`` (CPU) prepares a stack of linear layers holding ``--param-gib`` GiB of fp32
parameters and an AdamW optimizer after one step (two more moments per parameter: the folder
holds about 3x the parameter bytes). Each repeat saves the same moment twice in one process, on
the same disk: once with Accelerate's own ``save_state`` (blocking = the whole call; the files
then sit in the page cache, so "durable" adds an fsync of every file) and once with
``stagesave.accelerate.enable`` (blocking = until ``save_state`` returns; "commit" = until the
folder is durable and committed). The order alternates between repeats; ``--warmup`` unmeasured
saves of each kind come first (stagesave allocates its reused staging buffer on the first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch


def build_accelerator(param_gib: float, width: int) -> tuple[Any, Any, Any, int]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    per_layer = width * width + width
    layers = max(1, round(param_gib * 2**30 / 4 / per_layer))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(4, width)
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    params = sum(p.numel() for p in model.parameters())
    return accelerator, model, optimizer, params


def folder_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(top, n)) for top, _, names in os.walk(path) for n in names
    )


def fsync_folder(path: str) -> None:
    for top, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(top, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import stagesave.accelerate
    from accelerate import Accelerator

    base = args.dir or tempfile.mkdtemp(
        prefix="bench-accelerate-", dir="/work" if os.path.isdir("/work") else None
    )
    os.makedirs(base, exist_ok=True)
    accelerator, _, _, params = build_accelerator(args.param_gib, args.width)
    ckpt = stagesave.accelerate.AcceleratorCheckpointer(accelerator, max_pending=1)
    res: dict[str, list[float]] = {"accelerate_blocking": [], "accelerate_durable": [],
                                   "stagesave_blocking": [], "stagesave_commit": [],
                                   "stagesave_plan": [], "stagesave_stage": []}
    nbytes = 0
    try:
        for w in range(args.warmup):  # first use: allocate the staging buffer, warm the files
            warm = os.path.join(base, f"warmup_{w}")
            Accelerator.save_state(accelerator, warm)
            shutil.rmtree(warm)
            handle = ckpt.save_state(warm)
            assert handle is not None
            handle.result()
            shutil.rmtree(warm)
        for r in range(args.repeats):
            order = ["accelerate", "stagesave"] if r % 2 == 0 else ["stagesave", "accelerate"]
            for which in order:
                target = os.path.join(base, f"{which}_{r}")
                if which == "accelerate":
                    t0 = time.perf_counter()
                    Accelerator.save_state(accelerator, target)
                    blocking = time.perf_counter() - t0
                    fsync_folder(target)
                    res["accelerate_blocking"].append(blocking)
                    res["accelerate_durable"].append(time.perf_counter() - t0)
                    nbytes = folder_bytes(target)
                else:
                    t0 = time.perf_counter()
                    handle = ckpt.save_state(target)
                    blocking = time.perf_counter() - t0
                    assert handle is not None
                    handle.result()
                    res["stagesave_blocking"].append(blocking)
                    res["stagesave_commit"].append(time.perf_counter() - t0)
                    res["stagesave_plan"].append(handle.telemetry.plan_s)
                    res["stagesave_stage"].append(handle.telemetry.stage_s)
                shutil.rmtree(target)
    finally:
        ckpt.close()
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "param_gib": args.param_gib,
        "parameters": params,
        "checkpoint_bytes": nbytes,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "seconds": res,
        "median_s": med,
        "blocking_reduction_x": med["accelerate_blocking"] / med["stagesave_blocking"],
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--param-gib", type=float, default=1.0, help="GiB of fp32 parameters (AdamW adds 2x)"
    )
    ap.add_argument("--width", type=int, default=4096, help="width of each square linear layer")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured saves of each kind first")
    ap.add_argument(
        "--dir", default=None, help="directory on the disk to test (default: a temp dir)"
    )
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    out = run(args)
    med = out["median_s"]
    gib = out["checkpoint_bytes"] / 2**30
    print(
        f"{out['parameters']:,} parameters, checkpoint folder {gib:.3f} GiB, {args.repeats} "
        "repeats (median)"
    )
    print("| save_state | blocking (s) | until durable (s) |")
    print("|---|---|---|")
    print(
        f"| Accelerate | {med['accelerate_blocking']:.3f} | {med['accelerate_durable']:.3f} "
        "(+fsync) |"
    )
    print(
        f"| stagesave  | {med['stagesave_blocking']:.3f} | {med['stagesave_commit']:.3f} "
        "(committed) |"
    )
    print(
        f"blocking reduction: {out['blocking_reduction_x']:.1f}x "
        f"(stagesave blocking = plan {med['stagesave_plan']:.3f} s + staging copy "
        f"{med['stagesave_stage']:.3f} s + rest)"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
