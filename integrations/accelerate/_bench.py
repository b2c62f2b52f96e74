"""Accelerate's own ``save_state``, for ``stagesave bench`` and the benchmark sweep.

Registered in the ``stagesave.bench_alternatives`` entry-point group (see
``stagesave.cli.alternatives``), so the core can run it without importing Accelerate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stagesave.cli.alternatives import Alternative, Session

__all__ = ["AccelerateSaveState", "alternatives"]


class _Holder:
    """The benchmark state as an object Accelerate checkpoints (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.state: Any = None

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:  # pragma: no cover - the benchmark only saves
        self.state = state


class AccelerateSaveState(Session):
    """``Accelerator(cpu=True).save_state(folder)`` with the state registered for checkpointing.

    Accelerate writes it with ``torch.save`` (beside its RNG states), synchronously and without
    fsync: what ``save_state`` costs an Accelerate user who has not enabled stagesave.
    """

    def __init__(self) -> None:
        super().__init__()
        from accelerate.accelerator import Accelerator

        self.accelerator = Accelerator(cpu=True)
        self.holder = _Holder()
        self.accelerator.register_for_checkpointing(self.holder)

    def start(self, state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        self.holder.state = state
        self.called_at = time.perf_counter()
        self.accelerator.save_state(path)
        self.done_at = time.perf_counter()
        return self.done_at - self.called_at, lambda: True

    def close(self) -> None:
        self.holder.state = None
        self.accelerator._custom_objects.clear()


def alternatives() -> list[Alternative]:
    """What ``stagesave.accelerate`` adds to the benchmark alternatives."""
    return [
        Alternative("accelerate save_state", lambda base, options: AccelerateSaveState(), 0.0,
                    False, False,
                    "synchronous torch.save of the registered state into the folder; no fsync"),
    ]
