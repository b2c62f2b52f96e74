"""Threads and memory across many Accelerators in one process (issue 17: a sweep must not leak).

Creates ``--n`` Accelerators one after the other in one process, as a hyper-parameter sweep, a
notebook or a test suite does. Each one gets ``stagesave.accelerate.enable()``, prepares a fresh
model and AdamW optimizer holding about ``--state-mib`` MiB of checkpointed state (parameters plus
the two Adam moments: the folder ``save_state`` writes), takes ``--steps`` training steps with a
``save_state()`` after each (inside the loop: asynchronous), then ``end_training()``, and is
dropped. After each one the script prints the live ``stagesave-*`` threads and the process's RSS
(resident pages from ``/proc/self/statm``), after a ``gc.collect()``.

A leak shows as threads that grow by a few per Accelerator and RSS that grows by about a staging
buffer (the state's size) per save in flight per Accelerator. With resources following the run,
threads are 0 after each and RSS stays within about one state of the first iteration's.

Usage::

    python benchmarks/bench_many_accelerators.py [--n 20] [--state-mib 64] [--steps 2] [--dir D]
    [--json OUT] [--trim]

``--trim`` calls glibc's ``malloc_trim(0)`` before each RSS reading: what remains is memory still
in use, without the freed heap pages glibc keeps for reuse (freed tensors of a few MiB come from
the heap once glibc has raised its mmap threshold, and stay resident until trimmed).

The state is built from a few large linear layers, so the figure depends on bytes, not on the
number of tensors. The checkpoints go to ``--dir`` (default: a temporary directory, removed at
the end), one project folder per Accelerator with ``total_limit=1`` (kept until the end: a save
still pending after ``end_training()`` must find its folder).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


def rss_mib() -> float:
    """Resident set size from ``/proc/self/statm`` (second field, in pages)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * PAGE / MIB


def malloc_trim() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def stagesave_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("stagesave"))


def one_run(project: str, state_mib: float, steps: int, width: int) -> dict[str, Any]:
    """One Accelerator from construction to ``end_training()``; returns what it saved."""
    import stagesave.accelerate
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, total_limit=1))
    stagesave.accelerate.enable(acc)
    params = max(1, int(state_mib * MIB / 3 / 4))  # fp32 parameters + 2 Adam moments
    layers = max(1, round(params / (width * width + width)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(8, width)
    blocked = []
    for _ in range(steps):
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        t0 = time.perf_counter()
        acc.save_state()
        blocked.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    acc.end_training()
    end_s = time.perf_counter() - t0
    folder_mib = sum(p.numel() * p.element_size() * 3 for p in model.parameters()) / MIB
    del acc, model, opt
    return {"blocked_s": blocked, "end_training_s": end_s, "state_mib": folder_mib}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20, help="Accelerators, one after the other")
    p.add_argument(
        "--state-mib", type=float, default=64.0, help="checkpointed state per Accelerator"
    )
    p.add_argument(
        "--steps", type=int, default=2, help="training steps (each followed by save_state)"
    )
    p.add_argument("--width", type=int, default=1024, help="width of the square linear layers")
    p.add_argument(
        "--dir", default=None, help="where the project folders go (default: a temporary dir)"
    )
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) before each RSS reading")
    args = p.parse_args(argv)
    import stagesave

    torch.manual_seed(0)
    base = args.dir or tempfile.mkdtemp(prefix="bench-many-acc-")
    rows = []
    print(
        f"stagesave from {os.path.dirname(stagesave.__file__)}; torch {torch.__version__}; "
        f"{args.n} Accelerators, {args.steps} save_state each, state ~{args.state_mib:.0f} MiB",
        flush=True,
    )
    print(
        f"{'#':>3} {'threads':>7} {'RSS MiB':>8} {'vs #0':>7} {'blocked ms':>10} "
        f"{'end_training s':>14}",
        flush=True,
    )
    try:
        for i in range(args.n):
            project = os.path.join(base, f"run{i}")
            run = one_run(project, args.state_mib, args.steps, args.width)
            gc.collect()
            if args.trim:
                malloc_trim()
            threads = stagesave_threads()
            rss = rss_mib()
            row = {
                "i": i,
                "threads": len(threads),
                "thread_names": threads,
                "rss_mib": round(rss, 1),
                **run,
            }
            rows.append(row)
            growth = rss - rows[0]["rss_mib"]
            print(
                f"{i:>3} {len(threads):>7} {rss:>8.0f} {growth:>+7.0f} "
                f"{1e3 * max(run['blocked_s']):>10.1f} {run['end_training_s']:>14.2f}",
                flush=True,
            )
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    first, last = rows[0], rows[-1]
    print(
        f"state {first['state_mib']:.0f} MiB; threads after #0: {first['threads']}, after "
        f"#{last['i']}: {last['threads']} (max {max(r['threads'] for r in rows)}); RSS #0 "
        f"{first['rss_mib']:.0f} MiB -> #{last['i']} {last['rss_mib']:.0f} MiB (max "
        f"{max(r['rss_mib'] for r in rows):.0f})"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"argv": sys.argv, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
