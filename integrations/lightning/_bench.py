"""Lightning's own asynchronous checkpointing, for ``stagesave bench`` and the benchmark sweep.

Registered in the ``stagesave.bench_alternatives`` entry-point group (see
``stagesave.cli.alternatives``), so the core can run it without importing Lightning.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stagesave.cli.alternatives import Alternative, Session
from stagesave.errors import UsageError

__all__ = ["LightningAsync", "alternatives"]


class LightningAsync(Session):
    """Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())``: clone, then torch.save in a
    thread."""

    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        self.plugin = AsyncCheckpointIO(TorchCheckpointIO())

    def start(self, state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        self.called_at = time.perf_counter()
        self.done_at = None
        self.plugin.save_checkpoint(state, path)
        blocking = time.perf_counter() - self.called_at
        executor = self.plugin._executor
        if executor is None:  # pragma: no cover - Lightning creates it on the first save
            raise UsageError("AsyncCheckpointIO has no executor after a save")
        sentinel = executor.submit(lambda: None)  # one FIFO worker: runs after the save
        sentinel.add_done_callback(self._mark_done)
        return blocking, sentinel.done

    def check(self) -> None:
        if self.plugin._error is not None:
            raise self.plugin._error

    def close(self) -> None:
        self.plugin.teardown()


def alternatives() -> list[Alternative]:
    """What ``stagesave.lightning`` adds to the benchmark alternatives."""
    return [
        Alternative("lightning AsyncCheckpointIO", lambda base, options: LightningAsync(), 2.25,
                    False, False, "clone + torch.save into BytesIO in a thread; no fsync"),
    ]
