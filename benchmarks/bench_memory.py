"""Peak RSS and its growth across N consecutive saves, stagesave against the alternatives.

Each alternative runs in its own fresh subprocess, so no two share an RSS, an allocator arena or
a page of the state; the child regenerates the same synthetic state (``common.transformer_state``,
seeded) and saves it N times, alternating between two file names (so stagesave may keep two saves
in flight with ``max_pending=2``; two saves to one name are serialized). Between saves the state
is modified in place a little, as training would, so nothing can be reused from the previous save.

How many saves each alternative keeps in flight is its own design:

- stagesave: saves are issued back to back; the pool's back-pressure bounds the buffers to
  ``max_pending`` (the default is 2);
- ``torch.save``: synchronous (plain, no fsync: what Lightning's and Accelerate's default does);
- Lightning ``AsyncCheckpointIO`` and ``dcp.async_save`` (thread): each save is awaited before the
  next one is issued. Neither bounds its queue (Lightning clones the state on the caller for every
  queued save; DCP's default stager copies it every time), so one in flight is their best case.

RSS is read from ``/proc/self/status`` (``VmRSS``) after every save call has returned and the
state has been modified (for the awaited alternatives: after the save finished); the peak is
``VmHWM``, reset through ``/proc/self/clear_refs`` once the state is built, so it is the peak of
the saves alone. The budget is the issue's: state x (1 + buffers in flight) + 300 MiB. "Growth
3→N" leaves out the first saves, during which an alternative with two buffers allocates its
second one.

Usage: python benchmarks/bench_memory.py [--gib 0.5] [--saves 50] [--alternatives a,b] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

MIB = 1 << 20
#: The issue's allowance for the interpreter, torch and the framework on top of the buffers.
BUDGET_SLACK = 300 * MIB

#: name -> buffers (state copies) the alternative may hold in flight.
ALTERNATIVES: dict[str, int] = {
    "stagesave max_pending=2 (default)": 2,
    "stagesave max_pending=1": 1,
    "torch.save": 0,
    "lightning AsyncCheckpointIO": 1,
    "dcp.async_save (thread)": 1,
}


@dataclass
class Result:
    """What one child measured (bytes, seconds)."""

    name: str
    in_flight: int
    state_bytes: int
    rss_before: int
    peak: int
    rss_after: list[int]
    rss_drained: int
    wall_s: float
    blocking_s: list[float]

    @property
    def budget(self) -> int:
        return self.state_bytes * (1 + self.in_flight) + BUDGET_SLACK


# ------------------------------------------------------------------ measuring one's own process
def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss() -> int:
    """Resident set size of this process now, in bytes."""
    return _status_kib("VmRSS")


def peak_rss() -> int:
    """Highest resident set size since start or since the last :func:`reset_peak`, in bytes."""
    return _status_kib("VmHWM")


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0: ``5`` in ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


# ------------------------------------------------------------------ the child
def perturb(state: Any) -> None:
    """Change every tensor of ``state`` a little in place, like an optimizer step would."""
    import common

    for t in common.tensors_of(state):
        if t.is_floating_point() and t.numel():
            flat = t.view(-1)
            flat[: min(flat.numel(), 4096)].add_(1e-3)
    state["global_step"] = int(state["global_step"]) + 1


Save = Callable[[Any, str], Callable[[], bool]]


def make_saver(name: str) -> tuple[Save, bool, Callable[[], None]]:
    """The save function of ``name``, whether each save is awaited before the next, and a closer.

    The save function returns a ``done()`` poll for its save.
    """
    import torch

    if name.startswith("stagesave"):
        import stagesave

        ck = stagesave.Checkpointer(max_pending=ALTERNATIVES[name])

        def save_stagesave(state: Any, path: str) -> Callable[[], bool]:
            done: Callable[[], bool] = ck.save(state, path).done
            return done

        return save_stagesave, False, ck.close
    if name == "torch.save":

        def save_torch(state: Any, path: str) -> Callable[[], bool]:
            torch.save(state, path)
            return lambda: True

        return save_torch, True, lambda: None
    import bench_interference as bi

    if name == "lightning AsyncCheckpointIO":
        start_l = bi.make_lightning_async()
        return (lambda state, path: start_l(state, path)[1]), True, lambda: None
    if name == "dcp.async_save (thread)":
        start_d = bi.make_dcp_async()
        return (lambda state, path: start_d(state, path)[1]), True, lambda: None
    raise ValueError(f"unknown alternative {name!r}; known: {', '.join(ALTERNATIVES)}")


def wait_done(done: Callable[[], bool], timeout: float = 600.0) -> None:
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            raise TimeoutError(f"a save did not finish within {timeout} s")
        time.sleep(0.005)


def run_child(name: str, gib: float, saves: int, directory: str) -> Result:
    """Build the state, save it ``saves`` times and sample RSS; runs in a fresh process."""
    import common

    t_start = time.perf_counter()
    state = common.transformer_state(int(gib * (1 << 30)))
    nbytes = common.state_bytes(state)
    save, awaited, close = make_saver(name)
    paths = [os.path.join(directory, f"mem-{i}.ckpt") for i in range(2)]
    before = rss()
    reset_peak()
    after: list[int] = []
    blocking: list[float] = []
    last_done: Callable[[], bool] = lambda: True
    for i in range(saves):
        t0 = time.perf_counter()
        last_done = save(state, paths[i % 2])
        blocking.append(time.perf_counter() - t0)
        perturb(state)
        if awaited:
            wait_done(last_done)
        after.append(rss())
        if (i + 1) % 10 == 0 or i == 0:
            print(
                f"  [{name}] save {i + 1}/{saves}: RSS {after[-1] / MIB:.0f} MiB, "
                f"peak {peak_rss() / MIB:.0f} MiB, {time.perf_counter() - t_start:.0f} s",
                flush=True,
            )
    wait_done(last_done)
    close()
    drained = rss()
    peak = peak_rss()
    return Result(name, ALTERNATIVES[name], nbytes, before, peak, after, drained,
                  time.perf_counter() - t_start, blocking)


# ------------------------------------------------------------------ the parent
def run_alternative(name: str, args: argparse.Namespace, directory: str) -> Result:
    """Run one alternative in a fresh interpreter and read back its :class:`Result`."""
    out = os.path.join(directory, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--gib", str(args.gib),
           "--saves", str(args.saves), "--dir", directory, "--json", out]
    subprocess.run(cmd, check=True)
    with open(out, encoding="utf-8") as f:
        data = json.load(f)
    os.unlink(out)
    return Result(**data)


def table(results: list[Result]) -> str:
    rows = [
        (
            "| alternative | in flight | state MiB | RSS before 1st save | peak | after save 1 | "
            "after save N | growth 1→N | growth 3→N | drained | budget | peak ≤ budget | median "
            "blocking s | wall s |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        blocking = sorted(r.blocking_s)[len(r.blocking_s) // 2]
        rows.append(
            f"| {r.name} | {r.in_flight} | {r.state_bytes / MIB:.0f} | {r.rss_before / MIB:.0f} | "
            f"{r.peak / MIB:.0f} | {r.rss_after[0] / MIB:.0f} | {r.rss_after[-1] / MIB:.0f} "
            f"| {(r.rss_after[-1] - r.rss_after[0]) / MIB:+.0f} "
            f"| {(r.rss_after[-1] - r.rss_after[min(2, len(r.rss_after) - 1)]) / MIB:+.0f} "
            f"| {r.rss_drained / MIB:.0f} | "
            f"{r.budget / MIB:.0f} | {'pass' if r.peak <= r.budget else 'FAIL'} | {blocking:.3f} | "
            f"{r.wall_s:.0f} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=0.5, help="state size in GiB (default 0.5)")
    ap.add_argument(
        "--saves", type=int, default=50, help="consecutive saves per alternative (default 50)"
    )
    ap.add_argument("--alternatives", default=",".join(ALTERNATIVES), help="comma-separated names")
    ap.add_argument(
        "--dir", default=None, help="directory to write to (default: a temp dir under /work)"
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.child is not None:
        # DCP's single-process/overwrite notes
        warnings.filterwarnings("ignore", category=UserWarning)
        result = run_child(args.child, args.gib, args.saves, args.dir)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(asdict(result), f)
        return
    names = [n for n in args.alternatives.split(",") if n]
    for n in names:
        if n not in ALTERNATIVES:
            ap.error(f"unknown alternative {n!r}; known: {', '.join(ALTERNATIVES)}")
    base = args.dir or tempfile.mkdtemp(
        prefix="stagesave-mem-", dir="/work" if os.path.isdir("/work") else None
    )
    results = []
    try:
        for k, n in enumerate(names, 1):
            d = os.path.join(base, f"alt{k}")
            os.makedirs(d, exist_ok=True)
            print(
                f"[{k}/{len(names)}] {n}: {args.saves} saves of {args.gib} GiB in a fresh process",
                flush=True,
            )
            results.append(run_alternative(n, args, d))
            shutil.rmtree(d, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\n{args.saves} saves of a {args.gib} GiB transformer-like state per alternative; "
          f"MiB; budget = state x (1 + in flight) + 300 MiB\n")
    print(table(results))


if __name__ == "__main__":
    main()
