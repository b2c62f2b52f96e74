"""A cold load with its pickle unpickled while the storages are still read, against after them;
or (``--switch index``) with its tensor index checked by msgspec, against by the Python parser.

    python benchmarks/bench_early_unpickle.py --shapes s8000 s100k --rounds 6 --dir /work
    python benchmarks/bench_early_unpickle.py --shapes s8000 s100k --dir /work --throttle-mbps 400
    python benchmarks/bench_early_unpickle.py --switch index --shapes s8000 s100k --dir /work

Each shape of ``bench_shapes`` is saved once; every load then runs in a fresh process after the
page cache was dropped, alternating (order flipped each round) the load as it is (**beside**:
the C unpickler's first try runs once the pickle's chunks are read and checked) and the load
with that step turned off in the child (**after**: the whole unpickling once every chunk is in,
as before 2026-12-06), verified and not. ``--throttle-mbps`` limits the reads of the file's
device with a ``blkio`` cgroup (root only): storage slower than this VM's memory-backed disk,
where the reads leave the cores idle. Figures are medians (and each sample) in seconds.

``--switch index``: the two ways are **compiled** (the load as it is: a large tensor index
checked by :mod:`stagesave.ondisk.index_check_fast`) and **python** (checked by
``parse_index``, as before 2026-12-07), the same protocol; ``--warm`` skips dropping the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import bench_shapes
from bench_warm_load import _throttle

import stagesave

_CHILD = r"""
import sys, time, stagesave
from stagesave.restore import load
if sys.argv[2] == "after":
    load._Early.__call__ = lambda self, image: None
if sys.argv[2] == "python":
    from stagesave.ondisk.parse import parse_index
    from stagesave.restore import index_check
    index_check.check_index = parse_index
with stagesave.Checkpointer(writer="thread") as ck:
    t = time.perf_counter()
    state = ck.load(sys.argv[1], verify=sys.argv[3] == "1")
    print(time.perf_counter() - t)
"""


_WAYS = {"early": ("beside", "after"), "index": ("compiled", "python")}


def _cold_load_s(path: str, way: str, verify: bool, procs: str | None, warm: bool = False,
                 ) -> float:
    if not warm:
        os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
    join = f"echo $$ > {procs}; " if procs else ""
    cmd = f"{join}exec {sys.executable} -c '{_CHILD}' {path} {way} {int(verify)}"
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["s8000", "s100k"],
                    choices=list(bench_shapes.SHAPES))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--throttle-mbps", type=int, default=0)
    ap.add_argument("--switch", choices=list(_WAYS), default="early")
    ap.add_argument("--warm", action="store_true", help="the page cache not dropped")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    one, other = _WAYS[args.switch]
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for shape in args.shapes:
            label, make = bench_shapes.SHAPES[shape]
            path = os.path.join(d, f"{shape}.ckpt")
            with stagesave.Checkpointer(writer="thread") as ck:
                ck.save(make(), path).result()
            procs = _throttle(path, args.throttle_mbps) if args.throttle_mbps else None
            samples: dict[str, list[float]] = {}
            for r in range(args.rounds):
                for way in ((one, other) if r % 2 == 0 else (other, one)):
                    for verify in (True, False):
                        key = f"{way}, verify={verify}"
                        samples.setdefault(key, []).append(
                            _cold_load_s(path, way, verify, procs, args.warm))
            results[label] = samples
            disk = (f"reads limited to {args.throttle_mbps} MB/s" if args.throttle_mbps
                    else "this disk")
            print(f"{label}, {'warm' if args.warm else 'cold'}, {disk}:")
            for key, values in sorted(samples.items()):
                print(f"  {key:22} median {statistics.median(values):7.3f} s   "
                      + " ".join(f"{v:.3f}" for v in values))
            os.remove(path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"throttle_mbps": args.throttle_mbps, "switch": args.switch,
                       "warm": args.warm, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
