"""Child: a Fabric loop gets SIGTERM while checkpoint writes are pending on slow storage.

Usage: ``python _child_fabric_sigterm.py ROOT``. Fabric never calls ``CheckpointIO.teardown``
and installs no SIGTERM handler, so the script calls ``stagesave.flush_on_sigterm`` once, as the
docs tell Fabric users to. Each save's write is slowed by a telemetry consumer that takes half a
second (slow storage); after five saves the process sends itself SIGTERM. The handler lets the
pending saves commit, then the process dies of SIGTERM as it would have.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning_helpers import StepBatches
from stagesave.lightning import StagedCheckpointIO

import stagesave
from stagesave import SaveTelemetry


def slow_storage(tel: SaveTelemetry) -> None:
    time.sleep(0.5)


def main() -> None:
    root = Path(sys.argv[1])
    stagesave.flush_on_sigterm(timeout=60)
    io = StagedCheckpointIO(telemetry_callback=slow_storage, max_pending=8)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    for step, (x, y) in enumerate(StepBatches(n=5)):
        opt.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        fabric.save(root / f"step={step}.ckpt", {"model": model, "optimizer": opt, "step": step})
    print(f"pending at SIGTERM: {io.pending()}", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
    print("SIGTERM did not end the process", flush=True)


if __name__ == "__main__":
    main()
