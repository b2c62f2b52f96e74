"""Restore from S3: stagesave's load against one stream and against ``torch.load`` over s3fs.

Usage::

    python benchmarks/bench_s3_restore.py --size-mib 1024 --rounds 3

Against the loopback SeaweedFS server that ``scripts/s3server.sh start`` announced through
``STAGESAVE_S3_*`` (else one started here), the same training-like state (fp32 weights + Adam
moments, ``benchmarks/common.py``) is saved once by stagesave and once by ``torch.save`` (then
uploaded with ``s3fs.pipe``). Each round then reads, in a rotating order, each measurement
ending once every tensor's bytes were summed:

- ``one stream``: the stagesave object's bytes in one GET, read into one buffer (no parsing);
- ``ranged GETs``: the same bytes by ``S3Store.read_into`` (concurrent ranged GETs of one
  object version, no parsing, no hashing): the floor of stagesave's own reads;
- ``load (verify)`` / ``load(verify=False)``: ``Checkpointer(s3://...).load(name)``;
- ``torch.load via s3fs``: ``torch.load(fs.open(url, "rb"), weights_only=True)`` of the
  ``torch.save`` object (s3fs's buffered file), what users write today.

The server keeps the objects in its page cache: on loopback every figure is bounded by the
server's and the client's CPU (2 vCPUs here), not by a network: the table's last column is the
CPU seconds the client process and the server used per second of each read (2.0 = both cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from bench_s3 import _bucket, _cpu, _server
from common import tensors_of, transformer_state

import stagesave
from stagesave.stores.s3 import S3Store


def _server_cpu(pid: int | None) -> float:
    """The server's CPU seconds so far (NaN when it was started by someone else, pid unknown)."""
    return _cpu(pid) if pid else float("nan")


def _touch(state: Any) -> float:
    return float(sum(float(t.sum()) for t in tensors_of(state)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mib", type=int, default=1024, help="state size (default ~1 GiB)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="also write the raw results here")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")

    server, stop = _server()
    try:
        import s3fs

        client, bucket, options = _bucket(server, "stagesave-restore")
        state = transformer_state(args.size_mib << 20)
        want = _touch(state)
        root = f"s3://{bucket}/run"
        with stagesave.Checkpointer(root, storage_options=options, writer="thread") as ckpt:
            ckpt.save(state, "ours.ckpt").result()
        fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        import io

        buf = io.BytesIO()
        torch.save(state, buf)
        fs.pipe(f"{bucket}/theirs.pt", buf.getvalue())
        del buf, state
        size = fs.info(f"{bucket}/run/ours.ckpt")["size"]
        print(f"objects: ours {size / 2**20:.0f} MiB; server {server.endpoint}", file=sys.stderr)

        def one_stream() -> float:
            out = memoryview(bytearray(size))
            body = client.get_object(Bucket=bucket, Key="run/ours.ckpt")["Body"]
            pos = 0
            for chunk in body.iter_chunks(8 << 20):
                out[pos : pos + len(chunk)] = chunk
                pos += len(chunk)
            assert pos == size
            return float(pos)

        def ranged() -> float:
            store = S3Store(root, options)
            try:
                out = memoryview(bytearray(size))
                assert store.read_into("ours.ckpt", 0, out) == size
            finally:
                store.close()
            return float(size)

        def load(verify: bool) -> Callable[[], float]:
            def run() -> float:
                with stagesave.Checkpointer(root, storage_options=options) as ck:
                    return _touch(ck.load("ours.ckpt", verify=verify))
            return run

        def torch_s3fs() -> float:
            f = s3fs.S3FileSystem(**options, skip_instance_cache=True)
            with f.open(f"{bucket}/theirs.pt", "rb") as fh:
                return _touch(torch.load(fh, weights_only=True))

        methods: dict[str, Callable[[], float]] = {
            "one stream": one_stream, "ranged GETs": ranged, "load (verify)": load(True),
            "load(verify=False)": load(False), "torch.load via s3fs": torch_s3fs,
        }
        names = list(methods)
        results: dict[str, list[float]] = {n: [] for n in names}
        busy: dict[str, list[float]] = {n: [] for n in names}  # CPU seconds (client + server) / s
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                c0, s0 = time.process_time(), _server_cpu(server.pid)
                t0 = time.perf_counter()
                got = methods[name]()
                dt = time.perf_counter() - t0
                busy[name].append((time.process_time() - c0 + _server_cpu(server.pid) - s0) / dt)
                if name not in ("one stream", "ranged GETs") and abs(got - want) > 1e-3 * abs(want):
                    raise AssertionError(f"{name} loaded other values: {got} != {want}")
                results[name].append(dt)
                print(f"round {r} {name}: {dt:.2f} s", file=sys.stderr)
    finally:
        stop()

    single = statistics.median(results["one stream"])
    theirs = statistics.median(results["torch.load via s3fs"])
    print(f"\n| read of {size / 2**20:.0f} MiB (median of {args.rounds}, min–max) | seconds "
          "| MiB/s | × one stream's speed | × `torch.load` via s3fs's speed | CPUs busy |")
    print("|---|---|---|---|---|---|")
    for name in names:
        xs = results[name]
        med = statistics.median(xs)
        print(f"| {name} | {med:.2f} ({min(xs):.2f}–{max(xs):.2f}) | {size / 2**20 / med:.0f} "
              f"| {single / med:.2f} | {theirs / med:.2f} | {statistics.median(busy[name]):.2f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "bytes": size, "results": results, "cpus_busy": busy},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
