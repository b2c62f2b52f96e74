"""``save_last="link"``: ``last.ckpt`` only ever points at a committed checkpoint.

Lightning makes the link right after it asks for the save, while the save is still being
written. Here a link update is one more ordered step of the checkpointer
(``Checkpointer.run_after``): it runs on the writer thread after the target's save, and after
every save and removal submitted before it, and moves the link only if that save committed.
Removing a checkpoint that a link points at, or will point at once the queued updates ran, is
held back; it is submitted once neither is the case, and then runs behind every link update
queued before it, so a valid ``last`` exists at every moment. Lightning allows ``"link"`` only
for local paths; the link itself is made by the core's one commit module
(``stagesave.saving.commit.commit_link``: a temporary link renamed over the old one, then a directory
fsync, every step through the filesystem seam the power-loss tests record), so the directory
holds exactly what Lightning's own ``save_last="link"`` leaves: the link and the checkpoints.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

from stagesave import Checkpointer, SaveHandle
from stagesave.saving.commit import commit_link

__all__ = ["LinkKeeper", "install_link_hook"]

log = logging.getLogger("stagesave.lightning")


def links_to(path: str) -> list[str]:
    """Symlinks in ``path``'s directory that resolve to ``path``."""
    directory = os.path.dirname(path)
    real = os.path.realpath(path)
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    return [e.path for e in entries if e.is_symlink() and os.path.realpath(e.path) == real]


class LinkKeeper:
    """Link updates as ordered writer-thread steps; removals of linked checkpoints held back.

    Every method runs on the training thread. What the links *will* point at once the queued
    updates ran is kept in ``_intended``; what they point at now is on disk. A checkpoint is
    held while either names it, so a failed save (whose link update keeps the old target)
    never lets the checkpoint the link still points at be removed. A released removal is
    queued behind every link update submitted so far, so an update still pending that points
    at it briefly (superseded by a later one) runs first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intended: dict[str, str] = {}
        self._updates: dict[str, SaveHandle] = {}
        self._held: list[str] = []

    def link(self, ckpt: Checkpointer, target: str, link: str, saved: SaveHandle | None) -> None:
        """Point ``link`` at ``target`` after ``saved`` (the target's save, if any) committed."""
        target, link = os.path.abspath(target), os.path.abspath(link)

        def relink() -> None:  # on the writer thread, after the target's save finished
            if saved is not None and saved.exception() is not None:
                log.warning("stagesave: %s keeps its previous target because saving %s failed", link, target)
                return
            if not os.path.exists(target):
                log.warning("stagesave: %s keeps its previous target because %s does not exist", link, target)
                return
            commit_link(link, target)

        handle = ckpt.run_after(relink, description=f"pointing {link} at {os.path.basename(target)}")
        with self._lock:
            self._intended[link] = target
            self._updates[link] = handle
        self.release(ckpt)

    def remove(self, ckpt: Checkpointer, path: str) -> bool:
        """Take over the removal of ``path`` when links are involved.

        Returns:
            ``True`` when handled here: a link is removed after the link updates submitted before
            (removing a link never dangles anything); a checkpoint that a link points at (now,
            or once the queued updates ran) is held until no link does. ``False``: the caller
            removes ``path`` as usual.
        """
        path = os.path.abspath(path)
        with self._lock:
            is_link = path in self._intended or os.path.islink(path)
            if is_link:
                self._intended.pop(path, None)
        if is_link:
            ckpt.remove(path)
            self.release(ckpt)
            return True
        if self._targeted(path):
            with self._lock:
                if path not in self._held:
                    self._held.append(path)
            return True
        return False

    def release(self, ckpt: Checkpointer) -> None:
        """Submit the held removals whose checkpoint no link points at any more."""
        with self._lock:
            free = [p for p in self._held if not self._targeted_locked(p)]
            self._held = [p for p in self._held if p not in free]
        for path in free:
            ckpt.remove(path)

    def update_of(self, link: str) -> SaveHandle | None:
        """The latest queued update of ``link`` (to wait for before reading through it)."""
        with self._lock:
            return self._updates.get(os.path.abspath(link))

    def kept(self) -> list[str]:
        """Forget the removals still held (their checkpoint is still linked) and name them."""
        with self._lock:
            kept, self._held = self._held, []
            self._updates.clear()
        for path in kept:
            log.info("stagesave: kept %s because a save_last link still points at it", path)
        return kept

    def _targeted(self, path: str) -> bool:
        with self._lock:
            return self._targeted_locked(path)

    def _targeted_locked(self, path: str) -> bool:
        return path in self._intended.values() or bool(links_to(path))


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
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            plugin.link(filepath, linkpath)
        trainer.strategy.barrier()

    _link_checkpoint.__stagesave_hook__ = True  # type: ignore[attr-defined]
    _link_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    ModelCheckpoint._link_checkpoint = staticmethod(_link_checkpoint)  # type: ignore[method-assign]
