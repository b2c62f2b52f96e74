"""Child: two-process DDP (gloo on CPU) training with the plugin, then a resume on both ranks.

Usage: ``python _child_ddp.py ROOT``. Lightning re-launches this script for rank 1. Each rank
writes ``ROOT/rank<N>.json``: how many saves its plugin wrote, where it resumed from, at which
step, and a fingerprint of the weights it restored.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import StepBatches, TinyModel
from stagesave.lightning import StagedCheckpointIO, latest

from stagesave import SaveTelemetry

SAVES: list[str] = []


def record(tel: SaveTelemetry) -> None:
    SAVES.append(tel.path)


class Restored(Callback):
    def __init__(self) -> None:
        self.step: int | None = None
        self.fingerprint: list[float] = []

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.step = trainer.global_step
        self.fingerprint = [float(p.double().sum()) for p in pl_module.parameters()]


def trainer(root: Path, io: StagedCheckpointIO, max_steps: int, *callbacks: Any) -> Trainer:
    mc = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=1, save_last=True)
    return Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=max_steps, plugins=[io],
                   callbacks=[mc, *callbacks], default_root_dir=str(root), logger=False,
                   enable_progress_bar=False, enable_model_summary=False, deterministic=True)


def main() -> None:
    root = Path(sys.argv[1])
    first = trainer(root, StagedCheckpointIO(telemetry_callback=record), 6)
    first.fit(TinyModel(), StepBatches())
    rank = first.global_rank
    saves_first_run = list(SAVES)

    resume = latest(root / "ckpt")
    restored = Restored()
    second = trainer(root, StagedCheckpointIO(), 8, restored)
    second.fit(TinyModel(), StepBatches(), ckpt_path=resume)
    (root / f"rank{rank}.json").write_text(json.dumps({
        "saves": saves_first_run, "resume": resume, "start_step": restored.step,
        "end_step": second.global_step, "fingerprint": restored.fingerprint,
    }))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
