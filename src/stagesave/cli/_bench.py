"""``stagesave bench``: a quick side by side of stagesave and ``torch.save`` on one target.

Both save the same synthetic transformer-like training state (weights plus two Adam moments per
parameter, in layers of attention and MLP matrices) to the same place. For ``torch.save`` the
training loop waits for the whole serialization and write (and the fsync that makes it durable);
for stagesave it waits only for the staging copy, and the commit follows in the background.

With ``--loop`` a small CPU training loop (an MLP on torch's default threads) runs through the
background write, and the table adds the training time lost per save: the blocking time plus what
the loop lost while the write ran (steps slower than its baseline). A background writer that
competes with training for the cores costs more than its blocking time says.

This is the quick version on the user's own target. The full harness (every alternative:
Lightning's AsyncCheckpointIO, DCP ``async_save`` in thread and process mode, ...; several state
sizes; floors; loads; a plot) is ``benchmarks/bench_sweep.py`` in the source tree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.table import Table

from .._targets import is_url
from ..checkpointer import Checkpointer
from ._common import CliError, Env
from ._units import fmt_bytes, fmt_duration, fmt_rate, parse_size

__all__ = ["Timing", "TrainLoop", "add_parser", "run", "synthetic_state"]


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


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of tensor data in a :func:`synthetic_state`."""
    tensors: list[torch.Tensor] = list(state["model"].values())
    for s in state["optimizer"]["state"].values():
        tensors += list(s.values())
    return sum(int(t.numel()) * int(t.element_size()) for t in tensors)


@dataclass
class Timing:
    """One method's runs: seconds training waited, seconds until durable and, with a loop, time lost."""

    method: str
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
        out = {"method": self.method, "blocking_s": b, "durable_s": d, "runs": len(self.blocking_s),
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


def _torch_save(env: Env, state: Any, target: str) -> float:
    t0 = time.perf_counter()
    if is_url(target):
        import fsspec

        with fsspec.open(target, "wb", **env.storage_options) as f:
            torch.save(state, f)
    else:
        with open(target, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def _remove(env: Env, target: str) -> None:
    if is_url(target):
        import fsspec

        fs, path = fsspec.core.url_to_fs(target, **env.storage_options)
        if fs.exists(path):
            fs.rm_file(path)
    elif os.path.exists(target):
        os.remove(target)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="quick side by side: stagesave vs torch.save(+fsync) on a target folder or URL",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="The full harness (every alternative, several sizes, floors, loads, a plot) is "
               "benchmarks/bench_sweep.py in the source tree.",
    )
    p.add_argument("target", metavar="DIR|URL", help="where to write (a folder, or e.g. s3://bucket/prefix)")
    p.add_argument("--size", default="256MB", help="size of the synthetic training state (default 256MB)")
    p.add_argument("--repeat", type=int, default=3, help="saves per method; the median is shown (default 3)")
    p.add_argument("--warmup", type=int, default=1,
                   help="uncounted saves per method first (buffer allocation, page cache; default 1)")
    p.add_argument("--loop", action="store_true",
                   help="run a small CPU training loop through each save and report the training time lost "
                        "per save (blocking + what the loop lost while the write ran)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(env: Env, args: argparse.Namespace) -> int:
    if args.repeat < 1 or args.warmup < 0:
        raise CliError("--repeat must be at least 1 and --warmup at least 0", 2)
    try:
        state = synthetic_state(parse_size(args.size))
    except ValueError as exc:
        raise CliError(str(exc), 2) from exc
    root = args.target.rstrip("/")
    if not is_url(root):
        root = os.path.abspath(os.path.expanduser(root))
        if not os.path.isdir(root):
            raise CliError(f"{root} is not a folder; create it or pick another target")
    nbytes = state_bytes(state)
    torch_path = f"{root}/stagesave-bench-torch.pt"
    ss_path = f"{root}/stagesave-bench.ckpt"
    plain = Timing("torch.save" + ("" if is_url(root) else " + fsync"))
    staged = Timing("stagesave")
    runs = args.warmup + args.repeat
    loop = TrainLoop() if args.loop else None
    if loop is not None:
        loop.baseline(0.2)  # warm its allocations and threads
    with env.progress("benchmarking", 2 * runs * nbytes) as advance, Checkpointer(
        storage_options=env.storage_options
    ) as ckpt:
        try:
            for i in range(runs):
                counted = i >= args.warmup
                baseline = loop.baseline() if loop is not None and counted else 0.0
                dt = _torch_save(env, state, torch_path)
                if counted:
                    plain.blocking_s.append(dt)
                    plain.durable_s.append(dt)
                    if loop is not None:  # synchronous: the loop cannot run until it returns
                        plain.add_loop(dt, 0.0, [], baseline)
                advance(nbytes)
                baseline = loop.baseline() if loop is not None and counted else 0.0
                t0 = time.perf_counter()
                handle = ckpt.save(state, ss_path)
                blocked = time.perf_counter() - t0
                steps: list[float] = []
                while loop is not None and counted and not handle.done():
                    steps.append(loop.step())
                window = time.perf_counter() - t0 - blocked
                handle.result()
                if counted:
                    staged.blocking_s.append(blocked)
                    # from save() to committed, as the handle measured it (not the loop's last step)
                    committed = handle.telemetry.time_to_commit_s
                    staged.durable_s.append(committed or time.perf_counter() - t0)
                    if loop is not None:
                        staged.add_loop(blocked, window, steps, baseline)
                advance(nbytes)
        finally:
            _remove(env, torch_path)
            try:
                ckpt.remove(ss_path).result()
            except Exception as exc:  # noqa: BLE001 - cleanup must not hide the benchmark's error
                env.err.print(f"note: could not remove {ss_path}: {exc}", markup=False)
    results = [plain.to_dict(nbytes), staged.to_dict(nbytes)]
    if args.json:
        env.print_json({"target": root, "state_bytes": nbytes, "results": results})
        return 0
    base = results[0]["blocking_s"]
    t = Table(title=f"{fmt_bytes(nbytes)} training state -> {root} (median of {args.repeat})",
              title_justify="left", header_style="bold")
    cols = ["method", "training blocked", "durable after", "throughput", "stall vs torch.save"]
    if loop is not None:
        cols += ["training lost", "step time while writing (mean/p99)"]
    for col in cols:
        t.add_column(col, justify="left" if col == "method" else "right")
    for r in results:
        row = [r["method"], fmt_duration(r["blocking_s"]), fmt_duration(r["durable_s"]),
               fmt_rate(r["throughput_bytes_per_s"]), f"{r['blocking_s'] / base:.2f}x" if base > 0 else "-"]
        if loop is not None:
            row += [fmt_duration(r["lost_s"]), f"{r['step_mean_x']:.2f}x / {r['step_p99_x']:.2f}x"]
        t.add_row(*row)
    env.out.print(t)
    if loop is not None:
        env.out.print(f"training loop: {results[1]['loop_ms_per_step']:.1f} ms per step at baseline, torch on "
                      f"{torch.get_num_threads()} threads; lost = blocked + what the loop lost while the write ran")
    return 0
