"""stagesave for PyTorch Lightning (``pip install 'stagesave[lightning]'``).

One plugin makes every checkpoint save cost training one copy into host memory; everything else
(``ModelCheckpoint``, ``ckpt_path="last"``, loggers, DDP, Fabric, LightningCLI) stays as it is::

    from stagesave.lightning import StagedCheckpointIO, latest

    trainer = Trainer(
        plugins=[StagedCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=dirpath, save_top_k=3, save_last=True)],
    )
    trainer.fit(model, ckpt_path=latest(dirpath))   # newest valid checkpoint, or from scratch
"""

from __future__ import annotations

from ._callback import CheckpointTelemetryLogger, telemetry_metrics
from ._plugin import LIGHTNING_SAFE_GLOBALS, StagedCheckpointIO, find_plugin
from ._resume import latest, wait

__all__ = [
    "LIGHTNING_SAFE_GLOBALS",
    "CheckpointTelemetryLogger",
    "StagedCheckpointIO",
    "find_plugin",
    "latest",
    "telemetry_metrics",
    "wait",
]
