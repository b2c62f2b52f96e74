"""The first save of a run: its staging buffer made before that save (once the resumed
checkpoint is loaded, or after the first optimizer step) against made by that save, for a
Lightning fit (``StagedCheckpointIO(prepare_buffer=...)``) or an Accelerate loop
(``stagesave.accelerate.enable(accelerator, prepare_buffer=...)``).

Usage::

    python benchmarks/bench_first_save_ahead.py --dir /work --layers 8 --width 2048 --rounds 3
    python benchmarks/bench_first_save_ahead.py --framework accelerate --fresh --dir /work ...

A model of ``--layers`` linear layers of ``--width`` x ``--width`` fp32 parameters, trained with
Adam (the checkpoint holds about 3x the parameter bytes), is trained for two steps and saved
(Lightning: ``ModelCheckpoint(every_n_train_steps=2)`` through ``StagedCheckpointIO``;
Accelerate: ``save_state()`` with automatic naming). Then, in rounds (alternating order), a
fresh process resumes from that checkpoint (``fit(ckpt_path=...)``, ``load_state(...)``) and
trains ``--every * --saves`` more steps, saving every ``--every`` (default 2): ``prepared`` is
``prepare_buffer=True``, ``not prepared`` ``prepare_buffer=False`` (what the default does on a
CPU-only run, and what every run did before). With ``--fresh`` the runs start afresh instead
(``--every * --saves`` steps; the buffer is made once the first optimizer step is taken). Each
process reports every save's blocking time (Lightning: its telemetry; Accelerate: the
``save_state`` call), the run's wall time and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

VARIANTS = ("prepared", "not prepared")


def _fit(folder: str, width: int, layers: int, steps: int, resume: str | None,
         prepared: bool, every: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from stagesave.lightning import StagedCheckpointIO
    from torch.utils.data import DataLoader

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = torch.nn.Sequential(
                *[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch: Any, _: int) -> Any:
            return self.body(batch).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return DataLoader(torch.randn(8 * 64, width), batch_size=8)  # type: ignore[arg-type]

    marks: dict[str, list[float]] = {"batch_end": []}

    class Mark(Callback):
        def on_train_start(self, *_: Any) -> None:
            marks["train_start"] = [time.perf_counter()]

        def on_train_batch_end(self, *_: Any) -> None:
            marks["batch_end"].append(time.perf_counter())

        def on_train_end(self, *_: Any) -> None:
            marks["train_end"] = [time.perf_counter()]

    plugin = StagedCheckpointIO(prepare_buffer=prepared)
    trainer = pl.Trainer(
        max_steps=steps, plugins=[plugin], logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1, max_epochs=1,
        callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=every, save_top_k=-1),
                   Mark()],
    )
    t0 = time.perf_counter()
    trainer.fit(Net(), ckpt_path=resume)
    wall = time.perf_counter() - t0
    tel = plugin.pop_telemetry()
    return {"blocking_s": [t.blocking_s for t in tel], "stage_s": [t.stage_s for t in tel],
            "buffer_wait_s": [t.buffer_wait_s for t in tel], "fit_s": wall,
            # fit() to the loop's start (the load), the loop (steps and saves), its end to return
            "to_train_s": marks["train_start"][0] - t0,
            "train_s": marks["train_end"][0] - marks["train_start"][0],
            "steps_s": [b - a for a, b in zip(marks["train_start"] + marks["batch_end"],
                                              marks["batch_end"])],
            "after_train_s": t0 + wall - marks["train_end"][0],
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _accelerate(folder: str, width: int, layers: int, steps: int, resume: str | None,
                prepared: bool, every: int) -> dict[str, Any]:
    import stagesave.accelerate as sa
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    t0 = time.perf_counter()
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=folder, automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    sa.enable(acc, prepare_buffer=prepared)
    if resume is not None:
        acc.load_state(resume)
        acc.project_configuration.iteration = 0  # this run's folders start at checkpoint_0
    t_train = time.perf_counter()
    blocking, steps_s = [], []
    batch = torch.randn(8, width)
    for step in range(2 if resume is not None else 0, steps):  # resumed after step 2
        s0 = time.perf_counter()
        loss = model(batch).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % every == 0:
            b0 = time.perf_counter()
            acc.save_state()
            blocking.append(time.perf_counter() - b0)
        steps_s.append(time.perf_counter() - s0)
    t_end = time.perf_counter()
    acc.end_training()
    wall = time.perf_counter() - t0
    return {"blocking_s": blocking, "fit_s": wall, "to_train_s": t_train - t0,
            "train_s": t_end - t_train, "steps_s": steps_s, "after_train_s": t0 + wall - t_end,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _child(args: argparse.Namespace) -> None:
    run = _fit if args.framework == "lightning" else _accelerate
    result = run(args.folder, args.width, args.layers, args.steps, args.resume,
                 args.variant == "prepared", args.every)
    print("RESULT " + json.dumps(result))


def _run(args: argparse.Namespace, folder: str, steps: int, resume: str | None,
         variant: str, every: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--folder", folder, "--width", str(args.width),
           "--layers", str(args.layers), "--steps", str(steps), "--variant", variant,
           "--every", str(every), "--framework", args.framework]
    if resume:
        cmd += ["--resume", resume]
    env = dict(os.environ)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])  # type: ignore[no-any-return]
    raise RuntimeError(f"{variant} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", choices=("lightning", "accelerate"), default="lightning")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--saves", type=int, default=3, help="saves per resumed fit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--every", type=int, default=2, help="save every this many steps")
    p.add_argument("--fresh", action="store_true",
                   help="fits that start afresh (the buffer made after the first step) instead "
                        "of resumed ones")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--resume", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    base = tempfile.mkdtemp(prefix="first-save-", dir=args.dir)
    try:
        start = os.path.join(base, "start")
        _run(args, start, 2, None, "prepared", 2)
        if args.framework == "lightning":
            resume = os.path.join(start, "epoch=0-step=2.ckpt")
            size = os.path.getsize(resume)
        else:
            resume = os.path.join(start, "checkpoints", "checkpoint_0")
            size = sum(os.path.getsize(os.path.join(resume, n)) for n in os.listdir(resume))
        print(f"resuming from {resume}: {size / 2**20:.0f} MiB")
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                folder = os.path.join(base, f"r{r}-{variant.replace(' ', '-')}")
                steps = args.every * args.saves
                got = (_run(args, folder, steps, None, variant, args.every) if args.fresh
                       else _run(args, folder, 2 + steps, resume, variant, args.every))
                shutil.rmtree(folder, ignore_errors=True)
                runs[variant].append(got)
                print(f"round {r} {variant:>13}: blocking "
                      + ", ".join(f"{b * 1e3:.0f}" for b in got["blocking_s"])
                      + f" ms; fit {got['fit_s']:.2f} s (load {got['to_train_s']:.2f}, loop "
                      f"{got['train_s']:.2f}, end {got['after_train_s']:.2f}); steps "
                      + ", ".join(f"{x:.2f}" for x in got["steps_s"])
                      + f" s; peak RSS {got['peak_rss_gib']:.2f} GiB",
                      flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n| variant | first save blocking ms | later saves ms | first ÷ later | fit s | "
          "peak RSS GiB |\n|---|---|---|---|---|---|")
    summary = {}
    for variant, got in runs.items():
        first = statistics.median(g["blocking_s"][0] for g in got) * 1e3
        later = statistics.median(b for g in got for b in g["blocking_s"][1:]) * 1e3
        fit = statistics.median(g["fit_s"] for g in got)
        rss = statistics.median(g["peak_rss_gib"] for g in got)
        summary[variant] = {"first_ms": first, "later_ms": later, "fit_s": fit, "rss_gib": rss}
        print(f"| {variant} | {first:.0f} | {later:.0f} | {first / later:.2f} | {fit:.2f} | "
              f"{rss:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
