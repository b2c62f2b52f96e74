"""The writer's share of a steady save: the tensor index encoded once per plan, or rebuilt and
``json.dumps``-ed at every save (what every save did before), alternated save by save in one
process; with ``--crc``, the background CRCs of an image of many small slots, slot by slot in C
loops or in one pass (what they were before), alternated.

Usage::

    python benchmarks/bench_index_json.py --shapes s8000 s100k --saves 8 --dir /work/ptmp
    python benchmarks/bench_index_json.py --crc --shapes s8000 s100k

For each shape (``bench_shapes.py``'s states), one ``Checkpointer(writer="thread")`` saves the
state ``--saves`` times per mode after two warm-ups, the modes alternating save by save, each
save finished before the next: ``kept`` (the code as it is) and ``rebuilt`` (the index's dicts
made and ``json.dumps``-ed at each save, as before). Reported per mode, medians: the save's
``commit_s`` (its telemetry: the writer's time after the data is written: index, proof, tail,
publish) and ``time_to_commit_s`` (from ``save()`` to committed). The writer agent
(``writer="process"``, the default) runs the same code in its own process.
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
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from bench_shapes import SHAPES

import stagesave
from stagesave.saving import index_json


def _rebuilt(self: index_json.IndexJson, entries: Any) -> bytes:
    """What a save did before: a dict per entry, then ``json.dumps``."""
    return json.dumps([
        {"name": t.name, "storage": t.storage_key, "dtype": t.dtype, "shape": list(t.shape),
         "stride": list(t.stride), "storage_offset": t.storage_offset} for t in entries
    ], separators=(",", ":"), allow_nan=False).encode()


def run(state: dict[str, Any], root: str, saves: int) -> dict[str, Any]:
    kept = index_json.IndexJson.of
    out: dict[str, Any] = {m: {"commit_s": [], "time_to_commit_s": []} for m in ("kept", "rebuilt")}
    try:
        with stagesave.Checkpointer(root, keep_last=2, writer="thread") as ck:
            for i in range(2 + 2 * saves):
                mode = ("kept", "rebuilt")[i % 2]
                index_json.IndexJson.of = kept if mode == "kept" else _rebuilt  # type: ignore[method-assign]
                state["global_step"] = i
                tel = ck.save(state, f"s{i}.ckpt").result()
                if i >= 2:
                    out[mode]["commit_s"].append(tel.commit_s)
                    out[mode]["time_to_commit_s"].append(tel.time_to_commit_s)
    finally:
        index_json.IndexJson.of = kept  # type: ignore[method-assign]
    return out


def crc_ab(state: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """``crc_image`` of the staged image of ``state``, slot by slot or in one pass, alternated;
    both must give the same CRCs."""
    import concurrent.futures as cf

    from stagesave.saving import crc_pass
    from stagesave.saving.buffers import HostBuffer
    from stagesave.saving.plan import plan_torch_file
    from stagesave.saving.stage import stage_image

    image = plan_torch_file(state)
    buf = HostBuffer.allocate(image.size, pinned=False)
    stage_image(image, buf, 0)
    view = buf.view[: image.size]
    real = crc_pass.many_small_slots
    out: dict[str, list[float]] = {"slot by slot": [], "one pass": []}
    got = {}
    with cf.ThreadPoolExecutor(2) as pool:
        for i in range(2 * rounds):
            mode = ("slot by slot", "one pass")[i % 2]
            crc_pass.many_small_slots = real if mode == "slot by slot" else (lambda _: False)
            try:
                t = time.perf_counter()
                got[mode] = crc_pass.crc_image(image, view, chunk_bytes=32 << 20, pool=pool)
                out[mode].append(time.perf_counter() - t)
            finally:
                crc_pass.many_small_slots = real
    a, b = got["slot by slot"], got["one pass"]
    assert a.slots == b.slots and a.chunks == b.chunks
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["s8000", "s100k"], choices=list(SHAPES))
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--crc", action="store_true", help="the background CRCs' A/B instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict[str, Any] = {}
    if args.crc:
        for key in args.shapes:
            label, make = SHAPES[key]
            r = results[key] = crc_ab(make(), args.saves)
            each, once = (statistics.median(r[m]) * 1e3 for m in ("slot by slot", "one pass"))
            print(f"{label:<58} CRCs: slot by slot {each:7.1f} ms, one pass {once:7.1f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return
    base = tempfile.mkdtemp(dir=args.dir, prefix="bench-index-")
    try:
        for key in args.shapes:
            label, make = SHAPES[key]
            r = results[key] = run(make(), os.path.join(base, key), args.saves)
            med = {m: {k: statistics.median(v) for k, v in r[m].items()} for m in r}
            print(f"{label:<58} commit: kept {med['kept']['commit_s'] * 1e3:7.1f} ms, rebuilt "
                  f"{med['rebuilt']['commit_s'] * 1e3:7.1f} ms; save to committed: kept "
                  f"{med['kept']['time_to_commit_s'] * 1e3:7.1f} ms, rebuilt "
                  f"{med['rebuilt']['time_to_commit_s'] * 1e3:7.1f} ms")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
