"""Does a background thread change the speed of torch's OpenMP threads? Claim under test:

  "Running any torch op in a background thread, or a gloo collective, silently switches libgomp
  into passive waiting and halves training speed for as long as that thread lives."

Each scenario runs in its own fresh process (so one scenario cannot leave the next one in a
changed regime) with the training loop of ``bench_interference`` (``Loop``, torch's default
threads). The loop's median ms/iteration is measured three times: initially; while the
background thread is alive but idle after it did its one piece of work (it waits on an event, so
it uses no CPU); and after that thread has exited. Scenarios:

- ``control``: no thread at all (the noise between three measurements);
- ``torch op (tiny)``: the thread ran ``torch.ones(8).add_(1)`` (too small to open a parallel
region);
- ``torch op (parallel)``: the thread ran one elementwise op on 4 Mi floats (an OpenMP region);
- ``torch op (parallel) + OMP_WAIT_POLICY=active``: the same, with libgomp told to spin;
- ``numpy/bytes + xxhash``: the thread copied 256 MiB with numpy and as bytes and hashed it with
  xxh3 (what stagesave's threads do: memmove, syscalls, hashing);
- ``gloo collective``: a world-size-1 gloo group is initialized on the main thread (the "alive"
  column is measured after that too, in its own row), then a thread runs one ``all_reduce``;
- ``stagesave``: "alive" is after 3 saves of a 128 MiB state (its job and I/O threads alive and
  idle), "after" after ``Checkpointer.close()`` (threads joined).

Usage: python benchmarks/bench_omp.py [--seconds 3] [--scenarios a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

SCENARIOS = [
    "control",
    "torch op (tiny)",
    "torch op (parallel)",
    "torch op (parallel) + OMP_WAIT_POLICY=active",
    "numpy/bytes + xxhash",
    "gloo group initialized (main thread)",
    "gloo collective (thread)",
    "stagesave",
]


class IdleThread:
    """A thread that runs ``work`` once, then waits (alive, using no CPU) until :meth:`stop`."""

    def __init__(self, work: Callable[[], object]) -> None:
        self._stop = threading.Event()
        self._did = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - reported by the parent
                self.error = exc
            self._did.set()
            self._stop.wait()

        self._thread = threading.Thread(target=run, name="bench-omp-bg", daemon=True)
        self._thread.start()
        self._did.wait()
        if self.error is not None:
            raise RuntimeError(f"the background work failed: {self.error!r}") from self.error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def numpy_bytes_xxhash() -> None:
    """256 MiB through numpy, bytes copies and xxh3: no torch call."""
    import numpy as np
    import xxhash

    src = np.random.default_rng(0).integers(0, 255, size=256 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    b = dst.tobytes()
    xxhash.xxh3_128_hexdigest(b)


def gloo_group() -> None:
    import torch.distributed as dist

    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def openmp_runtimes() -> list[str]:
    """The OpenMP runtime libraries mapped into this process (libgomp, libiomp, libomp)."""
    found = set()
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        for line in f:
            path = line.split()[-1]
            name = os.path.basename(path)
            if name.startswith(("libgomp", "libiomp", "libomp")):
                found.add(name)
    return sorted(found)


def run_child(scenario: str, seconds: float) -> dict[str, float | str]:
    """Measure ``scenario`` in this (fresh) process: initial, alive, after ms/it."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_interference as bi
    import torch

    loop = bi.Loop()
    loop.baseline(1.0)  # warm-up: allocator, OpenMP team
    initial = loop.baseline(seconds)
    after_fn: Callable[[], None]
    if scenario == "control":
        after_fn = lambda: None
    elif scenario == "torch op (tiny)":
        after_fn = IdleThread(lambda: torch.ones(8).add_(1)).stop
    elif scenario.startswith("torch op (parallel)"):
        after_fn = IdleThread(lambda: torch.ones(1 << 22).add_(1)).stop
    elif scenario == "numpy/bytes + xxhash":
        after_fn = IdleThread(numpy_bytes_xxhash).stop
    elif scenario == "gloo group initialized (main thread)":
        import torch.distributed as dist

        gloo_group()
        after_fn = dist.destroy_process_group
    elif scenario == "gloo collective (thread)":
        import torch.distributed as dist

        gloo_group()
        t = torch.ones(8)
        th = IdleThread(lambda: dist.all_reduce(t))

        def after_gloo() -> None:
            th.stop()

        after_fn = after_gloo
    elif scenario == "stagesave":
        import common

        import stagesave

        state = common.transformer_state(128 << 20, d_model=512)
        ck = stagesave.Checkpointer(max_pending=1)
        with tempfile.TemporaryDirectory(
            prefix="stagesave-omp-", dir="/work" if os.path.isdir("/work") else None
        ) as d:
            for i in range(3):
                ck.save(state, os.path.join(d, f"s{i}.ckpt")).result()
            alive = loop.baseline(seconds)
            ck.close()
        after = loop.baseline(seconds)
        return {"scenario": scenario, "initial": initial, "alive": alive, "after": after}
    else:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    alive = loop.baseline(seconds)
    after_fn()
    after = loop.baseline(seconds)
    return {"scenario": scenario, "initial": initial, "alive": alive, "after": after}


def run_scenario(scenario: str, seconds: float) -> dict[str, float | str]:
    env = dict(os.environ)
    if scenario.endswith("OMP_WAIT_POLICY=active"):
        env["OMP_WAIT_POLICY"] = "active"
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", scenario, "--seconds", str(seconds)],
        check=True,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    row: dict[str, float | str] = json.loads(out.strip().splitlines()[-1])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--seconds", type=float, default=3.0, help="seconds per loop measurement (default 3)"
    )
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated names")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(run_child(args.child, args.seconds)))
        return
    names = [n for n in args.scenarios.split(",") if n]
    for n in names:
        if n not in SCENARIOS:
            ap.error(f"unknown scenario {n!r}; known: {', '.join(SCENARIOS)}")
    import torch

    backend = torch.__config__.parallel_info().strip().splitlines()[-1]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
        f"{backend}; OpenMP runtimes loaded: {', '.join(openmp_runtimes()) or 'none'}",
        flush=True,
    )
    rows = []
    for k, n in enumerate(names, 1):
        print(f"[{k}/{len(names)}] {n}", flush=True)
        rows.append(run_scenario(n, args.seconds))
    print(
        f"\nloop ms/it (median over {args.seconds:g} s), each scenario in a fresh process; "
        "ratio = ms/it / initial\n"
    )
    print(
        "| background | initial ms/it | thread alive (idle) ms/it | ratio | thread exited ms/it | "
        "ratio |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        i, a, e = float(r["initial"]), float(r["alive"]), float(r["after"])
        print(
            f"| {r['scenario']} | {i * 1e3:.1f} | {a * 1e3:.1f} | {a / i:.2f} | {e * 1e3:.1f} "
            f"| {e / i:.2f} |"
        )


if __name__ == "__main__":
    main()
