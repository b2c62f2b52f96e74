"""``save_last="link"``: ``last.ckpt`` only ever points at a committed checkpoint.

Lightning makes the link right after it asks for the save, while the save is still being
written, in a private static method of ``ModelCheckpoint`` outside the ``CheckpointIO``
contract. This module wraps that one method so that, for a trainer whose IO is the plugin, the
link goes through ``StagedCheckpointIO.link``: the core's :class:`stagesave.saving.links.LinkKeeper`
moves it as an ordered step once the target is committed, and holds back removals of
checkpoints a link points at (the protocol is described there). Lightning allows ``"link"``
only for local paths; the directory holds exactly what Lightning's own ``save_last="link"``
leaves: the link and the checkpoints.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["install_link_hook"]


def install_link_hook(find_keeper: Callable[[Any], Any]) -> None:
    """Route ``ModelCheckpoint``'s link creation through the plugin when a trainer uses it.

    Lightning creates ``save_last="link"`` links in a private static method, outside the
    ``CheckpointIO`` contract, so this wraps that one method. Trainers without the plugin get
    Lightning's own behaviour unchanged. ``find_keeper(trainer)`` returns the plugin or ``None``.
    """
    from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint

    current = ModelCheckpoint.__dict__.get("_link_checkpoint")
    if not isinstance(current, staticmethod):
        warnings.warn(
            "stagesave: this Lightning version has no ModelCheckpoint._link_checkpoint; with "
            "save_last='link' the last.ckpt link is made by Lightning and can dangle while a save "
            "is pending. Use save_last=True, or resume with stagesave.lightning.latest(dirpath).",
            stacklevel=3,
        )
        return
    original = current.__func__
    if getattr(original, "__stagesave_hook__", False):
        return

    def _link_checkpoint(trainer: Any, filepath: str, linkpath: str) -> None:
        plugin = find_keeper(trainer)
        if plugin is None:
            original(trainer, filepath, linkpath)
            return
        distinct = os.path.abspath(filepath) != os.path.abspath(linkpath)
        if trainer.is_global_zero and distinct:
            plugin.link(filepath, linkpath)
        trainer.strategy.barrier()

    _link_checkpoint.__stagesave_hook__ = True  # type: ignore[attr-defined]
    _link_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    ModelCheckpoint._link_checkpoint = staticmethod(_link_checkpoint)  # type: ignore[method-assign]
