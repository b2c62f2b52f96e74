"""Restore time against the read floor, cold (issue 22's baseline).

Usage: python benchmarks/bench_restore.py --gib 0.5 2 --rounds 3 [--dir /path/on/the/disk]
       python benchmarks/bench_restore.py --gib 2 --map-location cuda   # loads onto a GPU
       python benchmarks/bench_restore.py --gib --shapes s8000 s100k   # bench_shapes's states
       python benchmarks/bench_restore.py --gib 2 --warm   # both files in the page cache

For each size, a transformer-like state (and each of ``--shapes``, the states of
``bench_shapes.py``) is saved twice, by stagesave and by ``torch.save``. Every
measurement runs in a fresh process after the page cache is dropped (root only; otherwise every
figure is warm and the script says so), and ends once every tensor's bytes were touched (a load
with ``mmap`` reads pages only then): each load is reported both when it returned (a load
without ``mmap`` has every byte in memory then) and once every tensor was touched (summed).
Figures are medians over ``--rounds`` (interleaved, the order rotated each round):

* **floors** — the stagesave file's bytes read without parsing: sequentially in 1 MiB ``read``s;
  with O_DIRECT in 64 MiB requests; and with O_DIRECT from ``--threads`` threads in 8 MiB
  and in 64 MiB aligned ranges (a load reads whole 32 MiB chunks; a floor of 8 MiB ranges
  alone was beaten by the load). The **read
  floor** is the fastest of the four, measured in the same run (each reading thread reuses one
  buffer: no fresh memory to fault in, unlike any load);
* ``Checkpointer.load`` with ``verify=True`` (the default) and ``verify=False``;
* ``torch.load(weights_only=True)`` of the ``torch.save`` file, with and without ``mmap``.

``--warm``: nothing is dropped; before every measurement both files are read through the page
cache (a restart right after a save, or a second load of one checkpoint), so the floors read
sequentially come from memory and the O_DIRECT ones from the disk.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import bench_shapes
import common

import stagesave

_CHILD = textwrap.dedent(
    """
    import concurrent.futures as cf, json, mmap, os, sys, threading, time, warnings
    warnings.simplefilter("ignore")
    import torch, stagesave
    variant, ours, theirs, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    where = sys.argv[5] or None  # map_location of every load ("": torch's default)

    def touch(state):
        total, stack = 0.0, [state]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                total += float(x.sum())
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
        return total

    def read_seq(path):
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(1 << 20)
            while f.readinto(buf):
                pass

    def read_direct(path, request, workers):
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            ranges = list(range(0, size, request))
            scratch = threading.local()  # one buffer per thread, faulted in once
            def one(start):
                buf = getattr(scratch, "buf", None)
                if buf is None:
                    buf = scratch.buf = mmap.mmap(-1, request)
                end = min(size, start + request)
                off = start
                while off < end:
                    want = max(4096, (end - off + 4095) // 4096 * 4096)
                    n = os.preadv(fd, [memoryview(buf)[:want]], off)
                    if n <= 0:
                        break
                    off += n
            if workers == 1:
                for s in ranges:
                    one(s)
            else:
                with cf.ThreadPoolExecutor(workers) as ex:
                    list(ex.map(one, ranges))
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    state = None
    if variant == "floor_seq":
        read_seq(ours)
    elif variant == "floor_direct":
        read_direct(ours, 64 << 20, 1)
    elif variant == "floor_parallel":
        read_direct(ours, 8 << 20, threads)
    elif variant == "floor_parallel_large":
        read_direct(ours, 64 << 20, threads)
    elif variant in ("load_verify", "load_noverify"):
        with stagesave.Checkpointer() as ck:
            state = ck.load(ours, verify=variant == "load_verify", map_location=where)
    elif variant == "torch_load":
        state = torch.load(theirs, weights_only=True, map_location=where)
    elif variant == "torch_load_mmap":
        state = torch.load(theirs, weights_only=True, mmap=True, map_location=where)
    loaded = time.perf_counter() - t0
    if state is not None:
        touch(state)
    print(json.dumps({"s": time.perf_counter() - t0, "loaded": loaded}))
    """
)

VARIANTS = [
    "floor_seq",
    "floor_direct",
    "floor_parallel",
    "floor_parallel_large",
    "load_verify",
    "load_noverify",
    "torch_load",
    "torch_load_mmap",
]
LABELS = {
    "floor_seq": "floor: sequential 1 MiB reads",
    "floor_direct": "floor: O_DIRECT 64 MiB, 1 thread",
    "floor_parallel": "floor: O_DIRECT 8 MiB, threads",
    "floor_parallel_large": "floor: O_DIRECT 64 MiB, threads",
    "load_verify": "Checkpointer.load (verify)",
    "load_noverify": "Checkpointer.load(verify=False)",
    "torch_load": "torch.load(weights_only=True)",
    "torch_load_mmap": "torch.load(weights_only=True, mmap)",
}


def _cache(*paths: str) -> None:
    """Read each file through the page cache (``--warm``)."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def run_child(variant: str, ours: str, theirs: str, threads: int, where: str = "",
              busy: bool = False) -> tuple[float, float]:
    """Seconds until the state was returned, and until every tensor's bytes were touched.

    ``busy``: a process spinning on one core runs beside the measurement (see ``--busy``)."""
    spinner = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy
               else None)
    try:
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, variant, ours, theirs, str(threads), where],
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if r.returncode:
        raise RuntimeError(f"{variant} failed:\n{r.stderr}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return float(out["loaded"]), float(out["s"])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", default=None)
    ap.add_argument("--gib", type=float, nargs="*", default=[0.5, 2.0])
    ap.add_argument("--shapes", nargs="*", default=[], choices=list(bench_shapes.SHAPES),
                    help="also these states of bench_shapes.py (many-tensor shapes)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--map-location", default="",
                    help="map_location of every load, e.g. cuda (a GPU resume); default: none")
    ap.add_argument("--busy", action="store_true",
                    help="a process spinning on one core beside every measurement (on this "
                         "project's VM a load that leaves the CPUs idle, verify=False, read "
                         "slower than one that hashes, and faster with a core kept busy)")
    ap.add_argument("--warm", action="store_true",
                    help="both files in the page cache before every measurement (not dropped)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-restore-", dir=args.dir)
    cold = False if args.warm else common.drop_caches()
    results: dict[str, dict[str, list[float]]] = {}
    try:
        builders: list[Callable[[], Any]] = [
            functools.partial(common.transformer_state, int(gib * (1 << 30)),
                              d_model=common.d_model_for(int(gib * (1 << 30))))
            for gib in args.gib
        ] + [bench_shapes.SHAPES[name][1] for name in args.shapes]
        for build in builders:
            state = build()
            ours, theirs = os.path.join(base, "ours.ckpt"), os.path.join(base, "theirs.pt")
            with stagesave.Checkpointer() as ck:
                ck.save(state, ours).result()
            import torch

            torch.save(state, theirs)
            n_tensors = len(common.tensors_of(state))
            del state
            key = f"{os.path.getsize(ours) / (1 << 30):.2f} GiB, {n_tensors} tensors"
            runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
            returned: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for r in range(args.rounds):  # interleaved: every variant once per round,
                # each round starting one variant later (a variant does not always follow the
                # same one: the disk's own cache below the VM may keep some of the last read)
                for variant in VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]:
                    if args.warm:
                        _cache(ours, theirs)
                    else:
                        common.drop_caches()
                    back, touched = run_child(variant, ours, theirs, args.threads,
                                              args.map_location, args.busy)
                    returned[variant].append(back)
                    runs[variant].append(touched)
            results[key] = runs
            results[key + " (returned)"] = returned
            floor = min(statistics.median(runs[v]) for v in VARIANTS if v.startswith("floor"))
            for variant in VARIANTS:
                med, back = statistics.median(runs[variant]), statistics.median(returned[variant])
                print(
                    f"{key:22} {LABELS[variant]:38} returned {back:7.3f} s {back / floor:5.2f}x"
                    f"  touched {med:7.3f} s {med / floor:5.2f}x the read floor",
                    flush=True,
                )
            os.unlink(ours)
            os.unlink(theirs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.warm:
        print("warm: both files were read through the page cache before every measurement")
    elif not cold:
        print("page cache could not be dropped (not root): every figure is warm")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cold": cold, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
