"""Shared pieces of the benchmarks: synthetic states, floors, cache control, statistics."""

from __future__ import annotations

import mmap
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch

# the floors the CLI's bench reports: the benchmarks measure against the same references
from stagesave.cli import _floors


def transformer_state(total_bytes: int, *, d_model: int = 1024) -> dict[str, Any]:
    """A transformer-like training state of about ``total_bytes``: fp32 weights + Adam moments.

    A third of the bytes are weights, two thirds the two Adam moments, as for fp32 Adam; plus
    step counters and Python metadata, as Lightning/Accelerate checkpoints hold.
    """
    per_layer = 12 * d_model * d_model + 13 * d_model
    layers = max(1, round(total_bytes / 3 / 4 / per_layer))
    g = torch.Generator().manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"layers.{i}."
        shapes = {
            "attn.qkv.weight": (3 * d_model, d_model),
            "attn.qkv.bias": (3 * d_model,),
            "attn.out.weight": (d_model, d_model),
            "attn.out.bias": (d_model,),
            "mlp.up.weight": (4 * d_model, d_model),
            "mlp.up.bias": (4 * d_model,),
            "mlp.down.weight": (d_model, 4 * d_model),
            "mlp.down.bias": (d_model,),
            "ln1.weight": (d_model,),
            "ln1.bias": (d_model,),
            "ln2.weight": (d_model,),
            "ln2.bias": (d_model,),
        }
        for name, shape in shapes.items():
            model[p + name] = torch.randn(shape, generator=g)
    opt_state = {
        i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(t.shape, generator=g),
            "exp_avg_sq": torch.rand(t.shape, generator=g)}
        for i, t in enumerate(model.values())
    }
    return {
        "state_dict": model,
        "optimizer_states": [
            {
                "state": opt_state,
                "param_groups": [
                    {"lr": 1e-4, "betas": (0.9, 0.999), "params": list(range(len(model)))}
                ],
            }
        ],
        "epoch": 3,
        "global_step": 1000,
        "hyper_parameters": {"d_model": d_model, "layers": layers, "name": "bench"},
    }


def state_bytes(state: Any) -> int:
    total = 0
    stack = [state]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def tensors_of(state: Any) -> list[torch.Tensor]:
    out, stack = [], [state]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out


def copy_floor_s(state: Any, repeats: int = 3) -> float:
    """Seconds to copy every tensor once into a preallocated, already-touched buffer (median).

    The same measurement ``stagesave bench`` reports as its copy floor.
    """
    return _floors.copy_floor_s(tensors_of(state), repeats)


def drop_caches() -> bool:
    """Drop the page cache (root only); False if not possible."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_write_floor_s(directory: str, nbytes: int) -> float:
    """Seconds for ``dd`` to write ``nbytes`` with O_DIRECT + fsync (the disk's own speed)."""
    path = os.path.join(directory, "dd-floor.bin")
    bs = 64 * 1024 * 1024
    count = max(1, (nbytes + bs - 1) // bs)
    t0 = time.perf_counter()
    subprocess.run(
        [
            "dd",
            "if=/dev/zero",
            f"of={path}",
            f"bs={bs}",
            f"count={count}",
            "oflag=direct",
            "conv=fsync",
            "status=none",
        ],
        check=True,
    )
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt * nbytes / (count * bs)


def raw_read_floor_s(path: str) -> float:
    """Seconds to read a file with O_DIRECT in 64 MiB requests (cold, the disk's own speed)."""
    size = os.path.getsize(path)
    bs = 64 * 1024 * 1024
    buf = mmap.mmap(-1, bs)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    t0 = time.perf_counter()
    try:
        off = 0
        while off < size:
            n = os.preadv(fd, [buf], off)
            if n <= 0:
                break
            off += n
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def summary(xs: list[float]) -> str:
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:.3f} s (min {min(xs):.3f}, max {max(xs):.3f})"


def mem_available_bytes() -> int:
    """The kernel's estimate of memory available to a new allocation (MemAvailable), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def d_model_for(total_bytes: int) -> int:
    """The widest ``d_model`` (<= 1024) that still gives a state of ``total_bytes`` a few layers."""
    return next((d for d in (1024, 512, 256, 128) if 3 * 4 * 12 * d * d * 3 <= total_bytes), 128)


def spread(xs: list[float]) -> dict[str, float]:
    """Median, min and max of a non-empty list (the form every sweep figure is reported in)."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
