"""stagesave for PyTorch Lightning (``pip install 'stagesave[lightning]'``).

One plugin makes every checkpoint save cost training one copy into host memory; everything else
(``ModelCheckpoint``, ``ckpt_path="last"``, loggers, DDP, Fabric, LightningCLI) stays as it is::

    from stagesave.lightning import StagedCheckpointIO, latest

    trainer = Trainer(
        plugins=[StagedCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=dirpath, save_top_k=3, save_last=True)],
    )
    trainer.fit(model, ckpt_path=latest(dirpath))   # newest valid checkpoint, or from scratch

Sharded checkpoints (FSDP ``state_dict_type="sharded"``, ``ModelParallelStrategy``) bypass
``CheckpointIO`` in Lightning; swap the strategy for :class:`StagedFSDPStrategy` or
:class:`StagedModelParallelStrategy` (same arguments, the plugin included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._callback import CheckpointTelemetryLogger, telemetry_metrics
from ._options import LIGHTNING_SAFE_GLOBALS
from ._plugin import StagedCheckpointIO, find_plugin
from ._resume import latest, wait

if TYPE_CHECKING:
    from ._strategies import StagedFSDPStrategy, StagedModelParallelStrategy

__all__ = [
    "LIGHTNING_SAFE_GLOBALS",
    "CheckpointTelemetryLogger",
    "StagedCheckpointIO",
    "StagedFSDPStrategy",
    "StagedModelParallelStrategy",
    "find_plugin",
    "latest",
    "telemetry_metrics",
    "wait",
]


def __getattr__(name: str) -> Any:
    # The sharded strategies pull in torch.distributed.checkpoint and stagesave.dcp: imported on
    # first use, so the plugin alone stays a light import.
    if name in ("StagedFSDPStrategy", "StagedModelParallelStrategy"):
        from . import _strategies

        return getattr(_strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
