"""Links that only ever point at a committed checkpoint (Lightning's ``save_last="link"``).

A framework makes the link right after it asks for the save, while the save is still being
written. Here a link update is one more ordered step of the checkpointer
(``Checkpointer.run_after``): it runs on the writer thread after the target's save, and after
every save and removal submitted before it, and moves the link only if that save committed.
Removing a checkpoint that a link points at, or will point at once the queued updates ran, is
held back; it is submitted once neither is the case, and then runs behind every link update
queued before it, so a valid ``last`` exists at every moment. Links exist for local paths only;
the link itself is made by the one commit module (:func:`stagesave.saving.commit.commit_link`:
a temporary link renamed over the old one, then a directory fsync, every step through the
filesystem seam the power-loss tests record), so the directory holds exactly what the
framework's own links leave: the link and the checkpoints.
"""

from __future__ import annotations

import logging
import os
import threading

from ..handle import SaveHandle
from .commit import commit_link
from .holdback import OrderedSteps

__all__ = ["LinkKeeper", "links_to"]


def links_to(path: str) -> list[str]:
    """Symlinks in ``path``'s directory that resolve to ``path``."""
    directory = os.path.dirname(path)
    real = os.path.realpath(path)
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    return [e.path for e in entries if _links_to(e, real)]


def _links_to(entry: os.DirEntry[str], real: str) -> bool:
    try:  # an entry may vanish between the listing and this look (a link's own temporary)
        return entry.is_symlink() and os.path.realpath(entry.path) == real
    except OSError:
        return False


class LinkKeeper:
    """Link updates as ordered writer-thread steps; removals of linked checkpoints held back.

    Every method runs on the training thread. What the links *will* point at once the queued
    updates ran is kept in ``_intended``; what they point at now is on disk. A checkpoint is
    held while either names it, so a failed save (whose link update keeps the old target)
    never lets the checkpoint the link still points at be removed. A released removal is
    queued behind every link update submitted so far, so an update still pending that points
    at it briefly (superseded by a later one) runs first.

    Args:
        log: The logger that names links kept on their old target and checkpoints kept (the
            adapter's).
    """

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._lock = threading.Lock()
        self._intended: dict[str, str] = {}
        self._updates: dict[str, SaveHandle] = {}
        self._held: list[str] = []

    def link(self, steps: OrderedSteps, target: str, link: str, saved: SaveHandle | None) -> None:
        """Point ``link`` at ``target`` after ``saved`` (the target's save, if any) committed."""
        target, link = os.path.abspath(target), os.path.abspath(link)
        log = self._log

        def relink() -> None:  # on the writer thread, after the target's save finished
            if saved is not None and saved.exception() is not None:
                log.warning("stagesave: %s keeps its previous target because saving %s failed",
                            link, target)
                return
            if not os.path.exists(target):
                log.warning("stagesave: %s keeps its previous target because %s does not exist",
                            link, target)
                return
            commit_link(link, target)

        description = f"pointing {link} at {os.path.basename(target)}"
        handle = steps.run_after(relink, description=description)
        with self._lock:
            self._intended[link] = target
            self._updates[link] = handle
        self.release(steps)

    def remove(self, steps: OrderedSteps, path: str) -> bool:
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
            steps.remove(path)
            self.release(steps)
            return True
        if self._targeted(path):
            with self._lock:
                if path not in self._held:
                    self._held.append(path)
            return True
        return False

    def release(self, steps: OrderedSteps) -> None:
        """Submit the held removals whose checkpoint no link points at any more."""
        with self._lock:
            free = [p for p in self._held if not self._targeted_locked(p)]
            self._held = [p for p in self._held if p not in free]
        for path in free:
            steps.remove(path)

    def update_of(self, link: str) -> SaveHandle | None:
        """The latest queued update of ``link`` (to wait for before reading through it)."""
        with self._lock:
            return self._updates.get(os.path.abspath(link))

    def settle(self, path: str) -> None:
        """Wait until the latest queued update of ``path`` ran, if ``path`` is a local link
        with one (the link moves only once its target is committed); never raises its error."""
        if "://" in path:
            return
        update = self.update_of(path)
        if update is not None:
            update.exception()

    def kept(self) -> list[str]:
        """Forget the removals still held (their checkpoint is still linked) and name them."""
        with self._lock:
            kept, self._held = self._held, []
            self._updates.clear()
        for path in kept:
            self._log.info("stagesave: kept %s because a save_last link still points at it", path)
        return kept

    def _targeted(self, path: str) -> bool:
        with self._lock:
            return self._targeted_locked(path)

    def _targeted_locked(self, path: str) -> bool:
        return path in self._intended.values() or bool(links_to(path))
