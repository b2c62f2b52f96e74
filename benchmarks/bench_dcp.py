"""Sharded saves on 1, 2, 4 ranks: stagesave's staged DCP writer vs DCP's own ``async_save``.

Every rank of a real gloo group (processes forked from one launcher) holds its shard of the same
FSDP-like state: DTensors sharded on dim 0 (weights and both Adam moments of a transformer, from
``common.transformer_state``'s shapes) plus replicated step counters. The global state has the
same size for every rank count, so each rank's part shrinks as ranks are added. For each method
and repeat, after a barrier, every rank measures:

- blocking: how long the save call held the caller (what the training loop loses directly);
- done: from the call until the checkpoint is complete and durable as this rank sees it
  (stagesave: the handle's global commit; async_save: its future);

and the launcher reports the median over repeats of the slowest rank's blocking time, each
rank's blocking time, and the aggregate write throughput: bytes of the finished checkpoint
folder / the slowest rank's ``done``. The first save of each method is a warm-up (buffer
allocation, skeleton cache, thread start) and is not counted. Methods alternate within a
repeat so drift in the machine's load hits both alike.

- ``stagesave``: synchronous ``dcp.save`` with ``StagedStorageWriter`` (one per rank, reused);
- ``dcp.async_save``: DCP's own asynchronous save with its default stager and
  ``FileSystemWriter`` (what ``dcp.async_save(state, checkpoint_id=path)`` does);
- ``dcp.save`` (``--with-sync``): DCP's synchronous save, for reference.

Usage: python benchmarks/bench_dcp.py --total-mib 1024 --ranks 1,2,4 --repeats 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, os.path.dirname(__file__))
import common

import stagesave.dcp as sdcp


def shard_state(total_bytes: int, rank: int, world: int) -> tuple[dict[str, Any], int]:
    """This rank's part of an FSDP-like state of ``total_bytes``; and the local tensor bytes."""
    # The widest model that still has a few layers, so small smoke runs stay layer-shaped.
    d_model = next((d for d in (1024, 512, 256, 128) if 3 * 4 * 12 * d * d * 3 <= total_bytes), 128)
    template = common.transformer_state(total_bytes, d_model=d_model)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1000 + rank)
    local_bytes = 0

    def shard(shape: tuple[int, ...]) -> DTensor:
        nonlocal local_bytes
        rows = -(-shape[0] // world)
        lo = min(shape[0], rank * rows)
        hi = min(shape[0], lo + rows)
        local = torch.randn((hi - lo, *shape[1:]), generator=g)
        local_bytes += local.nbytes
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    model = {k: shard(tuple(v.shape)) for k, v in template["state_dict"].items()}
    optim = {
        k: {
            "step": torch.tensor(100.0),
            "exp_avg": shard(tuple(v.shape)),
            "exp_avg_sq": shard(tuple(v.shape)),
        }
        for k, v in template["state_dict"].items()
    }
    return {"model": model, "optim": optim, "epoch": 3}, local_bytes


def folder_bytes(path: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def _run_rank(rank: int, world: int, args: argparse.Namespace, base: str) -> dict[str, Any]:
    state, local_bytes = shard_state(int(args.total_mib * 1024 * 1024), rank, world)
    writer = sdcp.StagedStorageWriter(commit_timeout=3600)

    copies: list[float] = []

    def staged(path: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        handle = sdcp.save(state, path, writer=writer)
        blocking = time.perf_counter() - t0
        tel = handle.result()
        copies.append(tel.plan_s + tel.stage_s)
        return blocking, time.perf_counter() - t0

    def async_save(path: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=path)
        blocking = time.perf_counter() - t0
        fut.result()  # type: ignore[union-attr]
        return blocking, time.perf_counter() - t0

    def sync_save(path: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path)
        dt = time.perf_counter() - t0
        return dt, dt

    methods = {"stagesave": staged, "dcp.async_save": async_save}
    if args.with_sync:
        methods["dcp.save"] = sync_save
    results: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    for rep in range(args.repeats + 1):  # repeat 0 is the warm-up
        for m, fn in methods.items():
            path = os.path.join(base, f"{m}-{rep}")
            dist.barrier()
            blocking, done = fn(path)
            dist.barrier()
            size = folder_bytes(path) if rank == 0 else 0
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            if rep:
                results[m].append({"blocking_s": blocking, "done_s": done, "folder_bytes": size})
    writer.close()
    return {
        "local_bytes": local_bytes,
        "results": results,
        "stagesave_layout_and_copy_s": statistics.median(copies[1:]) if len(copies) > 1 else None,
    }


def _child(rank: int, world: int, args: argparse.Namespace, base: str, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(base, 'rdzv')}", rank=rank, world_size=world
        )
        report = _run_rank(rank, world, args, base)
    except BaseException:  # noqa: BLE001 - reported by the launcher
        report = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    os._exit(0)


def run_world(world: int, args: argparse.Namespace) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix=f"bench-dcp-{world}-", dir=args.dir)
    out = tempfile.mkdtemp(prefix="bench-dcp-out-")
    try:
        ctx = multiprocessing.get_context("fork")
        procs = [ctx.Process(target=_child, args=(r, world, args, base, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        reports = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                rep = json.load(f)
            if "error" in rep:
                raise RuntimeError(f"{world} ranks, rank {r} failed:\n{rep['error']}")
            reports.append(rep)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    summary: dict[str, Any] = {
        "ranks": world,
        "local_mib": [r["local_bytes"] / 2**20 for r in reports],
        "methods": {},
    }
    for m in reports[0]["results"]:
        # one tuple of rank records per repeat
        per_rep = list(zip(*(r["results"][m] for r in reports)))
        slowest_block = [max(x["blocking_s"] for x in rep) for rep in per_rep]
        slowest_done = [max(x["done_s"] for x in rep) for rep in per_rep]
        sizes = [rep[0]["folder_bytes"] for rep in per_rep]
        summary["methods"][m] = {
            "blocking_s_slowest_rank": statistics.median(slowest_block),
            "blocking_s_per_rank": [
                statistics.median(x["blocking_s"] for x in rank_records)
                for rank_records in zip(*per_rep)
            ],
            "done_s": statistics.median(slowest_done),
            "aggregate_mib_s": statistics.median(
                s / d / 2**20 for s, d in zip(sizes, slowest_done)
            ),
            "folder_mib": statistics.median(sizes) / 2**20,
        }
    summary["stagesave_layout_and_copy_s_per_rank"] = [
        r["stagesave_layout_and_copy_s"] for r in reports
    ]
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--total-mib", type=float, default=1024.0, help="size of the global state")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--dir", default=None, help="where checkpoints are written (default: the temp dir)"
    )
    ap.add_argument("--with-sync", action="store_true", help="also time DCP's synchronous dcp.save")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    floor_s = common.raw_write_floor_s(
        args.dir or tempfile.gettempdir(), int(args.total_mib * 2**20)
    )
    floor = args.total_mib / floor_s
    print(
        f"state {args.total_mib:.0f} MiB in total; disk floor (dd, O_DIRECT + fsync) {floor:.0f} "
        f"MiB/s; {os.cpu_count()} CPUs; torch {torch.__version__}"
    )
    rows = []
    for world in (int(x) for x in args.ranks.split(",")):
        s = run_world(world, args)
        rows.append(s)
        print(f"\n{world} rank(s), {s['local_mib'][0]:.0f} MiB per rank")
        print(
            f"{'method':<16}{'blocking (slowest rank)':>25}{'blocking per rank':>30}"
            f"{'done':>9}{'aggregate':>13}"
        )
        for m, r in s["methods"].items():
            per_rank = " ".join(f"{b:.2f}" for b in r["blocking_s_per_rank"])
            print(
                f"{m:<16}{r['blocking_s_slowest_rank']:>23.3f} s{per_rank:>30}{r['done_s']:>7.2f} s"
                f"{r['aggregate_mib_s']:>8.0f} MiB/s"
            )
        copy = " ".join(f"{c:.3f}" for c in s["stagesave_layout_and_copy_s_per_rank"])
        print(
            f"  stagesave's own share of its blocking time (layout + staging copy) per rank: "
            f"{copy} s;"
            " the rest is DCP's planning and its exchanges of plans and results"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "total_mib": args.total_mib,
                    "disk_floor_mib_s": floor,
                    "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "repeats": args.repeats,
                    "worlds": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
