"""Sharded saves inside a process group, each of this session's two changes on and off,
alternated in one process (the machine's drift cancels out).

Usage:
    python benchmarks/bench_dcp_ab.py --shapes s8000 s100k --saves 8 --firsts 4
    python benchmarks/bench_dcp_ab.py --shapes s8000 s100k --dtensor

One process in a gloo group of one rank, the states of ``bench_shapes.py`` (``--dtensor``: every
tensor a ``DTensor`` sharded on that rank's mesh, as in ``bench_dcp_shapes.py``):

* **steady saves**: two writers saving the same state, alternated save by save (each finished
  before the next): one as the code is, one with the kept flattening turned off (the planner
  flattens the state at every save, as before 2026-12-07 12:00 UTC: ``outline`` answers
  ``None``). Median blocking of ``--saves`` saves each after 2 warm-ups.
* **first saves** (``--firsts`` rounds): a new writer's first save, alternated between the
  save planned from the state without the metadata's last collective (``planned_save``, as the
  code is) and ``dcp.save`` itself.

Prints medians and the ratio off ÷ on; ``--json`` writes every sample.
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

sys.path.insert(0, os.path.dirname(__file__))
from bench_dcp_shapes import _dtensors, _process_group
from bench_shapes import SHAPES, _bump

import stagesave
import stagesave.dcp as sdcp
from stagesave.dcp import _steady_planner

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _timed(writer: sdcp.StagedStorageWriter, state: Any, name: str) -> float:
    t0 = time.perf_counter()
    handle = sdcp.save(state, name, writer=writer)
    took = time.perf_counter() - t0
    handle.result(600)
    return took


def steady_ab(state: Any, root: str, saves: int) -> dict[str, list[float]]:
    """Steady saves of two writers alternated: the kept flattening on and off."""
    real = _steady_planner.outline
    out: dict[str, list[float]] = {"on": [], "off": []}
    writers = {}
    for mode in ("on", "off"):
        d = tempfile.mkdtemp(dir=root)
        writers[mode] = sdcp.StagedStorageWriter(
            checkpointer=stagesave.Checkpointer(d, keep_last=2), commit_timeout=600)
    try:
        for i in range(saves + 2):
            for mode in (("on", "off") if i % 2 else ("off", "on")):
                _steady_planner.outline = real if mode == "on" else (lambda s: None)
                _bump(state, i)
                took = _timed(writers[mode], state, f"s{i}")
                if i >= 2:
                    out[mode].append(took)
    finally:
        _steady_planner.outline = real
        for w in writers.values():
            w.checkpointer.close()
            w.close()
    return out


def first_ab(state: Any, root: str, rounds: int) -> dict[str, list[float]]:
    """First saves of new writers, alternated: planned without the last collective, or
    ``dcp.save``."""
    real = sdcp._full_save

    def by_dcp(steady: Any, path: Any, writer: Any, planner: Any, group: Any) -> None:
        sdcp._dcp_save(steady.state, checkpoint_id=path, storage_writer=writer,
                       planner=planner, process_group=group)

    out: dict[str, list[float]] = {"planned": [], "dcp.save": []}
    try:
        for i in range(rounds):
            for mode in (("planned", "dcp.save") if i % 2 else ("dcp.save", "planned")):
                sdcp._full_save = real if mode == "planned" else by_dcp
                d = tempfile.mkdtemp(dir=root)
                with stagesave.Checkpointer(d, keep_last=1) as ckpt:
                    writer = sdcp.StagedStorageWriter(checkpointer=ckpt, commit_timeout=600)
                    out[mode].append(_timed(writer, state, "first"))
                    writer.close()
                shutil.rmtree(d, ignore_errors=True)
    finally:
        sdcp._full_save = real
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["s8000", "s100k"], choices=list(SHAPES))
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--firsts", type=int, default=4)
    ap.add_argument("--dtensor", action="store_true")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    _process_group(root)
    results = []
    try:
        mesh = None
        if args.dtensor:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (1,))
        for shape in args.shapes:
            label, make = SHAPES[shape]
            state = make() if mesh is None else _dtensors(make(), mesh)
            med = statistics.median
            row: dict[str, Any] = {"shape": shape, "label": label, "dtensor": args.dtensor}
            row["steady"] = steady_ab(state, root, args.saves)
            on, off = med(row["steady"]["on"]), med(row["steady"]["off"])
            print(f"{label}{' (DTensors)' if mesh else ''}: steady {on * 1e3:.1f} ms with the kept "
                  f"flattening, {off * 1e3:.1f} ms without ({off / on:.2f}x)", flush=True)
            if args.firsts:
                row["first"] = first_ab(state, root, args.firsts)
                p, d = med(row["first"]["planned"]), med(row["first"]["dcp.save"])
                print(f"  first saves: {p * 1e3:.0f} ms planned without the last collective, "
                      f"{d * 1e3:.0f} ms by dcp.save ({d / p:.2f}x)", flush=True)
            results.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stagesave": stagesave.__file__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
