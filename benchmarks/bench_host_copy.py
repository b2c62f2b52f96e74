"""Copying many tensors into one page-aligned buffer: the ways staging could do it, side by side.

Usage:
    python benchmarks/bench_host_copy.py

For 200 × 256 KiB, 8,000 × 64 KiB, 252 × 1.6 MB and 100,000 × 2.5 KiB tensors (each slot of
the buffer 4 KiB-aligned as in a file image), the best of 7 rounds of: ``copy_`` into warm
twins (bench_shapes' copy floor), memoryview slice assignment per tensor (what a steady plan
does for small tensors), ``torch`` ``copy_`` into byte views of the buffer, ``ctypes.memmove``
per tensor on one thread, and the same split over two threads (what staging does for tensors
of 64 KiB or more: ``src/stagesave/saving/host_copy.py``).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import gc
import mmap
import time
from collections.abc import Callable

import torch

CASES = ((200, 256 << 10), (8000, 64 << 10), (252, 1_600_000), (100_000, 2560))


def best_of(f: Callable[[], None], rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(n: int, size: int, pool: cf.Executor) -> list[float]:
    """Seconds of each way of copying ``n`` tensors of ``size`` bytes (best of 7)."""
    step = (size + 4096 + 4095) // 4096 * 4096
    tensors = [torch.randn(size // 4) for _ in range(n)]
    twins = [torch.empty(size // 4) for _ in range(n)]
    mem = mmap.mmap(-1, n * step)
    view = memoryview(mem)
    flat = torch.frombuffer(mem, dtype=torch.uint8)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    sources = [memoryview((ctypes.c_char * size).from_address(t.data_ptr())).cast("B")
               for t in tensors]
    dsts = [flat[i * step : i * step + size] for i in range(n)]
    bytes_of = [t.view(torch.uint8) for t in tensors]
    moves = [(base + i * step, t.data_ptr()) for i, t in enumerate(tensors)]
    move = ctypes.memmove

    def twins_copy() -> None:
        for a, b in zip(twins, tensors):
            a.copy_(b)

    def by_view() -> None:
        for i, src in enumerate(sources):
            view[i * step : i * step + size] = src

    def torch_views() -> None:
        for d, s in zip(dsts, bytes_of):
            d.copy_(s)

    def memmoves(part: list[tuple[int, int]]) -> None:
        for d, s in part:
            move(d, s, size)

    def one_thread() -> None:
        memmoves(moves)

    def two_threads() -> None:
        half = len(moves) // 2
        other = pool.submit(memmoves, moves[:half])
        memmoves(moves[half:])
        other.result()

    return [best_of(f) for f in (twins_copy, by_view, torch_views, one_thread, two_threads)]


def main() -> None:
    gc.disable()
    pool = cf.ThreadPoolExecutor(1)
    print(f"{'tensors':>8} {'bytes each':>10} {'copy_ twins':>11} {'memoryview':>11} "
          f"{'torch views':>11} {'memmove x1':>11} {'memmove x2':>11}")
    for n, size in CASES:
        times = measure(n, size, pool)
        print(f"{n:>8} {size:>10} " + " ".join(f"{t * 1e3:>9.2f}ms" for t in times), flush=True)
    pool.shutdown()


if __name__ == "__main__":
    main()
