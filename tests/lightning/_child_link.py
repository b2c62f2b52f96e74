"""Child process: train with ``save_last="link"`` and SIGKILL itself while a link update is pending.

Usage: ``python _child_link.py {async,staged} ROOT``. Checkpoints go to ``ROOT/ckpt`` every two
steps (top-1). AsyncCheckpointIO: its TorchCheckpointIO holds the step-4 save on an event. The
plugin: a slow telemetry consumer holds its writer thread once the step-4 save committed, so the
link update to step 4 (an ordered step behind that save) waits. At the start of step 6 the
process kills itself with SIGKILL, after ModelCheckpoint has asked to move ``last.ckpt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_helpers import HeldCheckpointIO, StepBatches, TinyModel, make_trainer
from stagesave.lightning import StagedCheckpointIO

from stagesave import SaveTelemetry

first_committed = threading.Event()


def hold_writer_after_first(tel: SaveTelemetry) -> None:
    if first_committed.is_set():
        time.sleep(3600)
    first_committed.set()


class KillWhilePending(Callback):
    def __init__(self, d: Path, held: HeldCheckpointIO | None) -> None:
        self.d = d
        self.held = held

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        # let the step-2 save (and link) finish, as a slower step would
        if trainer.global_step == 3:
            while not ((first_committed.is_set() and (self.d / "last.ckpt").exists())
                       or (self.held and self.held.written)):
                time.sleep(0.01)
        if trainer.global_step == 5:
            last = self.d / "last.ckpt"
            print(json.dumps({"last": os.readlink(last) if last.is_symlink() else None,
                              "files": sorted(os.listdir(self.d))}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    d = root / "ckpt"
    d.mkdir(parents=True)  # else AsyncCheckpointIO's link can fail outright (tested separately)
    io: Any
    held = None
    if mode == "async":
        held = HeldCheckpointIO(hold_after=1)
        io = AsyncCheckpointIO(held)
    else:
        io = StagedCheckpointIO(telemetry_callback=hold_writer_after_first, max_pending=8)
    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=1, save_last="link")
    make_trainer(root, [io], [mc, KillWhilePending(d, held)], max_steps=10).fit(
        TinyModel(), StepBatches()
    )
    print("not killed", flush=True)


if __name__ == "__main__":
    main()
