"""Saving a GPU state: host staging against device staging, with and without GPUDirect Storage.

Needs a CUDA device (exits with a message otherwise). A ``common.transformer_state`` of ``--gib``
GiB is moved to the GPU and saved into ``--dir`` by a ``stagesave.Checkpointer`` in each mode,
interleaved over ``--repeats`` rounds:

- ``host``: the default (pinned host buffers, device-to-host copies on a side stream);
- ``device, bounce``: ``device_staging=True`` with kvikio hidden (pinned bounce buffers + O_DIRECT);
- ``device, kvikio``: ``device_staging=True`` with kvikio, when it is installed and not in its
  compatibility mode (GPUDirect Storage).

Each save's own telemetry gives the blocking time and the time to commit; the floors of the same
round are one device-to-host copy of every tensor into a reused pinned buffer and one
device-to-device copy into a reused device buffer.

Usage: python benchmarks/bench_device_staging.py --dir /nvme/scratch [--gib 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import common
import torch

import stagesave.checkpointer as checkpointer_mod
from stagesave import Checkpointer
from stagesave.saving.stage_device import gpudirect_kvikio

GIB = 1 << 30


def to_cuda(obj: Any) -> Any:
    """Every tensor of a nested state on the GPU except 0-dim ones (Adam keeps its step counters
    on the host unless ``capturable``)."""
    if isinstance(obj, torch.Tensor):
        return obj.cuda() if obj.dim() else obj
    if isinstance(obj, dict):
        return {k: to_cuda(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cuda(v) for v in obj)
    return obj


def copy_floor_s(tensors: list[torch.Tensor], dst: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        dst[off : off + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
        off += n
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", required=True)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_device_staging.py needs a CUDA device; this machine has none")
    n = int(args.gib * GIB)
    state = to_cuda(common.transformer_state(n, d_model=common.d_model_for(n)))
    tensors = [t for t in common.tensors_of(state) if t.is_cuda]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device_dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    kvikio = gpudirect_kvikio()
    modes = ["host", "device, bounce"] + (["device, kvikio"] if kvikio is not None else [])
    results: dict[str, list[tuple[float, float]]] = {
        m: [] for m in [*modes, "D2H floor", "D2D floor"]
    }
    real_kvikio = checkpointer_mod.gpudirect_kvikio
    for r in range(args.repeats + 1):  # the first round allocates the buffers
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
            checkpointer_mod.gpudirect_kvikio = (
                real_kvikio if mode == "device, kvikio" else (lambda: None)
            )
            try:
                with Checkpointer(
                    args.dir, device_staging=mode != "host", max_pending=1, keep_last=1
                ) as ck:
                    for i in range(2):  # the second save reuses the buffer
                        tel = ck.save(state, f"bench-{i}.pt").result()
            finally:
                checkpointer_mod.gpudirect_kvikio = real_kvikio
            if r:
                results[mode].append((tel.blocking_s, tel.time_to_commit_s))
        if r:
            results["D2H floor"].append((copy_floor_s(tensors, pinned), 0.0))
            results["D2D floor"].append((copy_floor_s(tensors, device_dst), 0.0))
    d2h = statistics.median(x for x, _ in results["D2H floor"])
    gds = (
        "using GPUDirect Storage"
        if kvikio is not None
        else "not installed or in compatibility mode"
    )
    print(
        f"\n{args.gib:g} GiB on {torch.cuda.get_device_name()}, {args.repeats} rounds, kvikio "
        f"{gds}; medians:\n"
    )
    print("| mode | blocking s | × D2H copy floor | time to commit s |\n|---|---|---|---|")
    for mode, xs in results.items():
        b = statistics.median(x for x, _ in xs)
        c = statistics.median(y for _, y in xs)
        print(f"| {mode} | {b:.4f} | {b / d2h:.2f} | {c:.3f} |" if "floor" not in mode else
              f"| {mode} | {b:.4f} | {b / d2h:.2f} | — |")


if __name__ == "__main__":
    main()
