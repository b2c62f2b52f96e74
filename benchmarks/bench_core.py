"""Core benchmark: save blocking, time to commit and load, side by side with torch.save/load.

Usage: python benchmarks/bench_core.py --dir /path/on/the/disk --gib 2 --repeats 3

Everything runs in one process on the same state and disk, so the ratios are comparable even on
a noisy machine. Run as root to drop the page cache before cold loads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402, RUF100 - after the sys.path insertion

import stagesave  # noqa: E402, RUF100 - after the sys.path insertion


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--dir",
        default=None,
        help="directory on the disk to test (default: a temp dir under /work)",
    )
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(
        prefix="stagesave-bench-", dir="/work" if os.path.isdir("/work") else None
    )
    os.makedirs(base, exist_ok=True)
    state = common.transformer_state(int(args.gib * (1 << 30)))
    nbytes = common.state_bytes(state)
    print(
        f"state: {nbytes / 2**30:.2f} GiB in {len(common.tensors_of(state))} tensors; torch "
        f"threads {torch.get_num_threads()}"
    )
    res: dict[str, list[float]] = {
        k: []
        for k in (
            "copy_floor",
            "dd_direct_floor",
            "torch_save",
            "torch_save_fsync",
            "ss_blocking",
            "ss_commit",
            "raw_read_floor_cold",
            "torch_load_cold",
            "ss_load_verified_cold",
            "ss_load_verified_copy_cold",
            "ss_load_unverified_cold",
            "safetensors_load_cold",
            "torch_load_warm",
            "ss_load_verified_warm",
        )
    }
    ck = stagesave.Checkpointer(base, max_pending=1)
    from safetensors.torch import load_file, save_file

    flat = {f"t{i}": t for i, t in enumerate(common.tensors_of(state))}
    st_path = os.path.join(base, "ref.safetensors")
    save_file(flat, st_path)
    ck.save(state, "warmup.ckpt").result()  # allocate the buffer once, as in training
    for r in range(args.repeats):
        res["copy_floor"].append(common.copy_floor_s(state, repeats=1))
        res["dd_direct_floor"].append(common.raw_write_floor_s(base, nbytes))
        p = os.path.join(base, "torch.ckpt")
        dt, _ = common.timed(lambda p=p: torch.save(state, p))
        res["torch_save"].append(dt)
        t0 = time.perf_counter()
        fsync_path(p)
        res["torch_save_fsync"].append(dt + time.perf_counter() - t0)
        h = ck.save(state, "ss.ckpt")
        tel = h.result()
        res["ss_blocking"].append(tel.blocking_s)
        res["ss_commit"].append(tel.time_to_commit_s)
        ss_path = os.path.join(base, "ss.ckpt")
        cold = common.drop_caches()
        res["raw_read_floor_cold"].append(common.raw_read_floor_s(ss_path))
        for key, fn in (
            ("torch_load_cold", lambda p=p: torch.load(p, weights_only=True)),
            ("ss_load_verified_cold", lambda: ck.load("ss.ckpt")),
            ("ss_load_verified_copy_cold", lambda: ck.load("ss.ckpt", mmap=False)),
            ("ss_load_unverified_cold", lambda: ck.load("ss.ckpt", verify=False, mmap=False)),
            ("safetensors_load_cold", lambda: load_file(st_path)),
        ):
            common.drop_caches()
            dt, out = common.timed(fn)
            if key.startswith("ss_load_verified"):
                # touch every tensor so lazily mapped pages count too
                dt2, _ = common.timed(
                    lambda out=out: [float(t.reshape(-1)[-1]) for t in common.tensors_of(out)]
                )
                dt += dt2
            res[key].append(dt)
            del out
            gc.collect()
        dt, out = common.timed(lambda p=p: torch.load(p, weights_only=True))
        res["torch_load_warm"].append(dt)
        del out
        dt, out = common.timed(lambda: ck.load("ss.ckpt"))
        res["ss_load_verified_warm"].append(dt)
        del out
        gc.collect()
        print(f"repeat {r + 1}/{args.repeats} done (cold cache: {cold})", flush=True)
    ck.close()
    med = {k: statistics.median(v) for k, v in res.items() if v}
    print("\n| measure | median | min | max |\n|---|---|---|---|")
    for k, v in res.items():
        if v:
            print(f"| {k} | {statistics.median(v):.3f} s | {min(v):.3f} | {max(v):.3f} |")
    ratios = {
        "blocking / copy floor": med["ss_blocking"] / med["copy_floor"],
        "blocking vs torch.save (x faster)": med["torch_save"] / med["ss_blocking"],
        "commit / dd O_DIRECT floor": med["ss_commit"] / med["dd_direct_floor"],
        "commit vs torch.save+fsync (x faster)": med["torch_save_fsync"] / med["ss_commit"],
        "verified load (mmap) vs torch.load cold (x faster)": med["torch_load_cold"]
        / med["ss_load_verified_cold"],
        "verified load (mmap) / safetensors cold": med["ss_load_verified_cold"]
        / med["safetensors_load_cold"],
        "verified load (copy) / safetensors cold": med["ss_load_verified_copy_cold"]
        / med["safetensors_load_cold"],
        "verified load (mmap) / raw read floor cold": med["ss_load_verified_cold"]
        / med["raw_read_floor_cold"],
    }
    print("\n| ratio | value |\n|---|---|")
    for k, v in ratios.items():
        print(f"| {k} | {v:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "results": res, "ratios": ratios}, f, indent=1)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
