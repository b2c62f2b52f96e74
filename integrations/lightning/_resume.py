"""Resuming and barriers that work from any directory, local or remote."""

from __future__ import annotations

import os
from typing import Any

import stagesave

from ._plugin import find_plugin

__all__ = ["latest", "wait"]


def latest(dirpath: Any, *, verify: bool = False, storage_options: dict[str, Any] | None = None) -> str | None:
    """Path of the newest valid checkpoint in ``dirpath``, or ``None`` if there is none.

    One call to resume from any directory, local or remote, for which Lightning's own
    ``ckpt_path="last"`` lookup does not work (``s3://``)::

        trainer.fit(model, ckpt_path=stagesave.lightning.latest(dirpath))

    "Newest" is the sequence number recorded in each stagesave checkpoint's proof, never the
    clock (files without a proof rank below those, by modification time).
    Torn checkpoints (a crash mid-save) and files that do not match their proof are skipped
    with a warning; with ``verify=True`` every byte of the chosen checkpoint is checked too.
    Plain ``.ckpt`` files without a proof (written by ``TorchCheckpointIO``) count as valid
    (they cannot be checked).

    Raises:
        stagesave.MissingExtraError: the URL needs an fsspec backend that is not installed.
    """
    options = {"storage_options": storage_options} if storage_options else {}
    info = stagesave.latest(os.fspath(dirpath), verify=verify, **options)
    return None if info is None else info.path


def wait(owner: Any, timeout: float | None = None) -> None:
    """Wait for the pending saves of a ``Trainer``'s or ``Fabric``'s plugin (no-op without one).

    Raises:
        TimeoutError: still running after ``timeout`` seconds.
        stagesave.CheckpointError: a background save failed (raised once).
    """
    plugin = find_plugin(owner)
    if plugin is not None:
        plugin.wait(timeout)
