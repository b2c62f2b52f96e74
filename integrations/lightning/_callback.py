"""Save telemetry in the Trainer's loggers.

Telemetry arrives on the writer thread, where loggers must not be called (most are not
thread-safe, and a logger may run torch ops). The plugin keeps it; this callback hands it to the
loggers on the training thread, at batch ends and once more after the final flush.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from stagesave import SaveTelemetry

from ._plugin import StagedCheckpointIO, find_plugin

__all__ = ["CheckpointTelemetryLogger", "telemetry_metrics"]


def telemetry_metrics(tel: SaveTelemetry, prefix: str = "checkpoint/") -> dict[str, float]:
    """The numbers of one save, as logger metrics."""
    return {
        f"{prefix}blocking_s": tel.blocking_s,
        f"{prefix}stage_s": tel.stage_s,
        f"{prefix}buffer_wait_s": tel.buffer_wait_s,
        f"{prefix}write_s": tel.write_s,
        f"{prefix}time_to_commit_s": tel.time_to_commit_s,
        f"{prefix}bytes": float(tel.bytes),
        f"{prefix}throughput_MBps": tel.throughput_bytes_per_s / 1e6,
        f"{prefix}failed": 1.0 if tel.error else 0.0,
    }


class CheckpointTelemetryLogger(Callback):
    """Logs every save's blocking time, write time, size and throughput to the Trainer's loggers.

    ``Trainer(plugins=[StagedCheckpointIO()], callbacks=[CheckpointTelemetryLogger()])`` adds
    ``checkpoint/blocking_s``, ``checkpoint/write_s``, ``checkpoint/bytes``,
    ``checkpoint/throughput_MBps``, ... to TensorBoard, CSV, W&B or any other logger, at the
    step when the save finished.

    Args:
        prefix: Prepended to every metric name.
    """

    def __init__(self, prefix: str = "checkpoint/") -> None:
        self.prefix = prefix
        self._plugin: StagedCheckpointIO | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._plugin = find_plugin(trainer)
        if self._plugin is None:
            rank_zero_warn(
                "CheckpointTelemetryLogger has nothing to log: the Trainer has no "
                "StagedCheckpointIO plugin. Add Trainer(plugins=[StagedCheckpointIO()])."
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        self._publish(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._publish(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Runs after the strategy's teardown has flushed the last saves.
        if self._publish(trainer):
            for logger in trainer.loggers:
                logger.save()

    def _publish(self, trainer: pl.Trainer) -> bool:
        if self._plugin is None:
            return False
        finished = self._plugin.pop_telemetry()
        if not finished or not trainer.is_global_zero:
            return False
        step = trainer.global_step
        for tel in finished:
            metrics = telemetry_metrics(tel, self.prefix)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        return True
