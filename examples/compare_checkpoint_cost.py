"""What checkpointing costs the same training: Lightning's default IO against stagesave.

The same Lightning training of a wide MLP with Adam (weights plus two moments: ``--state-gib``
of checkpointed state, 0.6 GiB by default) runs several times, each in a fresh process, with the
same seed, the same batches and the same steps:

* ``none``: no checkpoints at all, the baseline (the spread of its runs is the noise of this
  machine, which the table prints: other processes taking the cores show there);
* ``TorchCheckpointIO``: Lightning's default IO, ``torch.save`` on the training thread;
* ``StagedCheckpointIO``: stagesave, which returns after a copy into host memory and writes,
  checksums and commits in the background.

Both IOs save through the same ``ModelCheckpoint(every_n_train_steps=...)``, every ``--every``
steps, ``--saves`` times, into a new folder of ``--dir`` (keeping the newest file only; the
folder is removed after the run unless ``--keep``). The figures:

* **blocked per save**: time inside ``save_checkpoint`` (for stagesave its telemetry's
  ``blocking_s``; for TorchCheckpointIO the call timed by a wrapper);
* **lost per save**: ``(fit time with saves - fit time without) / saves``: what the saves cost
  the training in wall time, whatever the cause (the blocking call, background threads taking
  cores from the training, the final wait for the last commit when ``fit`` ends).

Each IO runs ``--rounds`` times (3) and the baseline once more, interleaved (none, torch,
stagesave, none, torch, stagesave, ..., none); the table shows each kind's fastest run, as other
processes on the machine can only slow a run down.

TorchCheckpointIO returns when the bytes are in the page cache (it does not fsync), so its files
are not yet durable when training resumes; stagesave's commit includes the fsync. Dirty pages
are flushed (``os.sync``) between runs so that one run's writeback does not slow the next.

Run::

    python examples/compare_checkpoint_cost.py --dir runs/cost       # 1.5-3 minutes on 2 CPU cores
    python examples/compare_checkpoint_cost.py --dir /tmp/c --state-gib 0.01 --saves 2 --every 2

The table ends with a ``result:`` JSON line holding every figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from stagesave.lightning import StagedCheckpointIO
from torch import nn

from stagesave import SaveTelemetry

warnings.filterwarnings("ignore", module=r"lightning\.")
warnings.filterwarnings("ignore", category=DeprecationWarning)

LABELS = {
    "none": "no checkpoints",
    "torch": "TorchCheckpointIO (Lightning's default)",
    "stagesave": "StagedCheckpointIO (stagesave)",
}
#: Bytes of checkpointed state per parameter: fp32 weight and Adam's two fp32 moments.
STATE_BYTES_PER_PARAM = 12


class WideMLP(LightningModule):
    """``layers`` square linear layers of ``width``, trained with Adam to map inputs to targets."""

    def __init__(self, width: int, layers: int, lr: float = 1e-4) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Batches:
    """``steps`` fixed batches, one epoch: every run sees the same data in the same order."""

    def __init__(self, steps: int, batch: int, width: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.batches = [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
                        for _ in range(steps)]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.batches)


class StepClock(Callback):
    """When each training step started (the time between two includes a save made between them)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


class TimedTorchCheckpointIO(TorchCheckpointIO):
    """Lightning's default IO, unchanged, with each ``save_checkpoint`` call timed."""

    def __init__(self) -> None:
        super().__init__()
        self.blocking: list[float] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        t0 = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        self.blocking.append(time.perf_counter() - t0)


def shape_for(state_gib: float, layers: int) -> int:
    """The width whose ``layers`` square layers (with Adam) hold about ``state_gib`` of state."""
    params = state_gib * 2**30 / STATE_BYTES_PER_PARAM
    return max(16, round(math.sqrt(params / layers) / 16) * 16)


def weights_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- one run


def run_one(kind: str, args: argparse.Namespace, dirpath: str) -> dict[str, Any]:
    """Train once with ``kind`` of checkpointing, saving into ``dirpath``; the figures of that run."""
    seed_everything(args.seed, verbose=False)
    width = shape_for(args.state_gib, args.layers)
    steps = (args.saves + 1) * args.every - 1  # saves at every, 2*every, ...; then every-1 more steps
    data = Batches(steps, args.batch_size, width, args.seed)
    model = WideMLP(width, args.layers)

    telemetry: list[SaveTelemetry] = []
    plugins: list[Any] = []
    clock = StepClock()
    callbacks: list[Any] = [clock]
    io: TimedTorchCheckpointIO | StagedCheckpointIO | None = None
    if kind == "torch":
        io = TimedTorchCheckpointIO()
    elif kind == "stagesave":
        io = StagedCheckpointIO(telemetry_callback=telemetry.append)
    if io is not None:
        plugins.append(io)
        callbacks.append(ModelCheckpoint(dirpath=dirpath, filename="{step:05d}",
                                         every_n_train_steps=args.every, save_top_k=1, monitor="step",
                                         mode="max"))
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=plugins, callbacks=callbacks,
        enable_checkpointing=io is not None, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=args.dir,
    )
    t0 = time.perf_counter()
    trainer.fit(model, data)  # for stagesave, fit returns once the last save is committed
    fit_s = time.perf_counter() - t0

    if isinstance(io, TimedTorchCheckpointIO):
        blocking = io.blocking
    else:
        blocking = [t.blocking_s for t in telemetry]
        failed = [t.error or "not committed" for t in telemetry if t.error or not t.committed_at]
        if failed:
            raise RuntimeError(f"a stagesave save failed: {failed[0]}")
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "kind": kind, "fit_s": fit_s, "steps": trainer.global_step, "saves": len(blocking),
        "blocking_s": blocking, "width": width, "state_bytes": n_params * STATE_BYTES_PER_PARAM,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_intervals_s": [b - a for a, b in zip(clock.starts, clock.starts[1:])],
        "weights_sha256": weights_sha256(model),
    }


# ----------------------------------------------------------------------------- the comparison


def available_memory() -> int | None:
    """Bytes of memory available to a new process (Linux ``MemAvailable``), or ``None``."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _run_in_child(kind: str, args: argparse.Namespace, dirpath: str, conn: Connection) -> None:
    # Lightning's banner and warnings go to a file, shown only if the run fails.
    with tempfile.TemporaryFile("w+") as log:
        sys.stdout.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            conn.send(("ok", run_one(kind, args, dirpath)))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            sys.stdout.flush()
            log.seek(0)
            conn.send(("error", log.read()[-3000:] + traceback.format_exc()))


def in_fresh_process(kind: str, args: argparse.Namespace, dirpath: str) -> dict[str, Any]:
    """:func:`run_one` in a new process: forked from this one, which has imported torch and
    Lightning but run nothing, so no run inherits threads, buffers or caches from an earlier one."""
    os.sync()  # the previous run's dirty pages are written now, not during this run
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_in_child, args=(kind, args, dirpath, send))
    proc.start()
    send.close()
    try:
        status, payload = receive.recv()
    except EOFError:
        status, payload = "error", "the process ended without a result (killed for memory?)"
    proc.join()
    if status != "ok":
        sys.stderr.write(f"{payload}\n")
        raise SystemExit(f"compare_checkpoint_cost: the {kind!r} run failed (exit {proc.exitcode})")
    if kind != "none" and payload["saves"] != args.saves:
        raise SystemExit(f"compare_checkpoint_cost: the {kind!r} run made {payload['saves']} saves, "
                         f"not {args.saves}")
    return payload  # type: ignore[no-any-return]


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def _median(values: list[float]) -> float:
    s = sorted(values)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def run_order(rounds: int) -> list[str]:
    """Baseline, then each IO, ``rounds`` times; then the baseline once more."""
    return [*(kind for _ in range(rounds) for kind in ("none", "torch", "stagesave")), "none"]


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Every run of :func:`run_order`, then the table; returns the figures."""
    width = shape_for(args.state_gib, args.layers)
    state = args.layers * (width * width + width) * STATE_BYTES_PER_PARAM
    print(f"checkpoint cost: a {args.layers}-layer MLP of width {width} with Adam, "
          f"{state / 2**30:.2f} GiB of model + optimizer state, {(args.saves + 1) * args.every - 1} steps, "
          f"a save every {args.every} steps ({args.saves} saves), checkpoints in {args.dir}", flush=True)
    # Peak of one run: weights, gradients and Adam's moments (16 bytes a parameter), plus either
    # TorchCheckpointIO's in-memory copy of the file or stagesave's two staging buffers.
    need = 4 * state + 2**30
    free = available_memory()
    if free is not None and free < need:
        raise SystemExit(f"compare_checkpoint_cost: a run needs about {need / 2**30:.1f} GiB of memory and "
                         f"{free / 2**30:.1f} GiB is available; try a smaller --state-gib")
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores / 2:
        print(f"  (load average {load:.1f} on {cores} cores: other processes share the CPU, so the "
              "timings will be noisy)", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in LABELS}
    weights = set()
    try:
        for i, kind in enumerate(run_order(args.rounds), 1):
            dirpath = os.path.join(args.dir, f"{i}-{kind}")
            r = in_fresh_process(kind, args, dirpath)
            if not args.keep:  # each run starts with an empty disk of its own
                shutil.rmtree(dirpath, ignore_errors=True)
            runs[kind].append(r)
            weights.add(r["weights_sha256"])
            print(f"  {LABELS[kind]:40s} fit {r['fit_s']:6.2f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)

    # Other processes can only slow a run down: the fastest run of each kind is the least noisy.
    baselines = [r["fit_s"] for r in runs["none"]]
    base = min(baselines)
    noise = max(baselines) - min(baselines)
    rows: dict[str, dict[str, Any]] = {
        "none": {"fit_s": base, "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs["none"])}}
    for kind in ("torch", "stagesave"):
        fit = min(r["fit_s"] for r in runs[kind])
        saves = runs[kind][0]["saves"]
        rows[kind] = {
            "fit_s": fit, "saves": saves,
            "blocking_per_save_s": _median([b for r in runs[kind] for b in r["blocking_s"]]),
            "lost_total_s": fit - base, "lost_per_save_s": (fit - base) / saves,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs[kind]),
        }

    head = (f"{'checkpointing':40s} {'blocked/save':>12s} {'lost/save':>10s} {'total lost':>10s} "
            f"{'fit':>8s} {'peak RSS':>9s}")
    print()
    print(head)
    print("-" * len(head))
    for kind in ("none", "torch", "stagesave"):
        row = rows[kind]
        blocked, per, total = (row.get(k) for k in ("blocking_per_save_s", "lost_per_save_s", "lost_total_s"))
        print(f"{LABELS[kind]:40s} {_fmt_s(blocked):>12s} {_fmt_s(per):>10s} {_fmt_s(total):>10s} "
              f"{_fmt_s(row['fit_s']):>8s} {row['peak_rss_bytes'] / 2**30:>5.2f} GiB")
    print()
    print(f"fit: the fastest of each kind's runs (other processes only ever add time). blocked/save: median "
          "time inside save_checkpoint. lost: fit time with the saves minus fit time without. The runs "
          f"without checkpoints took {', '.join(f'{b:.2f}' for b in baselines)} s: their spread, "
          f"{noise:.2f} s, is this machine's noise")
    torch_lost, ours_lost = rows["torch"]["lost_total_s"], rows["stagesave"]["lost_total_s"]
    ratio: float | None = None
    saves = rows["torch"]["saves"]
    if ours_lost > 0:
        ratio = torch_lost / ours_lost
        print(f"ratio: TorchCheckpointIO cost the training {ratio:.1f}x the time stagesave cost it "
              f"({torch_lost:.2f} s vs {ours_lost:.2f} s over {saves} saves)"
              + (f"; stagesave's figure is within the noise ({noise:.2f} s), so this ratio is rough"
                 if ours_lost <= noise else ""))
    else:
        print(f"ratio: not measurable here: stagesave's loss ({ours_lost:.2f} s) is below the noise "
              f"({noise:.2f} s); TorchCheckpointIO lost {torch_lost:.2f} s over {saves} saves")
    blocked_ratio = rows["torch"]["blocking_per_save_s"] / max(rows["stagesave"]["blocking_per_save_s"], 1e-9)
    print(f"blocked: TorchCheckpointIO held the training loop {blocked_ratio:.1f}x as long per save as stagesave")
    same = len(weights) == 1
    print("same final weights in every run: " + ("yes" if same else "NO (the runs did not train alike)"))
    summary = {"state_bytes": state, "width": width, "layers": args.layers, "saves": args.saves,
               "every": args.every, "rounds": args.rounds, "baseline_fit_s": baselines, "noise_s": noise,
               "rows": rows, "ratio_lost": ratio, "ratio_blocked": blocked_ratio, "same_weights": same}
    print(f"result: {json.dumps(summary)}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="runs/checkpoint-cost",
                   help="where the checkpoints go (removed at the end unless --keep); a local folder")
    p.add_argument("--state-gib", type=float, default=0.6, help="model + Adam state to checkpoint, GiB")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--every", type=int, default=3, help="steps between saves")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of each IO (the fastest is reported); the baseline runs rounds + 1 times")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = p.parse_args(argv)
    if min(args.saves, args.every, args.layers, args.rounds) < 1 or args.state_gib <= 0:
        p.error("--saves, --every, --layers, --rounds and --state-gib must be positive")
    args.dir = os.path.abspath(args.dir)
    if Path(args.dir).exists():
        p.error(f"{args.dir} exists: give an empty or new --dir (this script removes it at the end)")
    compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
