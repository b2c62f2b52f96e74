"""Sharded saves of a real FSDP2 model with Adam, the state taken as a training loop takes it.

Usage:
    python benchmarks/bench_fsdp2_steady.py --layers 1000 --saves 6 [--dir DIR] [--json out.json]

One process in a gloo group of one rank: a stack of ``--layers`` 64×64 ``nn.Linear`` layers, each
and the whole ``fully_shard``-ed (FSDP2), one Adam step; then ``--saves`` saves, each of a
fresh ``get_state_dict(model, optimizer)`` (every parameter and Adam moment a ``DTensor``) through
``stagesave.dcp.save`` with one writer, each finished before the next. Prints each save's blocking
time and the copy floor (every local shard ``copy_``-ed into a warm twin, median of 5). It uses
only public APIs, so it also runs against an older checkout (``PYTHONPATH=<checkout>/src``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

import stagesave.dcp as sdcp

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    dist.init_process_group("gloo", init_method=f"file://{root}/rdzv", rank=0, world_size=1)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    writer = sdcp.StagedStorageWriter(root=root, keep_last=2)
    blocking = []
    for i in range(args.saves):
        model_sd, optim_sd = get_state_dict(model, opt)
        t0 = time.perf_counter()
        handle = sdcp.save({"model": model_sd, "optim": optim_sd, "step": i}, f"s{i}",
                           writer=writer)
        blocking.append(time.perf_counter() - t0)
        handle.result()
    writer.close()
    shards = [v._local_tensor for v in model_sd.values()] + [
        t._local_tensor for s in optim_sd["state"].values() for t in s.values()
        if hasattr(t, "_local_tensor")]
    twins = [t.clone() for t in shards]
    floors = []
    for _ in range(5):
        t0 = time.perf_counter()
        for a, b in zip(twins, shards):
            a.copy_(b)
        floors.append(time.perf_counter() - t0)
    floor = statistics.median(floors)
    steady = statistics.median(blocking[2:]) if len(blocking) > 2 else blocking[-1]
    print(f"{len(shards)} DTensor shards, copy floor {floor * 1e3:.1f} ms; first save "
          f"{blocking[0] * 1e3:.0f} ms, steady (median from the third) {steady * 1e3:.1f} ms "
          f"({steady / floor:.2f}x); every save: {[round(b * 1e3) for b in blocking]} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": len(shards), "floor_s": floor, "blocking_s": blocking}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
