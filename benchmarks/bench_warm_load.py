"""A load of a checkpoint whose pages are in the page cache: read through it, or from the disk.

Usage:
    python benchmarks/bench_warm_load.py --gib 2 --rounds 4
    python benchmarks/bench_warm_load.py --gib 2 --rounds 4 --throttle-mbps 400   # a slower disk

A transformer-like state is saved once; before every measurement the file is read through the
page cache (a restart right after a save, a second load of the same checkpoint). Each load runs in
a fresh process, alternating two read policies, verified and not:

* **cache** (stagesave's): a chunk whose pages the page cache holds is read through it, the
  others with ``O_DIRECT`` (``stagesave.restore.residency``);
* **direct** (before it): every chunk with ``O_DIRECT``, from the disk.

``--throttle-mbps`` runs the loads in a cgroup (v1 ``blkio``, root only) whose reads of the
file's block device are limited to that many MB/s: a disk slower than this VM's, whose virtual
disk is served from its host's memory (about as fast as this guest's page-cache copies).
Figures are medians over ``--rounds`` (the order of the policies alternated each round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import common

import stagesave

_CHILD = r"""
import sys, time, stagesave
import stagesave.restore.image_load as il
if sys.argv[2] == "direct":  # the policy before: O_DIRECT for every chunk
    il.direct_for = lambda direct, cached, lo, n: direct
t0 = time.perf_counter()
stagesave.load(sys.argv[1], verify=sys.argv[3] == "1")
print(time.perf_counter() - t0)
"""
_CGROUP = "/sys/fs/cgroup/blkio/stagesave-bench"


def _cache(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def _throttle(path: str, mbps: int) -> str:
    """A blkio cgroup limiting reads of ``path``'s device to ``mbps`` MB/s; its procs file."""
    dev = os.stat(path).st_dev
    os.makedirs(_CGROUP, exist_ok=True)
    with open(os.path.join(_CGROUP, "blkio.throttle.read_bps_device"), "w") as f:
        f.write(f"{os.major(dev)}:{os.minor(dev)} {mbps * 1_000_000}")
    return os.path.join(_CGROUP, "cgroup.procs")


def _load_s(path: str, policy: str, verify: bool, procs: str | None) -> float:
    join = f"echo $$ > {procs}; " if procs else ""
    out = subprocess.run(
        ["bash", "-c", f'{join}exec "$0" -c "$1" "$2" "$3" "$4"', sys.executable, _CHILD,
         path, policy, "1" if verify else "0"],
        capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--throttle-mbps", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "state.ckpt")
        size = int(args.gib * (1 << 30))
        with stagesave.Checkpointer() as ck:
            ck.save(common.transformer_state(size, d_model=common.d_model_for(size)),
                    path).result()
        procs = _throttle(path, args.throttle_mbps) if args.throttle_mbps else None
        samples: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for policy in (("cache", "direct") if r % 2 == 0 else ("direct", "cache")):
                for verify in (True, False):
                    _cache(path)
                    key = f"{policy}, verify={verify}"
                    samples.setdefault(key, []).append(_load_s(path, policy, verify, procs))
        gib = os.path.getsize(path) / (1 << 30)
    disk = f"reads limited to {args.throttle_mbps} MB/s" if args.throttle_mbps else "this disk"
    print(f"{gib:.2f} GiB, page cache warm, {disk}:")
    for key, values in sorted(samples.items()):
        print(f"  {key:22} median {statistics.median(values):7.3f} s   "
              + " ".join(f"{v:.3f}" for v in values))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gib": gib, "throttle_mbps": args.throttle_mbps, "samples": samples},
                      f, indent=1)


if __name__ == "__main__":
    main()
