"""Blocking time of a sharded save (``stagesave.dcp.save``) against the copy floor, by state shape.

Usage:
    python benchmarks/bench_dcp_shapes.py                          # 252, 8,000 and 100,000 tensors
    python benchmarks/bench_dcp_shapes.py --shapes s8000 --saves 7
    python benchmarks/bench_dcp_shapes.py --torch-writer           # also DCP's FileSystemWriter
    python benchmarks/bench_dcp_shapes.py --load                   # and loads of the last folder
    python benchmarks/bench_dcp_shapes.py --first-saves 5          # the median of 5 first saves
    python benchmarks/bench_dcp_shapes.py --buffer-ahead-ab 8      # buffer made ahead or not
    python benchmarks/bench_dcp_shapes.py --process-group          # inside a gloo group
    python benchmarks/bench_dcp_shapes.py --process-group --dtensor  # FSDP2-like DTensor state

One process, the shapes of ``bench_shapes.py``; without a process group by default (DCP plans
for one rank and exchanges nothing), ``--process-group`` saves inside a gloo group of one rank
(DCP then sends its plans, write results and metadata through pickled collectives, as in any
distributed job), ``--dtensor`` makes every tensor of one or more dimensions a ``DTensor``
sharded on that rank's one-device mesh (what FSDP2 and tensor parallelism hand DCP). Per
shape: the **copy floor** (every tensor ``copy_``-ed into its warm twin, median of 5); the
**first** ``dcp.save`` of a new ``StagedStorageWriter``; then the **steady** saves (median of
``--saves`` after 2 warm-ups, each finished before the next, the step counter bumped as a
training loop does). Each save's blocking time is split by the save's telemetry into stagesave's
layout of the rank file (``plan_s``), its staging copy (``stage_s``) and the rest: DCP's own
planning (flattening the state, its local and global plans, ``resolve_data``) and the
coordinator's ``finish()`` (``.metadata``'s pickle). ``--torch-writer`` adds one synchronous
``dcp.save`` with torch's ``FileSystemWriter`` (page cache, no fsync). Ratios are to the floor of
the same run; ``--json`` writes every sample. ``--load`` also times loads (median of 3, page
cache warm, into zeroed tensors of the state's shapes): ``stagesave.dcp.load`` of the last
folder (verified) and ``dcp.load`` with torch's ``FileSystemReader`` of a ``FileSystemWriter``
folder of the same state.

This script uses only the public API, so it also runs against an older checkout
(``PYTHONPATH=<checkout>/src``) for a before/after comparison.
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
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
from bench_shapes import SHAPES, _bump, twin_copy_s

import stagesave
import stagesave.dcp as sdcp

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def one_save(writer: sdcp.StagedStorageWriter, state: Any, folder: str) -> dict[str, float]:
    t0 = time.perf_counter()
    handle = sdcp.save(state, folder, writer=writer)
    blocking = time.perf_counter() - t0
    tel = handle.result(600)
    rest = blocking - tel.plan_s - tel.stage_s - tel.buffer_wait_s
    return {"blocking_s": blocking, "layout_s": tel.plan_s, "stage_s": tel.stage_s,
            "buffer_wait_s": tel.buffer_wait_s, "dcp_and_finish_s": rest}


def _zeros(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _zeros(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_zeros(v) for v in obj]
    return obj


def _load_s(load: Any, state: Any, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        target = _zeros(state)
        t0 = time.perf_counter()
        load(target)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def first_saves(state: Any, root: str, n: int, ahead: bool = True) -> list[dict[str, float]]:
    """``n`` first saves, each by a new Checkpointer and writer (nothing planned, no buffer);
    ``ahead=False``: without the staging buffer made while DCP plans (the A/B switch)."""
    out = []
    for i in range(n):
        d = tempfile.mkdtemp(dir=root)
        try:
            with stagesave.Checkpointer(d, keep_last=1) as ckpt:
                if not ahead:
                    ckpt.plans.prepare = None
                writer = sdcp.StagedStorageWriter(checkpointer=ckpt, commit_timeout=600)
                out.append(one_save(writer, state, f"first-{i}"))
                writer.close()
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return out


def buffer_ahead_ab(state: Any, root: str, rounds: int) -> dict[str, list[float]]:
    """First saves with and without the buffer made ahead, alternated, one process."""
    out: dict[str, list[float]] = {"ahead": [], "not ahead": []}
    for r in range(rounds):
        for ahead in ((True, False) if r % 2 == 0 else (False, True)):
            sample = first_saves(state, root, 1, ahead)[0]
            out["ahead" if ahead else "not ahead"].append(sample["blocking_s"])
    return out


def _process_group(root: str) -> None:
    """A gloo group of this one process (file rendezvous, no port)."""
    import torch.distributed as dist

    rendezvous = tempfile.mkdtemp(dir=root)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}/rdzv", rank=0,
                            world_size=1)


def _dtensors(obj: Any, mesh: Any) -> Any:
    """``obj`` with every tensor of one or more dimensions a ``DTensor`` over it (Shard(0))."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(obj, torch.Tensor):
        return DTensor.from_local(obj, mesh, [Shard(0)]) if obj.dim() else obj
    if isinstance(obj, dict):
        return {k: _dtensors(v, mesh) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_dtensors(v, mesh) for v in obj]
    return obj


def measure(shape: str, saves: int, root: str, torch_writer: bool,
            loads: bool = False, firsts: int = 0, ab_rounds: int = 0,
            dtensor: bool = False) -> dict[str, Any]:
    label, make = SHAPES[shape]
    state = make()
    floor = statistics.median(twin_copy_s(state))  # the same bytes as DTensors' local shards
    if dtensor:
        from torch.distributed.device_mesh import init_device_mesh

        state = _dtensors(state, init_device_mesh("cpu", (1,)))
        label += ", as DTensors"
    out: dict[str, Any] = {"shape": shape, "label": label, "floor_s": floor}
    if ab_rounds:
        out["buffer_ahead_ab"] = buffer_ahead_ab(state, root, ab_rounds)
    if firsts:
        out["first_samples"] = first_saves(state, root, firsts)
    d = tempfile.mkdtemp(dir=root)
    try:
        ckpt = stagesave.Checkpointer(d, keep_last=2)
        writer = sdcp.StagedStorageWriter(checkpointer=ckpt, commit_timeout=600)
        try:
            out["first"] = one_save(writer, state, "step-0")
            if firsts:  # the median of the first saves, this one included
                samples = [*out["first_samples"], out["first"]]
                out["first"] = {k: statistics.median(x[k] for x in samples) for k in samples[0]}
            samples = []
            for step in range(1, saves + 3):
                _bump(state, step)
                sample = one_save(writer, state, f"step-{step}")
                if step > 2:
                    samples.append(sample)
            out["steady_samples"] = samples
            out["steady"] = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            if loads:
                last = os.path.join(d, f"step-{saves + 2}")
                out["load_s"] = _load_s(lambda t: sdcp.load(t, last), state)
        finally:
            writer.close()
            ckpt.close()
        if torch_writer or loads:
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=os.path.join(d, "torch"))
            out["torch_writer_s"] = time.perf_counter() - t0
        if loads:
            plain = os.path.join(d, "torch")
            out["torch_load_s"] = _load_s(lambda t: dcp.load(t, checkpoint_id=plain), state)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f} ms"


def report(r: dict[str, Any]) -> None:
    floor, steady, first = r["floor_s"], r["steady"], r["first"]
    print(f"\n{r['label']}: copy floor {_ms(floor)}")
    for name, row in (("first", first), ("steady", steady)):
        print(f"  {name:6s} blocking {_ms(row['blocking_s'])} ({row['blocking_s'] / floor:.2f}x)"
              f" = layout {_ms(row['layout_s'])} + staging {_ms(row['stage_s'])}"
              f" + buffer wait {_ms(row['buffer_wait_s'])}"
              f" + DCP's planning and finish() {_ms(row['dcp_and_finish_s'])}")
    if "buffer_ahead_ab" in r:
        ab = r["buffer_ahead_ab"]
        print("  first saves, buffer made while DCP plans / not (alternated): "
              + " / ".join(f"{_ms(statistics.median(ab[k]))}" for k in ("ahead", "not ahead")))
    if "torch_writer_s" in r:
        print(f"  dcp.save with FileSystemWriter: {_ms(r['torch_writer_s'])}"
              f" ({r['torch_writer_s'] / floor:.2f}x)")
    if "load_s" in r:
        print(f"  load, warm: stagesave.dcp.load {_ms(r['load_s'])},"
              f" dcp.load with FileSystemReader {_ms(r['torch_load_s'])}"
              f" ({r['load_s'] / r['torch_load_s']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["s252", "s8000", "s100k"],
                    choices=sorted(SHAPES))
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--torch-writer", action="store_true")
    ap.add_argument("--load", action="store_true")
    ap.add_argument("--first-saves", type=int, default=1,
                    help="first saves per shape, each by a new writer (median reported)")
    ap.add_argument("--buffer-ahead-ab", type=int, default=0, metavar="ROUNDS",
                    help="first saves with and without the buffer made while DCP plans, "
                         "alternated, ROUNDS each")
    ap.add_argument("--process-group", action="store_true",
                    help="save inside a gloo process group of one rank")
    ap.add_argument("--dtensor", action="store_true",
                    help="the state's tensors as DTensors on a one-rank mesh (implies "
                         "--process-group)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = args.dir or tempfile.gettempdir()
    if args.process_group or args.dtensor:
        _process_group(root)
    results = []
    for shape in args.shapes:
        r = measure(shape, args.saves, root, args.torch_writer, args.load,
                    args.first_saves - 1, args.buffer_ahead_ab, args.dtensor)
        report(r)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stagesave": os.path.dirname(stagesave.__file__), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
