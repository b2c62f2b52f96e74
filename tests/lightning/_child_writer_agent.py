"""Child: a real ``Trainer`` saving through a writer agent, SIGKILLed right after a save returns.

Usage: ``python _child_writer_agent.py ROOT KILL_AFTER``. ``ModelCheckpoint`` saves every step
into ``ROOT/ckpt`` through :class:`KillAfter` (``writer="process"`` unless ``$STAGESAVE_WRITER``
chooses it). Each checkpoint carries an 8 MiB ``marker`` tensor filled with its step, so the
agent is still writing when the trainer dies. Before each save the model's weights are written
to ``ROOT/expected/step=<n>.pt`` with plain ``torch.save`` (what the checkpoint must hold); once
a save returns the child prints ``SAVED <step> <agent pid> <path>``; after the ``KILL_AFTER``-th
it SIGKILLs itself at once.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import StepBatches, TinyModel, make_trainer
from stagesave.lightning import StagedCheckpointIO

#: Elements of the marker tensor (float32: 8 MiB).
MARKER = 1 << 21


class MarkedModel(TinyModel):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["marker"] = torch.full((MARKER,), float(self.global_step))


class KillAfter(StagedCheckpointIO):
    """The plugin, SIGKILLing this process right after its ``kill_after``-th save returned."""

    def __init__(self, root: Path, kill_after: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.expected = root / "expected"
        self.expected.mkdir(parents=True, exist_ok=True)
        self.kill_after = kill_after
        self.saves = 0

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        step = checkpoint["global_step"]
        torch.save(checkpoint["state_dict"], self.expected / f"step={step}.pt")
        super().save_checkpoint(checkpoint, path, storage_options)
        self.saves += 1
        agent = self.checkpointer.writer.agent
        pid = agent.pid if agent is not None else None
        print(f"SAVED {step} {pid} {os.fspath(path)}", flush=True)
        if self.saves == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    root, kill_after = Path(sys.argv[1]), int(sys.argv[2])
    # $STAGESAVE_WRITER=process chooses the agent when the plugin leaves writer unset
    kw = {} if os.environ.get("STAGESAVE_WRITER") else {"writer": "process"}
    io = KillAfter(root, kill_after, **kw)
    mc = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1)
    make_trainer(root, [io], [mc], max_steps=100).fit(MarkedModel(), StepBatches(n=50))
    print("fit returned", flush=True)


if __name__ == "__main__":
    main()
