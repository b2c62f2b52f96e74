"""Training time lost per save: blocking + throughput lost while the background write runs.

A CPU-bound training loop (an MLP, forward + backward + SGD, torch's default threads) runs
continuously; every alternative saves the same synthetic transformer-like state from inside the
loop, and we measure, side by side in one process:

- blocking: how long the save call held the loop;
- lost: blocking + sum over the steps that ran while the background write was in flight of
  (step time - baseline step time), i.e. the training time the save cost;
- p99 step time during the background write, relative to the baseline;
- the loop's own baseline ms/iteration, re-measured before every save (a regime change of the
  OpenMP threads after a save, e.g. because a background thread ran torch ops, shows up there).

Usage: python benchmarks/bench_interference.py --gib 2 --repeats 3 [--alternatives a,b,...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402, RUF100 - after the sys.path insertion

import stagesave  # noqa: E402, RUF100 - after the sys.path insertion

Starter = Callable[[Any, str], tuple[float, Callable[[], bool]]]


class Loop:
    """One training step of a small MLP: about 20-60 ms on two cores."""

    def __init__(self, hidden: int = 1536, batch: int = 256) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden),
            torch.nn.GELU(), torch.nn.Linear(hidden, hidden),
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, hidden)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.model(self.x).square().mean().backward()
        self.opt.step()
        return time.perf_counter() - t0

    def baseline(self, seconds: float = 2.0) -> float:
        times = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            times.append(self.step())
        return statistics.median(times)


def start_torch_save(state: Any, path: str) -> tuple[float, Callable[[], bool]]:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0, lambda: True


def make_lightning_async() -> Starter:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    plugin = AsyncCheckpointIO(TorchCheckpointIO())

    def start(state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        t0 = time.perf_counter()
        plugin.save_checkpoint(state, path)
        blocking = time.perf_counter() - t0
        assert plugin._executor is not None
        sentinel = plugin._executor.submit(lambda: None)  # FIFO, one worker: done after the save
        return blocking, sentinel.done

    return start


def make_dcp_async() -> Starter:
    import torch.distributed.checkpoint as dcp

    def start(state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=path + ".dcp")
        return time.perf_counter() - t0, fut.done

    return start


def make_stagesave(**options: Any) -> Starter:
    ck = stagesave.Checkpointer(max_pending=1, **options)

    def start(state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        t0 = time.perf_counter()
        h = ck.save(state, path)
        return time.perf_counter() - t0, h.done

    start.close = ck.close  # type: ignore[attr-defined]
    return start


ALTERNATIVES: dict[str, Callable[[], Starter]] = {
    "torch.save+fsync (sync)": lambda: start_torch_save,
    "lightning AsyncCheckpointIO": make_lightning_async,
    "dcp.async_save (thread)": make_dcp_async,
    "stagesave checksum_in=background": lambda: make_stagesave(checksum_in="background"),
    # the default checksum placement on CPU
    "stagesave checksum_in=staging": lambda: make_stagesave(checksum_in="staging"),
    # a writer agent process writes, commits and retires each save (issue 21; the default)
    "stagesave writer=process": lambda: make_stagesave(writer="process"),
    # this process's threads write (the default before issue 21)
    "stagesave writer=thread": lambda: make_stagesave(writer="thread"),
    # the thread writer hashing in its writers (background CRCs in this process)
    "stagesave writer=thread checksum_in=background": lambda: make_stagesave(
        writer="thread", checksum_in="background"),
}


def measure(loop: Loop, start: Starter, state: Any, path: str, baseline: float) -> dict[str, float]:
    blocking, done = start(state, path)
    t_window = time.perf_counter()
    steps: list[float] = []
    while not done():
        steps.append(loop.step())
        if time.perf_counter() - t_window > 300:
            raise TimeoutError("background save did not finish in 300 s")
    window = time.perf_counter() - t_window
    lost = blocking + max(0.0, window - len(steps) * baseline) if steps else blocking + window
    p99 = (sorted(steps)[max(0, int(len(steps) * 0.99) - 1)] / baseline) if steps else 1.0
    mean = (statistics.mean(steps) / baseline) if steps else 1.0
    return {"blocking": blocking, "window": window, "lost": lost, "p99x": p99, "meanx": mean}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--alternatives", default=",".join(ALTERNATIVES))
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(
        prefix="stagesave-interf-", dir="/work" if os.path.isdir("/work") else None
    )
    state = common.transformer_state(int(args.gib * (1 << 30)))
    nbytes = common.state_bytes(state)
    floor = common.copy_floor_s(state)
    loop = Loop()
    names = [n for n in args.alternatives.split(",") if n]
    print(
        f"state {nbytes / 2**30:.2f} GiB; copy floor {floor:.3f} s; torch threads "
        f"{torch.get_num_threads()}"
    )
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    baselines: dict[str, list[float]] = {n: [] for n in names}
    starters = {n: ALTERNATIVES[n]() for n in names}
    for r in range(args.repeats):
        for n in names:  # interleaved, so drift of the machine hits every alternative alike
            path = os.path.join(base, f"{n.split()[0].replace('.', '_')}-{r}.ckpt")
            b = loop.baseline()
            baselines[n].append(b)
            results[n].append(measure(loop, starters[n], state, path, b))
            # let writeback and threads settle, then clean up
            time.sleep(1.0)
            for p in (path, path + ".dcp"):
                if os.path.isdir(p):
                    shutil.rmtree(p)
                elif os.path.exists(p):
                    os.unlink(p)
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    for s in starters.values():
        if hasattr(s, "close"):
            s.close()
    print(
        "\n| alternative | loop baseline ms/it | blocking s | lost per save s | lost / copy floor "
        "| mean step x | p99 step x |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in names:
        med = {k: statistics.median([x[k] for x in results[n]]) for k in results[n][0]}
        print(
            f"| {n} | {statistics.median(baselines[n]) * 1e3:.1f} | {med['blocking']:.3f} | "
            f"{med['lost']:.3f} | {med['lost'] / floor:.2f} | {med['meanx']:.2f} | "
            f"{med['p99x']:.2f} |"
        )
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
