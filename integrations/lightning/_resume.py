"""Resuming and barriers that work from any directory, local or remote."""

from __future__ import annotations

import os
from typing import Any

import stagesave

from ._plugin import find_plugin

__all__ = ["latest", "wait"]


def latest(
    dirpath: Any, *, verify: bool = True, storage_options: dict[str, Any] | None = None
) -> str | None:
    """Path of the newest checkpoint in ``dirpath`` that a resume can load, or ``None``.

    One call to resume from any directory, local or remote, for which Lightning's own
    ``ckpt_path="last"`` lookup does not work (``s3://``)::

        trainer.fit(model, ckpt_path=stagesave.lightning.latest(dirpath))

    "Newest" is the sequence number recorded in each stagesave checkpoint's proof, never the
    clock (files without a proof rank below those, by modification time).
    It verifies by default (see :func:`stagesave.latest`): every byte of the checkpoint chosen
    matched its proof, and a damaged or torn newest one is skipped with a warning naming it and
    what is wrong, so the resume starts from the intact previous one; the load that follows in
    this process does not hash the same unchanged file again. Plain ``.ckpt`` files without a
    proof (written by ``TorchCheckpointIO``) rank below those and are offered only if they load
    as torch files (zip records matching their CRC-32s). ``verify=False`` checks the proofs but
    not the bytes they prove (a cheap listing; the load may then fail with ``IntegrityError``).

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
