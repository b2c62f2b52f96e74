"""Child process: train with ``save_last="link"`` and SIGKILL itself while a save is pending.

Usage: ``python _child_link.py {async,staged} ROOT``. Checkpoints go to ``ROOT/ckpt`` every two
steps (top-1); the save at step 4 is held (AsyncCheckpointIO: its TorchCheckpointIO waits on an
event; the plugin: its writer thread is held by a slow telemetry consumer), and at the start of
step 6 the process kills itself with SIGKILL, after ModelCheckpoint has moved ``last.ckpt``.
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

from conftest import HeldCheckpointIO, StepBatches, TinyModel, make_trainer
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from stagesave.lightning import StagedCheckpointIO

from stagesave import SaveTelemetry

first_committed = threading.Event()


def hold_writer_forever(tel: SaveTelemetry) -> None:
    first_committed.set()
    time.sleep(3600)


class KillWhilePending(Callback):
    def __init__(self, d: Path, held: HeldCheckpointIO | None) -> None:
        self.d = d
        self.held = held

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == 3:  # let the step-2 save finish, as a slower step would
            while not (first_committed.is_set() or (self.held and self.held.written)):
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
        io = StagedCheckpointIO(telemetry_callback=hold_writer_forever, max_pending=8)
    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=1, save_last="link")
    make_trainer(root, [io], [mc, KillWhilePending(d, held)], max_steps=10).fit(TinyModel(), StepBatches())
    print("not killed", flush=True)


if __name__ == "__main__":
    main()
