"""S3 upload throughput of one checkpoint: stagesave's store vs what users do today.

Usage::

    python benchmarks/bench_s3.py --size-mib 1024 --repeats 3

Side by side, in one run, against the same loopback SeaweedFS server (the one
``scripts/s3server.sh start`` announced through ``STAGESAVE_S3_*``, else one started here), the
same training-like state (fp32 weights + Adam moments, ``benchmarks/common.py``) is uploaded:

- ``stagesave``: ``Checkpointer.save(state, "s3://...")`` until committed: staging copy, then
  a concurrent multipart upload whose parts are slices of the staging buffer, manifest, publish.
- ``torch.save -> s3fs file``: ``torch.save(state, fs.open(url, "wb"))``, s3fs's buffered file
  (serialization and sequential part uploads interleaved) — what users write today.
- ``s3fs.pipe``: ``torch.save`` into ``BytesIO`` then one ``fs.pipe(url, data)``; the table shows
  the whole and the pipe alone.

Throughput = checkpoint bytes / wall time until the object is visible. The order of the methods
rotates between repeats. Client CPU (this process) and server CPU (the ``weed`` process, when its
pid is known) are reported per method: on loopback the server's own CPU bounds all three.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from common import state_bytes, transformer_state


def _server() -> tuple[Any, Callable[[], None]]:
    import s3server

    found = s3server.server_from_env()
    if found is not None:
        pid = os.environ.get(s3server.ENV_PID)
        found.pid = int(pid) if pid else None
        return found, lambda: None
    started = s3server.start_server()
    return started, lambda: s3server.stop_server(started.pid, started.workdir)


def _bucket(server: Any, prefix: str) -> tuple[Any, str, dict[str, Any]]:
    """A new bucket on ``server``: its boto3 client, the bucket's name, fsspec options."""
    client = server.client()
    bucket = f"{prefix}-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    return client, bucket, server.options()


def _cpu(pid: int | None) -> float:
    try:
        import psutil
    except ImportError:
        return float("nan")
    proc = psutil.Process(pid) if pid else psutil.Process()
    t = proc.cpu_times()
    return float(t.user + t.system)


def _run_stagesave(
    state: Any, url: str, options: dict[str, Any], args: argparse.Namespace
) -> dict[str, float]:
    import stagesave
    from stagesave.stores.s3 import S3Store

    root, _, name = url.rpartition("/")
    store = S3Store(root, options, max_connections=args.connections, part_size=args.part_mib << 20,
                    multipart_threshold=args.part_mib << 20)
    with stagesave.Checkpointer(store) as ckpt:
        t0 = time.perf_counter()
        tel = ckpt.save(state, name).result()
        wall = time.perf_counter() - t0
    store.close()
    return {"wall_s": wall, "blocking_s": tel.blocking_s, "bytes": tel.bytes}


def _run_torch_s3fs(
    state: Any, url: str, options: dict[str, Any], args: argparse.Namespace
) -> dict[str, float]:
    import s3fs

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    t0 = time.perf_counter()
    with fs.open(url, "wb") as f:
        torch.save(state, f)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "blocking_s": wall, "bytes": fs.info(url)["size"]}


def _run_pipe(
    state: Any, url: str, options: dict[str, Any], args: argparse.Namespace
) -> dict[str, float]:
    import s3fs

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    t0 = time.perf_counter()
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    t1 = time.perf_counter()
    fs.pipe(url, data)
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "blocking_s": wall,
        "pipe_s": time.perf_counter() - t1,
        "bytes": len(data),
    }


METHODS: dict[str, Callable[..., dict[str, float]]] = {
    "stagesave": _run_stagesave,
    "torch.save -> s3fs file": _run_torch_s3fs,
    "s3fs.pipe": _run_pipe,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mib", type=int, default=1024, help="state size (default 1024 = ~1 GiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--connections", type=int, default=16, help="stagesave max_connections")
    p.add_argument("--part-mib", type=int, default=16, help="stagesave preferred part size")
    p.add_argument("--json", help="also write the raw results here")
    args = p.parse_args(argv)

    server, stop = _server()
    try:
        client, bucket, options = _bucket(server, "stagesave-bench")
        state = transformer_state(args.size_mib << 20)
        print(
            f"state: {state_bytes(state) / 2**20:.0f} MiB of tensors; server {server.endpoint}",
            file=sys.stderr,
        )
        names = list(METHODS)
        results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for r in range(args.repeats):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                url = f"s3://{bucket}/r{r}-{name.split()[0].replace('.', '')}.ckpt"
                c0, s0 = _cpu(None), _cpu(server.pid)
                res = METHODS[name](state, url, options, args)
                res["client_cpu_s"] = _cpu(None) - c0
                res["server_cpu_s"] = _cpu(server.pid) - s0 if server.pid else float("nan")
                res["mib_per_s"] = res["bytes"] / 2**20 / res["wall_s"]
                results[name].append(res)
                print(
                    f"repeat {r} {name}: {res['mib_per_s']:.0f} MiB/s ({res['wall_s']:.2f} s)",
                    file=sys.stderr,
                )
                bucket_key = url.split("/", 3)[3]
                client.delete_object(Bucket=bucket, Key=bucket_key)
                for o in client.list_objects_v2(Bucket=bucket).get("Contents", []):
                    client.delete_object(Bucket=bucket, Key=o["Key"])
    finally:
        stop()

    base = statistics.median(x["mib_per_s"] for x in results["torch.save -> s3fs file"])
    print(
        f"\n| method | throughput MiB/s (median of {args.repeats}) | wall s | blocking s "
        "| client CPU s | server CPU s | vs torch.save->s3fs |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in names:
        rs = results[name]
        med = statistics.median(x["mib_per_s"] for x in rs)
        extra = (
            f" (pipe alone {statistics.median(x['pipe_s'] for x in rs):.2f} s)"
            if name == "s3fs.pipe"
            else ""
        )
        print(
            f"| {name} | {med:.0f} ({min(x['mib_per_s'] for x in rs):.0f}–"
            f"{max(x['mib_per_s'] for x in rs):.0f}) "
            f"| {statistics.median(x['wall_s'] for x in rs):.2f}{extra} "
            f"| {statistics.median(x['blocking_s'] for x in rs):.2f} "
            f"| {statistics.median(x['client_cpu_s'] for x in rs):.2f} "
            f"| {statistics.median(x['server_cpu_s'] for x in rs):.2f} | {med / base:.2f}x |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
