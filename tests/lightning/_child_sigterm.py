"""Child: SIGTERM arrives while checkpoint writes are pending on slow storage.

Usage: ``python _child_sigterm.py ROOT``. Every step is checkpointed; after the first commit
each further write is slowed by a telemetry consumer that takes one second (slow storage). Before
step 5 the process receives SIGTERM. Lightning stops at the batch end and tears
down; the plugin must commit every submitted checkpoint before the process exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import StepBatches, TinyModel, make_trainer
from stagesave.lightning import StagedCheckpointIO

from stagesave import SaveTelemetry


def slow_storage(tel: SaveTelemetry) -> None:
    time.sleep(1.0)


class Terminate(Callback):
    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == 4:
            print("sending SIGTERM", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    root = Path(sys.argv[1])
    io = StagedCheckpointIO(telemetry_callback=slow_storage, max_pending=8)
    mc = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1)
    make_trainer(root, [io], [mc, Terminate()], max_steps=100).fit(TinyModel(), StepBatches(n=50))
    print("fit returned", flush=True)


if __name__ == "__main__":
    main()
