"""Removal hold-back: a checkpoint is not deleted while it may still be the one a resume needs.

A framework asks for a removal right after asking for the save meant to replace the checkpoint
(Lightning's ``ModelCheckpoint`` with ``save_top_k``). The removal is one more ordered step of
the checkpointer (``Checkpointer.run_after``): it runs on the writer thread after every save
submitted before it, and only if the last of those committed. If that save failed in the
background, the checkpoint to be removed may be the newest valid one, so it is kept (with a
warning). Removals of checkpoints a link points at are held by :mod:`.links`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from ..errors import ClosedError
from ..handle import SaveHandle
from ..telemetry import SaveTelemetry

__all__ = ["OrderedSteps", "RemovalGuard"]


class OrderedSteps(Protocol):
    """What hold-back and links need of a ``Checkpointer``: ordered removals and actions."""

    def remove(self, path: str) -> SaveHandle: ...

    def run_after(self, fn: Callable[[], None], *, description: str = ...) -> SaveHandle: ...


class RemovalGuard:
    """Removals queued behind the saves submitted before them, skipped if the last one failed.

    Args:
        log: The logger that names the checkpoints kept (the adapter's).
    """

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._last_save_failed = False  # written and read on the writer thread only

    def note(self, tel: SaveTelemetry) -> None:
        """Record a finished save's outcome (called on the writer thread, from telemetry)."""
        self._last_save_failed = bool(tel.error)

    def remove_after_saves(self, steps: OrderedSteps, target: str) -> SaveHandle:
        """Remove ``target`` after every save submitted before this call, unless the last of
        those failed."""
        return steps.run_after(lambda: self._remove_unless_a_save_failed(steps, target),
                               description=f"removing {target}")

    def _remove_unless_a_save_failed(self, steps: OrderedSteps, target: str) -> None:
        # On the writer thread, after every save submitted before the removal.
        if self._last_save_failed:
            self._log.warning("stagesave: kept %s: the save before its removal failed, so it may "
                              "be the newest valid checkpoint", target)
            return
        try:
            steps.remove(target)  # queued now; runs after what was submitted meanwhile
        except (ClosedError, RuntimeError):
            self._log.info("stagesave: kept %s: the plugin was closed before its removal", target)
