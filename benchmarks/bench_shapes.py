"""Blocking time of ``save()`` against the copy floor, for the shapes real training states have.

Usage:
    python benchmarks/bench_shapes.py                        # the standard shapes
    python benchmarks/bench_shapes.py --shapes s8000 s100k   # some of them
    python benchmarks/bench_shapes.py --state my_checkpoint.pt   # your own state (torch.load-able)
    python benchmarks/bench_shapes.py --shapes s100k --first-pickle-ab 5   # first saves, the
        # pickle written from the walk or pickled from a marked copy, alternated in one process
    python benchmarks/bench_shapes.py --shapes s252 t2g --prepare-ab 4   # first saves with the
        # buffer prepared beforehand (Checkpointer.prepare_buffer) or not, alternated

For each shape, in one process: the **copy floor** (every tensor copied into its warm twin with
``copy_``, median of 5), then ``save()``'s **blocking** time (median of ``--saves`` saves after 2
warm-ups, each on a fresh step counter as a training loop has, each save finished before the
next) per planner (``--planners``, interleaved): ``steady`` (the default: the last plan reused
while the structure is the same), ``fast`` (stagesave's planner from scratch at every save, as
before) and ``torch`` (``torch.save``'s layout); the **first save** of a new ``Checkpointer``
with nothing planned before (layout cache emptied; median of ``--first-saves``, interleaved with
the other planners' first saves); and ``torch.save`` into the page cache
(median of 3). ``--checksum-in`` sets the Checkpointers' option. Ratios are to the floor
measured in the same run. ``--json`` writes every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common

import stagesave
from stagesave.saving import fastplan as _fastplan
from stagesave.saving import steady as _steady

try:
    from stagesave.saving import tensor_guard as _guard
except ImportError:  # a checkout before it (run with PYTHONPATH=<that checkout>/src)
    _guard = None  # type: ignore[assignment]
from stagesave.saving import ziplayout as _ziplayout


def adam_state(total_bytes: int, n_tensors: int, *, weights: bool = True) -> dict[str, Any]:
    """Weights and two Adam moments per weight (``weights=False``: only moment pairs), ``n_tensors``
    tensors of equal size in all, plus the scalars a training loop keeps."""
    groups = 3 if weights else 2
    n = max(1, n_tensors // groups)
    numel = max(1, total_bytes // (n * groups) // 4)
    g = torch.Generator().manual_seed(0)
    model = (
        {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(n)} if weights else {}
    )
    state = {
        i: {
            "exp_avg": torch.randn(numel, generator=g),
            "exp_avg_sq": torch.rand(numel, generator=g),
        }
        for i in range(n)
    }
    return {
        "state_dict": model,
        "optimizer": {"state": state, "param_groups": [{"lr": 1e-4, "params": list(range(n))}]},
        "epoch": 0,
        "global_step": 0,
    }


SHAPES: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    "tiny": (
        "4 KiB in 1 tensor (the fixed cost per save)",
        lambda: {"w": torch.randn(1024), "global_step": 0},
    ),
    "s200": ("50 MiB in 200 tensors (a small model)", lambda: adam_state(50 << 20, 200)),
    "s252": ("0.38 GiB in 252 tensors", lambda: adam_state(int(0.38 * (1 << 30)), 252)),
    "s8000": ("0.5 GiB in 8,000 tensors", lambda: adam_state(1 << 29, 8000)),
    "s100k": (
        "0.25 GiB in 100,000 tensors (50,000 Adam moment pairs)",
        lambda: adam_state(1 << 28, 100_000, weights=False),
    ),
    "t2g": ("2 GiB transformer, 672 tensors", lambda: common.transformer_state(2 << 30)),
    "t8g": ("8 GiB transformer, 2,736 tensors", lambda: common.transformer_state(8 << 30)),
}
DEFAULT = ["tiny", "s200", "s252", "s8000", "s100k", "t2g"]


def _bump(state: Any, step: int) -> None:
    if isinstance(state, dict) and "global_step" in state:
        state["global_step"] = step


def _planner(name: str, ck: stagesave.Checkpointer | None = None) -> None:
    """Select the planner for the next save (the benchmark's A/B switch): ``steady`` (the
    default: the last plan reused while the structure is the same), ``fast`` (stagesave's
    planner from scratch at every save, as before issue 20's steady plans), ``torch``
    (``torch.save``'s layout), ``steady-python`` (``steady`` with the tensors' facts read and
    compared in Python, without torch's compiled check: :mod:`stagesave.saving.tensor_guard`)."""
    _fastplan.fast_path_enabled()
    _fastplan._checked = name != "torch"  # noqa: SLF001, RUF100 - the benchmark compares planners
    # a template keeps the guard it was made with: each Checkpointer's planner is set before
    # its first save and kept (None: tested again, as in a new process)
    if _guard is not None:
        _guard._usable = False if name == "steady-python" else None  # noqa: SLF001, RUF100
    if name == "fast" and ck is not None:
        ck.plans.forget()


#: States larger than this are copied into warm views of one reused window instead of twins
#: (an 8 GiB state, its twins and the staging memory do not fit a 24 GiB machine together).
TWIN_LIMIT = 4 << 30
WINDOW = 1 << 30


def _window_twins(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Warm destinations for ``tensors`` that reuse one window, each shaped as its tensor."""
    size = max(WINDOW, *(t.nbytes for t in tensors))
    window = torch.ones(size, dtype=torch.uint8)  # written once: every page faulted in
    out, at = [], 0
    for t in tensors:
        if at + t.nbytes > size:
            at = 0
        out.append(window[at : at + t.nbytes].view(t.dtype).view(t.shape))
        at += t.nbytes
    return out


def twin_copy_s(state: Any, repeats: int = 5) -> list[float]:
    """The copy floor: every tensor copied into its warm twin (``copy_``, one call per tensor),
    ``repeats`` times after one warm-up (past :data:`TWIN_LIMIT`, twins that share one warm
    1 GiB window: the same copies, at the same bandwidth, in bounded memory)."""
    tensors = [t.detach() for t in common.tensors_of(state)]
    cuda = any(t.is_cuda for t in tensors)
    if cuda:  # a GPU state: the floor is the copy into pinned host twins, waited for
        twins = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    elif sum(t.nbytes for t in tensors) > TWIN_LIMIT:
        twins = _window_twins([t.contiguous() if not t.is_contiguous() else t for t in tensors])
    else:
        twins = [t.clone() for t in tensors]
    for a, b in zip(twins, tensors):
        a.copy_(b)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for a, b in zip(twins, tensors):
            a.copy_(b, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def to_device(state: Any, device: str) -> Any:
    """``state`` with every tensor moved to ``device`` (tensors that shared a storage get one
    each: ``Tensor.to`` copies them one by one)."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return type(state)((k, to_device(v, device)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(to_device(v, device) for v in state)
    return state


def measure(
    state: Any, directory: str, saves: int, planners: list[str], checksum_in: str = "auto",
    first_saves: int = 3,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "bytes": common.state_bytes(state),
        "tensors": len(common.tensors_of(state)),
    }
    out["floor_s"] = twin_copy_s(state)
    # The first save of a run: a new Checkpointer, nothing planned before (``first_saves``
    # times, interleaved; its telemetry's planning, buffer wait and staging beside it).
    for name in planners:
        out[f"first_{name}_s"], out[f"first_{name}_parts"] = [], []
    for i in range(first_saves):
        for name in planners:
            _planner(name)
            _ziplayout.forget_layouts()
            root = os.path.join(directory, f"first-{name}-{i}")
            with stagesave.Checkpointer(root, keep_last=1, checksum_in=checksum_in) as ck:
                t0 = time.perf_counter()
                handle = ck.save(state, "first.ckpt")
                out[f"first_{name}_s"].append(time.perf_counter() - t0)
                handle.result()
                tel = handle.telemetry
                out[f"first_{name}_parts"].append(
                    {"plan_s": tel.plan_s, "wait_s": tel.buffer_wait_s, "stage_s": tel.stage_s})
            shutil.rmtree(root, ignore_errors=True)
    cks = {
        name: stagesave.Checkpointer(
            os.path.join(directory, name), keep_last=2, checksum_in=checksum_in
        )
        for name in planners
    }
    try:
        step = 0
        for name in planners:  # two warm-up saves each
            for _ in range(2):
                _planner(name, cks[name])
                step += 1
                _bump(state, step)
                cks[name].save(state, f"step-{step}.ckpt").result()
        samples: dict[str, list[float]] = {name: [] for name in planners}
        plan: dict[str, list[float]] = {name: [] for name in planners}
        for _ in range(saves):
            for name in planners:
                _planner(name, cks[name])
                step += 1
                _bump(state, step)
                t0 = time.perf_counter()
                handle = cks[name].save(state, f"step-{step}.ckpt")
                samples[name].append(time.perf_counter() - t0)
                handle.result()
                plan[name].append(handle.telemetry.plan_s)
        for name in planners:
            out[f"blocking_{name}_s"] = samples[name]
            out[f"plan_{name}_s"] = plan[name]
    finally:
        for ck in cks.values():
            ck.close()
        _planner("steady")
    torch_path = os.path.join(directory, "torch.pt")
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        torch.save(state, torch_path)
        ts.append(time.perf_counter() - t0)
        os.unlink(torch_path)
    out["torch_save_s"] = ts
    return out


def first_pickle_ab(state: Any, directory: str, rounds: int) -> dict[str, Any]:
    """First saves of a new Checkpointer, its pickle written from the walk (``written``) or by
    the pickler from a marked copy (``pickled``: the writer declines everything), alternated in
    one process ``rounds`` times each: blocking and the plan's part of it."""
    real = _steady.first_pickle
    out: dict[str, Any] = {}
    for mode in ("pickled", "written"):
        out[f"{mode}_s"], out[f"{mode}_plan_s"] = [], []
    try:
        for i in range(rounds):
            for mode in ("pickled", "written") if i % 2 else ("written", "pickled"):
                _steady.first_pickle = real if mode == "written" else (lambda *_: None)
                _ziplayout.forget_layouts()
                root = os.path.join(directory, f"ab-{mode}-{i}")
                with stagesave.Checkpointer(root, keep_last=1) as ck:
                    t0 = time.perf_counter()
                    handle = ck.save(state, "first.ckpt")
                    out[f"{mode}_s"].append(time.perf_counter() - t0)
                    handle.result()
                    out[f"{mode}_plan_s"].append(handle.telemetry.plan_s)
                shutil.rmtree(root, ignore_errors=True)
    finally:
        _steady.first_pickle = real
    return out


def prepare_ab(state: Any, directory: str, rounds: int) -> dict[str, Any]:
    """First saves of a new Checkpointer, with its buffer made beforehand by
    ``prepare_buffer(size of this state's file)`` (finished before the save) or not, alternated
    in one process ``rounds`` times each; and one steady save for the ratio."""
    probe = os.path.join(directory, "probe")
    with stagesave.Checkpointer(probe, keep_last=1) as ck:
        ck.save(state, "probe.ckpt").result()
        size = os.path.getsize(os.path.join(probe, "probe.ckpt"))
        steady = []
        for _ in range(3):
            t0 = time.perf_counter()
            handle = ck.save(state, "probe.ckpt")
            steady.append(time.perf_counter() - t0)
            handle.result()
    shutil.rmtree(probe, ignore_errors=True)
    out: dict[str, Any] = {"file_bytes": size, "steady_s": steady, "prepared_s": [], "cold_s": []}
    for i in range(rounds):
        for mode in ("prepared", "cold") if i % 2 else ("cold", "prepared"):
            _ziplayout.forget_layouts()
            root = os.path.join(directory, f"prep-{mode}-{i}")
            with stagesave.Checkpointer(root, keep_last=1) as ck:
                if mode == "prepared":
                    ck.prepare_buffer(size)
                    for t in threading.enumerate():  # the buffer made before the save begins
                        if t.name == "stagesave-buffer":
                            t.join()
                t0 = time.perf_counter()
                handle = ck.save(state, "first.ckpt")
                out[f"{mode}_s"].append(time.perf_counter() - t0)
                handle.result()
            shutil.rmtree(root, ignore_errors=True)
    return out


def _finish(base: str, results: dict[str, Any], json_path: str | None) -> None:
    """Remove the run's folder; write every sample to ``json_path`` (if given)."""
    shutil.rmtree(base, ignore_errors=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", nargs="+", default=DEFAULT, choices=list(SHAPES))
    ap.add_argument(
        "--state", default=None, help="measure this torch.load-able state instead of the shapes"
    )
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--first-saves", type=int, default=3,
                    help="first saves of a new Checkpointer per planner (median reported)")
    ap.add_argument(
        "--planners", nargs="+", default=["steady", "fast", "torch"],
        choices=["steady", "steady-python", "fast", "torch"],
    )
    ap.add_argument("--checksum-in", default="auto", choices=["auto", "staging", "background"])
    ap.add_argument("--device", default="cpu",
                    help="where the state lives, e.g. cuda (floor: copies into pinned twins)")
    ap.add_argument("--first-pickle-ab", type=int, default=0, metavar="ROUNDS",
                    help="only first saves: the pickle written from the walk or pickled, "
                         "alternated, ROUNDS each")
    ap.add_argument("--prepare-ab", type=int, default=0, metavar="ROUNDS",
                    help="only first saves: with the buffer prepared beforehand or not, "
                         "alternated, ROUNDS each")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-shapes-", dir=args.dir)
    results: dict[str, Any] = {}
    todo: list[tuple[str, str, Callable[[], Any]]]
    if args.state:
        todo = [
            (
                "state",
                args.state,
                lambda: torch.load(args.state, map_location="cpu", weights_only=False),
            )
        ]
    else:
        todo = [(k, *SHAPES[k]) for k in args.shapes]
    med = statistics.median
    if args.prepare_ab:
        for key, label, make in todo:
            r = prepare_ab(make(), os.path.join(base, key), args.prepare_ab)
            results[key] = {"label": label, **r}
            st, p, c = med(r["steady_s"]), med(r["prepared_s"]), med(r["cold_s"])
            print(f"{label:<58} steady {st * 1e3:7.1f} ms; first save: buffer prepared "
                  f"{p * 1e3:7.1f} ms ({p / st:.2f}x steady), not {c * 1e3:7.1f} ms "
                  f"({c / st:.2f}x)", flush=True)
        _finish(base, results, args.json)
        return
    if args.first_pickle_ab:
        for key, label, make in todo:
            r = first_pickle_ab(make(), os.path.join(base, key), args.first_pickle_ab)
            results[key] = {"label": label, **r}
            w, p = med(r["written_s"]), med(r["pickled_s"])
            print(f"{label:<58} first save: pickle written {w * 1e3:7.1f} ms (plan "
                  f"{med(r['written_plan_s']) * 1e3:.1f}), pickled {p * 1e3:7.1f} ms (plan "
                  f"{med(r['pickled_plan_s']) * 1e3:.1f}), {w / p:.2f}x", flush=True)
        _finish(base, results, args.json)
        return
    print(
        f"{'shape':<58} {'floor':>8} "
        + " ".join(f"{'blocking ' + p:>15} {'ratio':>6}" for p in args.planners)
        + f" {'first':>8} {'first/steady':>12} {'torch.save':>10}"
    )
    try:
        for key, label, make in todo:
            state = make() if args.device == "cpu" else to_device(make(), args.device)
            r = measure(state, os.path.join(base, key), args.saves, args.planners,
                        args.checksum_in, args.first_saves)
            results[key] = {"label": label, **r}
            floor = med(r["floor_s"])
            cells = []
            for p in args.planners:
                b = med(r[f"blocking_{p}_s"])
                cells.append(f"{b * 1e3:13.1f}ms {b / floor:6.2f}")
            steady = med(r[f"blocking_{args.planners[0]}_s"])
            first = med(r[f"first_{args.planners[0]}_s"])
            print(
                f"{label:<58} {floor * 1e3:6.1f}ms "
                + " ".join(cells)
                + f" {first * 1e3:6.1f}ms {first / steady:12.2f} "
                f"{med(r['torch_save_s']) * 1e3:8.1f}ms",
                flush=True,
            )
            del state
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
