"""A Lightning training run with frequent checkpoints, side by side for each CheckpointIO.

The same ``Trainer.fit`` (same model, data, steps, ``ModelCheckpoint(every_n_train_steps=...)``)
runs once per mode, each in a fresh process:

- ``none``: ``enable_checkpointing=False`` (the reference wall time);
- ``torch``: Lightning's default ``TorchCheckpointIO`` (synchronous ``torch.save``);
- ``async``: Lightning's ``AsyncCheckpointIO`` around ``TorchCheckpointIO``;
- ``staged``: ``stagesave.lightning.StagedCheckpointIO()`` (defaults);
- ``staged-hash-in-staging``: the same with ``checksum_in="staging"``.

The module is a small MLP that keeps every core busy (torch's default threads) plus a large
frozen block of persistent buffers, so that the checkpoint holds ``--state-gib`` GiB while a
step stays short: the state a fine-tuning run with a frozen backbone saves. Reported per mode:

- per-save blocking: how long ``save_checkpoint`` held the training loop (median and max);
- training time lost per save: (wall time of the run - wall time of ``none``) / saves; this is
  the blocking plus the throughput the loop lost while background writes ran, plus the final
  flush at teardown (every run ends with all its checkpoints durable);
- the same, estimated within each run: (sum of step times - steps x the run's median step +
  the final flush) / saves. It does not depend on the ``none`` run, so it survives machine load
  that changes between runs; for ``none`` the column shows the noise floor;
- total wall time, and its ratio to ``none``;
- p99 step time over the run, relative to the median step of ``none``.

Modes run in interleaved rounds (``--repeats``), the wall times are medians over the rounds.

Usage::

    python benchmarks/bench_lightning.py --state-gib 2 --steps 200 --every 20 --repeats 3   # full
    size
    python benchmarks/bench_lightning.py --state-gib 0.25 --steps 40 --every 10 --repeats 1  # smoke

Checkpoints go to a temporary directory under ``--dir`` (default: the system temp dir) that is
removed afterwards; ``--markdown FILE`` appends the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("none", "torch", "async", "staged", "staged-hash-in-staging")


# ----------------------------------------------------------------------------- one run (child)


def run_one(mode: str, args: argparse.Namespace, out: Path) -> None:
    import torch
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from stagesave.lightning import StagedCheckpointIO
    from torch import nn

    class Timed(CheckpointIO):
        """Times the caller's side of each save; everything else goes straight through."""

        def __init__(self, inner: CheckpointIO) -> None:
            self.inner = inner
            self.blocking: list[float] = []

        def save_checkpoint(
            self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
        ) -> None:
            t0 = time.perf_counter()
            self.inner.save_checkpoint(checkpoint, path, storage_options)
            self.blocking.append(time.perf_counter() - t0)

        def load_checkpoint(
            self, path: Any, map_location: Any = None, weights_only: Any = None
        ) -> Any:
            return self.inner.load_checkpoint(path, map_location, weights_only)

        def remove_checkpoint(self, path: Any) -> None:
            self.inner.remove_checkpoint(path)

        def teardown(self) -> None:
            t0 = time.perf_counter()
            self.inner.teardown()
            self.teardown_s = time.perf_counter() - t0

    class Bench(LightningModule):
        def __init__(self, state_bytes: int, hidden: int, batch: int) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(hidden, hidden),
                nn.GELU(),
                nn.Linear(hidden, hidden),
                nn.GELU(),
                nn.Linear(hidden, hidden),
            )
            self.x = torch.randn(batch, hidden)
            chunk = 64 * 2**20 // 4
            # + Adam moments
            left = max(0, state_bytes - sum(p.numel() * 4 for p in self.parameters()) * 3)
            g = torch.Generator().manual_seed(0)
            i = 0
            while left > 0:  # the frozen block: in the checkpoint, not in the compute
                n = min(chunk, left // 4)
                self.register_buffer(f"frozen_{i}", torch.randn(n, generator=g))
                left -= n * 4
                i += 1

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(self.x).square().mean()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.net.parameters(), lr=1e-5)

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.t: float | None = None

        def on_train_batch_start(self, *a: Any) -> None:
            now = time.perf_counter()
            if self.t is not None:
                self.times.append(now - self.t)  # includes the save made at the previous batch end
            self.t = now

        def on_train_end(self, *a: Any) -> None:  # the last step, with the save at its end
            if self.t is not None:
                self.times.append(time.perf_counter() - self.t)

    seed_everything(0, verbose=False)
    model = Bench(int(args.state_gib * 2**30), args.hidden, args.batch)
    workdir = Path(tempfile.mkdtemp(prefix="bench-lightning-", dir=args.dir))
    io: Timed | None = None
    plugins: list[Any] = []
    if mode != "none":
        inner: CheckpointIO
        if mode == "torch":
            inner = TorchCheckpointIO()
        elif mode == "async":
            inner = AsyncCheckpointIO(TorchCheckpointIO())
        else:
            inner = StagedCheckpointIO(
                checksum_in="staging" if mode == "staged-hash-in-staging" else "background"
            )
        io = Timed(inner)
        plugins = [io]
    steps = StepTimes()
    callbacks: list[Any] = [steps]
    if mode != "none":
        callbacks.append(
            ModelCheckpoint(dirpath=workdir, every_n_train_steps=args.every, save_top_k=1)
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        plugins=plugins or None,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=mode != "none",
        num_sanity_val_steps=0,
    )
    loader = [0] * args.steps
    try:
        t0 = time.perf_counter()
        trainer.fit(model, loader)
        wall = time.perf_counter() - t0
        size = max((p.stat().st_size for p in workdir.glob("*.ckpt")), default=0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out.write_text(json.dumps({
        "mode": mode, "wall_s": wall, "steps": steps.times,
        "blocking": io.blocking if io else [], "teardown_s": getattr(io, "teardown_s", 0.0),
        "checkpoint_bytes": size, "threads": torch.get_num_threads(),
    }))


# ----------------------------------------------------------------------------- orchestration


def excess_s(run: dict[str, Any]) -> float:
    """Training time this run lost against its own typical step: the sum over all steps of
    (step - median step), plus the final flush. Robust to load that drifts between runs (the
    wall-time difference is not); for ``none`` it is the noise floor."""
    steps = run["steps"]
    return float(sum(steps) - len(steps) * statistics.median(steps) + run["teardown_s"])


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median wall time over the rounds; per-save and per-step samples of all rounds."""
    return {
        "excess_s": statistics.median(excess_s(r) for r in runs),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "blocking": [b for r in runs for b in r["blocking"]],
        "saves": statistics.median(len(r["blocking"]) for r in runs),
        "steps": [t for r in runs for t in r["steps"]],
        "checkpoint_bytes": max(r["checkpoint_bytes"] for r in runs),
        "teardown_s": statistics.median(r["teardown_s"] for r in runs),
        "threads": runs[0]["threads"],
    }


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def table(results: dict[str, dict[str, Any]]) -> str:
    base = results["none"]
    base_step = statistics.median(base["steps"])
    lines = [
        (
            "| mode | saves | blocking per save, median (max) | training time lost per save | "
            "same, in-run estimate | total wall time | vs no checkpoints | p99 step / median step "
            "(none) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    n_saves = max(r["saves"] for r in results.values())
    for mode, r in results.items():
        n = r["saves"]
        lost = (r["wall_s"] - base["wall_s"]) / n if n else 0.0
        blocking = (
            f"{statistics.median(r['blocking']):.3f} s ({max(r['blocking']):.3f})" if n else "-"
        )
        in_run = r["excess_s"] / (n or n_saves)  # none: its noise, spread over as many saves
        lines.append(
            f"| {mode} | {n:g} | {blocking} | {lost:.3f} s | {in_run:.3f} s | {r['wall_s']:.2f} s "
            f"| {r['wall_s'] / base['wall_s']:.2f}x | {pct(r['steps'], 0.99) / base_step:.1f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--state-gib", type=float, default=2.0, help="checkpoint size in GiB")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    ap.add_argument("--hidden", type=int, default=1536, help="width of the MLP doing the compute")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median wall time)")
    ap.add_argument(
        "--dir", default=None, help="where the checkpoints are written (a temp dir inside)"
    )
    ap.add_argument(
        "--markdown", type=Path, default=None, help="append the results table to this file"
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_one(args.child, args, args.out)
        return 0

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if "none" not in modes:
        modes.insert(0, "none")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        # Interleaved rounds, so that a change of machine load hits every mode alike.
        for rnd in range(args.repeats):
            for mode in modes:
                out = Path(tmp) / f"{mode}-{rnd}.json"
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    mode,
                    "--out",
                    str(out),
                    "--state-gib",
                    str(args.state_gib),
                    "--steps",
                    str(args.steps),
                    "--every",
                    str(args.every),
                    "--hidden",
                    str(args.hidden),
                    "--batch",
                    str(args.batch),
                ]
                cmd += ["--dir", args.dir] if args.dir else []
                print(f"round {rnd + 1}/{args.repeats}: {mode} ...", end=" ", flush=True)
                proc = subprocess.run(
                    cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False
                )
                if proc.returncode != 0:
                    print(f"failed:\n{proc.stderr[-4000:]}", file=sys.stderr)
                    raise SystemExit(
                        f"bench_lightning: the {mode} run failed (exit {proc.returncode})"
                    )
                r = json.loads(out.read_text())
                runs[mode].append(r)
                print(f"wall {r['wall_s']:.2f} s, {len(r['blocking'])} saves", flush=True)
    results = {m: aggregate(rs) for m, rs in runs.items()}
    size = max(r["checkpoint_bytes"] for r in results.values())
    header = (
        f"`{' '.join(['python', 'benchmarks/bench_lightning.py'] + sys.argv[1:])}` on "
        f"{platform.node()} ({os.cpu_count()} CPUs, torch threads {results['none']['threads']}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}): {args.steps} steps, a checkpoint every {args.every} "
        f"steps, median of {args.repeats} interleaved rounds, "
        f"{size / 2**30:.2f} GiB per checkpoint, median step without checkpoints "
        f"{1000 * statistics.median(results['none']['steps']):.1f} ms."
    )
    text = f"{header}\n\n{table(results)}\n"
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
