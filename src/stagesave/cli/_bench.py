"""``stagesave bench``: the ways of saving a checkpoint, side by side, on the user's own target.

Every chosen alternative saves the same synthetic transformer-like training state (weights plus
two Adam moments per parameter, in layers of attention and MLP matrices) to the same place:
``torch.save`` + fsync (what Lightning's and Accelerate's defaults do), stagesave, and with
``--alternatives all`` also DCP ``async_save`` (thread and process mode, with its stagers),
Lightning's ``AsyncCheckpointIO`` and Accelerate's ``save_state`` where those are installed.
Rounds interleave the alternatives (the order rotates), each set up afresh, warmed up and torn
down, so that drift of the machine hits all of them alike. Ratios are against floors measured
in the same run: the copy floor (the state's bytes copied once into a reused buffer) and, on a
local folder, the disk floor (the same bytes written with O_DIRECT + fsync).

With ``--loop`` a small CPU training loop (an MLP on torch's default threads) runs through the
background write, and the table adds the training time lost per save: the blocking time plus what
the loop lost while the write ran (steps slower than its baseline). A background writer that
competes with training for the cores costs more than its blocking time says.

Several state sizes, loads, cold caches and a plot: ``benchmarks/bench_sweep.py`` in the source
tree, which runs the same alternatives.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.table import Table
from rich.text import Text

from ..stores import posix as fsops
from ..stores.targets import is_url
from ._alternatives import Alternative, Session, available_alternatives, mem_available_bytes
from ._common import CliError, Env, literal
from ._floors import copy_floor_s, disk_floor_s
from ._units import fmt_bytes, fmt_duration, fmt_rate, parse_size

__all__ = ["DEFAULT_ALTERNATIVES", "Timing", "TrainLoop", "add_parser", "run", "synthetic_state"]

#: What ``stagesave bench`` compares unless told otherwise.
DEFAULT_ALTERNATIVES = ("torch.save+fsync", "stagesave")
#: Memory left free beyond the state and an alternative's copies of it.
HEADROOM_BYTES = 512 << 20
#: A background save that takes longer than this is reported as an error.
SAVE_TIMEOUT_S = 3600.0


def synthetic_state(size_bytes: float, *, seed: int = 0) -> dict[str, Any]:
    """A training state of about ``size_bytes``: fp32 weights and Adam moments by layer."""
    if size_bytes < 1e5:
        raise ValueError(f"the benchmark state must be at least 100 kB, got {fmt_bytes(size_bytes)}")
    # A layer holds ~12 h^2 parameters, each with weight + 2 moments in fp32 (144 h^2 bytes):
    # pick the widest power of two that still gives at least 4 layers.
    hidden = 16
    while hidden < 2048 and 144 * (2 * hidden) ** 2 * 4 <= size_bytes:
        hidden *= 2
    shapes = {
        "attn.qkv.weight": (3 * hidden, hidden), "attn.out.weight": (hidden, hidden),
        "mlp.up.weight": (4 * hidden, hidden), "mlp.down.weight": (hidden, 4 * hidden),
        "norm1.weight": (hidden,), "norm2.weight": (hidden,),
    }
    per_layer = 3 * 4 * sum(torch.Size(s).numel() for s in shapes.values())  # weights + 2 moments, fp32
    layers = max(1, round(size_bytes / per_layer))
    g = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    opt_state: dict[int, dict[str, Any]] = {}
    for layer in range(layers):
        for name, shape in shapes.items():
            i = len(model)
            model[f"layers.{layer}.{name}"] = torch.randn(shape, generator=g)
            opt_state[i] = {"step": torch.tensor(100.0), "exp_avg": torch.randn(shape, generator=g) * 1e-3,
                            "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6}
    return {
        "model": model,
        "optimizer": {"state": opt_state, "param_groups": [{"lr": 1e-4, "params": list(opt_state)}]},
        "step": 100,
    }


@dataclass
class Timing:
    """One method's runs: seconds training waited, seconds until durable and, with a loop, time lost."""

    method: str
    durable: bool = True
    blocking_s: list[float] = field(default_factory=list)
    durable_s: list[float] = field(default_factory=list)
    lost_s: list[float] = field(default_factory=list)
    step_mean_x: list[float] = field(default_factory=list)
    step_p99_x: list[float] = field(default_factory=list)
    loop_ms: list[float] = field(default_factory=list)

    def add_loop(self, blocked: float, window: float, steps: list[float], baseline: float) -> None:
        """Record one save made while ``TrainLoop`` ran ``steps`` during the ``window`` after the call.

        The time lost is the blocking time plus the window less the work the loop would have done
        in it at its baseline speed (never negative): a loop that kept full speed lost nothing.
        """
        self.lost_s.append(blocked + max(0.0, window - len(steps) * baseline))
        self.step_mean_x.append(statistics.mean(steps) / baseline if steps else 1.0)
        self.step_p99_x.append(sorted(steps)[max(0, -(-len(steps) * 99 // 100) - 1)] / baseline if steps else 1.0)
        self.loop_ms.append(baseline * 1e3)

    def to_dict(self, nbytes: int) -> dict[str, Any]:
        b, d = statistics.median(self.blocking_s), statistics.median(self.durable_s)
        out = {"method": self.method, "durable": self.durable, "blocking_s": b, "durable_s": d,
               "runs": len(self.blocking_s),
               "throughput_bytes_per_s": nbytes / d if d > 0 else 0.0}
        if self.lost_s:
            out.update(lost_s=statistics.median(self.lost_s), step_mean_x=statistics.median(self.step_mean_x),
                       step_p99_x=statistics.median(self.step_p99_x), loop_ms_per_step=statistics.median(self.loop_ms))
        return out


class TrainLoop:
    """A small CPU training step (MLP forward, backward, SGD) on torch's default threads."""

    def __init__(self, hidden: int = 512, batch: int = 128) -> None:
        g = torch.Generator().manual_seed(0)
        self.weights = [torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden**0.5) for _ in range(3)]
        self.opt = torch.optim.SGD(self.weights, lr=1e-4)
        self.x = torch.randn(batch, hidden, generator=g)

    def step(self) -> float:
        """One step; its seconds."""
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        h = self.x
        for w in self.weights:
            h = torch.nn.functional.gelu(h @ w)
        torch.autograd.backward(h.square().mean())
        self.opt.step()
        return time.perf_counter() - t0

    def baseline(self, seconds: float = 0.5) -> float:
        """Median step time over ``seconds`` of steps with nothing else running."""
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 3:
            times.append(self.step())
        return statistics.median(times)




def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = list(state["model"].values())
    for s in state["optimizer"]["state"].values():
        tensors += list(s.values())
    return tensors


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of tensor data in a :func:`synthetic_state`."""
    return sum(int(t.numel()) * int(t.element_size()) for t in _tensors(state))


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="the ways of saving a checkpoint side by side (torch.save, stagesave, DCP, Lightning, "
             "Accelerate) on a target folder or URL",
        description=__doc__.split("\n\n")[0].replace("``", "") if __doc__ else None,
        epilog="Several sizes, loads, cold caches and a plot: benchmarks/bench_sweep.py in the source tree.",
    )
    p.add_argument("target", metavar="DIR|URL", nargs="?",
                   help="where to write (a folder, or e.g. s3://bucket/prefix)")
    p.add_argument("--size", default="256MB", help="size of the synthetic training state (default 256MB)")
    p.add_argument("--alternatives", default=",".join(DEFAULT_ALTERNATIVES), metavar="NAMES",
                   help="comma-separated alternatives to compare, or 'all' (default: %(default)s; "
                        "--list shows them)")
    p.add_argument("--list", action="store_true", help="list the alternatives and whether they can run here")
    p.add_argument("--repeat", type=int, default=3,
                   help="measured saves per alternative, one per round; the median is shown (default 3)")
    p.add_argument("--warmup", type=int, default=1,
                   help="uncounted saves before each measured one, for alternatives that reuse something "
                        "across saves (stagesave's buffer, DCP's stager or daemon; default 1)")
    p.add_argument("--loop", action="store_true",
                   help="run a small CPU training loop through each save and report the training time lost "
                        "per save (blocking + what the loop lost while the write ran)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _select(spec: str) -> list[Alternative]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    builtin = {a.name for a in available_alternatives(plugins=False)}
    # the integrations' alternatives import Lightning / Accelerate: load them only when asked for
    known = available_alternatives(plugins=spec.strip() == "all" or not set(names) <= builtin)
    if spec.strip() == "all":
        return known
    by_name = {a.name: a for a in known}
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        failed = [f"{a.name}: {a.unavailable()}" for a in known if a.name.endswith("(failed to load)")]
        raise CliError(f"unknown alternatives {unknown or [spec]}; known: {', '.join(by_name)}"
                       + (f"; not loaded: {'; '.join(failed)}" if failed else ""), 2)
    return [by_name[n] for n in dict.fromkeys(names)]


def _list(env: Env, args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = [
        {"name": a.name, "unavailable": a.unavailable(), "note": a.note, "durable": a.durable, "urls": a.urls}
        for a in available_alternatives()
    ]
    if args.json:
        env.print_json({"alternatives": rows})
        return 0
    t = Table(title="stagesave bench --alternatives", title_justify="left", header_style="bold")
    for col in ("name", "runs here", "what it does"):
        t.add_column(col)
    for r in rows:
        t.add_row(literal(r["name"]), literal("yes" if r["unavailable"] is None else f"no: {r['unavailable']}"),
                  literal(r["note"]))
    env.out.print(t)
    return 0


class _Target:
    """The target folder or URL: where each alternative writes, and how to clean up after it."""

    def __init__(self, env: Env, root: str) -> None:
        self.env, self.root, self.url = env, root, is_url(root)

    def folder(self, alt: Alternative) -> str:
        """A new folder (or prefix) of its own: nothing already in the target is touched."""
        slug = "".join(c if c.isalnum() else "-" for c in alt.name).strip("-")
        if self.url:
            return f"{self.root}/stagesave-bench-{slug}-{uuid.uuid4().hex[:12]}"
        path = os.path.join(self.root, f"stagesave-bench-{slug}-{uuid.uuid4().hex[:12]}")
        fsops.mkdir(path)
        return path

    def remove(self, path: str) -> None:
        if self.url:
            import fsspec

            fs, p = fsspec.core.url_to_fs(path, **self.env.storage_options)
            if fs.exists(p):
                fs.rm(p, recursive=True)
        else:
            fsops.rmtree(path, ignore_errors=True)


def _wait(done: Callable[[], bool], what: str) -> None:
    end = time.perf_counter() + SAVE_TIMEOUT_S
    while not done():
        if time.perf_counter() > end:
            raise CliError(f"{what} did not finish in {SAVE_TIMEOUT_S:.0f} s")
        time.sleep(0.005)


def _one_round(alt: Alternative, session: Session, state: Any, folder: str, args: argparse.Namespace,
               loop: TrainLoop | None, timing: Timing, advance: Callable[[float], None], nbytes: int) -> None:
    """Warm ``session`` up if it reuses something, then measure one save into ``folder``."""
    if alt.warmup and args.warmup > 0:
        for i in range(args.warmup):
            _, done = session.start(state, f"{folder}/warmup-{i}")
            _wait(done, f"{alt.name}: warm-up save")
            session.check()
            advance(nbytes)
        session.after_warmup()
    baseline = loop.baseline() if loop is not None else 0.0
    blocked, done = session.start(state, f"{folder}/ckpt")
    t0 = time.perf_counter()
    steps: list[float] = []
    while loop is not None and not done():
        steps.append(loop.step())
    window = time.perf_counter() - t0 if steps else 0.0  # done before the first step: nothing lost after the call
    _wait(done, f"{alt.name}: save")
    session.check()
    timing.blocking_s.append(blocked)
    timing.durable_s.append(session.commit_s() or blocked + (time.perf_counter() - t0))
    if loop is not None:
        timing.add_loop(blocked, window, steps, baseline)
    advance(nbytes)


def _measure_round(env: Env, target: _Target, alt: Alternative, state: Any, args: argparse.Namespace,
                   loop: TrainLoop | None, timing: Timing, advance: Callable[[float], None], nbytes: int) -> None:
    """Set ``alt`` up in a fresh folder, measure one save, tear it down and remove the folder.

    A failure of the save is reported as such; one of the teardown after a failed save is noted
    and does not hide it; the folder is removed whatever happened.
    """
    folder = target.folder(alt)
    session: Session | None = None
    error: BaseException | None = None
    try:
        session = alt.make(folder, env.storage_options)
        _one_round(alt, session, state, folder, args, loop, timing, advance, nbytes)
    except CliError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - reported with the alternative's name below
        error = CliError(f"{alt.name} failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
    finally:
        try:
            if session is not None:
                try:
                    session.close()
                except Exception as exc:  # noqa: BLE001 - must not hide the save's own error
                    if error is None:
                        error = CliError(f"{alt.name}: tearing it down failed: {type(exc).__name__}: {exc}")
                        error.__cause__ = exc
                    else:
                        env.say(f"note: tearing down {alt.name} also failed: {exc}", err=True)
        finally:
            target.remove(folder)
    if error is not None:
        raise error


def run(env: Env, args: argparse.Namespace) -> int:
    if args.list:
        return _list(env, args)
    if args.target is None:
        raise CliError("bench needs a target folder or URL (or --list)", 2)
    if args.repeat < 1 or args.warmup < 0:
        raise CliError("--repeat must be at least 1 and --warmup at least 0", 2)
    alts = _select(args.alternatives)
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        raise CliError(str(exc), 2) from exc
    available = mem_available_bytes()
    if available is not None and size + HEADROOM_BYTES > available:
        raise CliError(f"a {fmt_bytes(size)} state does not fit in memory here ({fmt_bytes(available)} "
                       "available); pick a smaller --size", 2)
    try:
        state = synthetic_state(size)
    except ValueError as exc:
        raise CliError(str(exc), 2) from exc
    root = args.target.rstrip("/") or "/"
    if not is_url(root):
        root = os.path.abspath(os.path.expanduser(root))
        if not os.path.isdir(root):
            raise CliError(f"{root} is not a folder; create it or pick another target")
    target = _Target(env, root)
    nbytes = state_bytes(state)
    skipped: list[dict[str, str]] = []
    runnable: list[Alternative] = []
    available = mem_available_bytes()  # the state is built now
    for alt in alts:
        reason = alt.unavailable()
        if reason is None and target.url and not alt.urls:
            reason = "writes local paths only"
        if reason is None and available is not None and nbytes * alt.copies + HEADROOM_BYTES > available:
            reason = (f"needs {fmt_bytes(nbytes * alt.copies + HEADROOM_BYTES)} more memory, "
                      f"{fmt_bytes(available)} available")
        if reason is None:
            runnable.append(alt)
        else:
            skipped.append({"method": alt.label(target.url), "reason": reason})
    if not runnable:
        raise CliError("none of the chosen alternatives can run here: "
                       + "; ".join(f"{s['method']}: {s['reason']}" for s in skipped))
    floors: dict[str, Any] = {"copy_s": None, "disk_s": None, "disk_direct": None}
    if available is None or nbytes + HEADROOM_BYTES <= available:
        floors["copy_s"] = copy_floor_s(_tensors(state))
    if not target.url:
        try:
            floors["disk_s"], floors["disk_direct"] = disk_floor_s(root, nbytes)
        except OSError as exc:
            raise CliError(f"cannot write {fmt_bytes(nbytes)} into {root} to measure the disk floor: {exc}") from exc
    timings = {a.name: Timing(a.label(target.url), durable=a.durable) for a in runnable}
    loop = TrainLoop() if args.loop else None
    if loop is not None:
        loop.baseline(0.2)  # warm its allocations and threads
    total = sum(nbytes * (1 + (args.warmup if a.warmup else 0)) for a in runnable) * args.repeat
    with env.progress("benchmarking", total) as advance, warnings.catch_warnings():
        # DCP warns on every single-process save, from its background thread too
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        for r in range(args.repeat):
            order = runnable[r % len(runnable):] + runnable[: r % len(runnable)] if runnable else []
            for alt in order:
                _measure_round(env, target, alt, state, args, loop, timings[alt.name], advance, nbytes)
    results = [timings[a.name].to_dict(nbytes) for a in runnable]
    for res in results:
        if floors["copy_s"]:
            res["blocking_x_copy_floor"] = res["blocking_s"] / floors["copy_s"]
            if "lost_s" in res:
                res["lost_x_copy_floor"] = res["lost_s"] / floors["copy_s"]
        if floors["disk_s"]:
            res["durable_x_disk_floor"] = res["durable_s"] / floors["disk_s"]
    if args.json:
        env.print_json({"target": root, "state_bytes": nbytes, "floors": floors, "results": results,
                        "skipped": skipped, "torch_threads": torch.get_num_threads()})
        return 0
    _print_table(env, root, nbytes, args, floors, results, skipped, loop is not None)
    return 0


def _print_table(env: Env, root: str, nbytes: int, args: argparse.Namespace, floors: dict[str, Any],
                 results: list[dict[str, Any]], skipped: list[dict[str, str]], with_loop: bool) -> None:
    ref = next((r for r in results if r["method"].startswith("torch.save")), results[0] if results else None)
    t = Table(title=literal(f"{fmt_bytes(nbytes)} training state -> {root} (median of {args.repeat})"),
              title_justify="left", header_style="bold")
    cols = ["method", "training blocked", "blocked x copy floor", "complete after", "x disk floor", "throughput",
            f"stall vs {ref['method'] if ref else '-'}"]
    if with_loop:
        cols += ["training lost", "lost x copy floor", "step time while writing (mean/p99)"]
    for col in cols:
        t.add_column(col, justify="left" if col == "method" else "right")

    def ratio(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.2f}x" if key in r else "-"

    for r in results:
        complete = fmt_duration(r["durable_s"]) + ("" if r["durable"] else " (not durable)")
        row: list[str | Text] = [
               literal(r["method"]), fmt_duration(r["blocking_s"]), ratio(r, "blocking_x_copy_floor"), complete,
               ratio(r, "durable_x_disk_floor"), fmt_rate(r["throughput_bytes_per_s"]),
               f"{r['blocking_s'] / ref['blocking_s']:.2f}x" if ref and ref["blocking_s"] > 0 else "-"]
        if with_loop:
            row += [fmt_duration(r["lost_s"]), ratio(r, "lost_x_copy_floor"),
                    f"{r['step_mean_x']:.2f}x / {r['step_p99_x']:.2f}x"]
        t.add_row(*row)
    env.out.print(t)
    parts = []
    if floors["copy_s"]:
        parts.append(f"copy floor {fmt_duration(floors['copy_s'])}")
    if floors["disk_s"]:
        parts.append(f"disk floor {fmt_duration(floors['disk_s'])}"
                     + (" (O_DIRECT + fsync)" if floors["disk_direct"] else " (buffered + fsync: O_DIRECT refused)"))
    if parts:
        env.out.print("; ".join(parts))
    if with_loop and results:
        env.out.print(f"training loop: {results[0]['loop_ms_per_step']:.1f} ms per step at baseline, torch on "
                      f"{torch.get_num_threads()} threads; lost = blocked + what the loop lost while the write ran")
    for s in skipped:
        env.say(f"skipped {s['method']}: {s['reason']}")
