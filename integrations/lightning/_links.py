"""``save_last="link"``: a ``last.ckpt`` symlink that only ever points at a committed checkpoint.

Lightning makes the link itself, right after the save call returns: it deletes ``last.ckpt`` and
creates a new symlink to the checkpoint just submitted. With the write still in flight that
link dangles, and a crash in that window leaves ``ckpt_path="last"`` with nothing to resume from
(Lightning then warns once and trains from scratch). Lightning's next step in the same hook can
also remove the checkpoint the old link points at (top-k), so for a moment no valid ``last``
exists at all.

Here a link moves only after its target is committed, atomically (a new symlink renamed over
the old one), and removing the checkpoint a link still points at waits until the link has moved
on. Links are made by one small thread that waits on save handles and does nothing but
``symlink``/``rename``/``fsync``. Lightning allows ``"link"`` only for local paths, so this
module is plain POSIX.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import secrets
import shutil
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stagesave import SaveHandle

__all__ = ["LinkKeeper", "install_link_hook", "replace_symlink"]

log = logging.getLogger("stagesave.lightning")

#: Suffix of the temporary symlink renamed over the link; the same marker as the core's
#: temporaries, so stagesave's clean-up recognises a leftover from a crash.
TMP_SUFFIX = ".stagesave-tmp"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def replace_symlink(target: str, link: str) -> None:
    """Make ``link`` a relative symlink to ``target``, atomically replacing what was there.

    Raises:
        OSError: the link cannot be created (e.g. the directory is not writable).
    """
    directory = os.path.dirname(os.path.abspath(link))
    tmp = os.path.join(directory, f".{os.path.basename(link)}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}")
    os.symlink(os.path.relpath(os.path.abspath(target), directory), tmp)
    try:
        if os.path.isdir(link) and not os.path.islink(link):
            shutil.rmtree(link)  # Lightning replaces a directory of that name too
        os.replace(tmp, link)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def _same(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def links_to(path: str) -> list[str]:
    """Symlinks in ``path``'s directory that resolve to ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    real = os.path.realpath(path)
    out: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return out
    for entry in entries:
        if entry.is_symlink() and os.path.realpath(entry.path) == real:
            out.append(entry.path)
    return out


@dataclass
class _Job:
    link: str
    target: str | None  # None: the removal of the link ``link``
    future: cf.Future[None]


class LinkKeeper:
    """Moves links once their targets are committed; holds removals of linked checkpoints.

    Args:
        remove: Submits the real removal of a checkpoint (ordered after earlier saves).
    """

    def __init__(self, remove: Callable[[str], Any]) -> None:
        self._remove = remove
        self._lock = threading.Lock()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._jobs: list[_Job] = []
        self._held: list[str] = []
        self._errors: list[BaseException] = []

    # ------------------------------------------------------------------ requests
    def link(self, target: str, link: str, handle: SaveHandle | None) -> None:
        """Point ``link`` at ``target`` once ``handle`` (the target's pending save) commits."""
        self._submit(link, target, lambda: self._relink(target, link, handle))

    def remove(self, path: str) -> bool:
        """Take over the removal of ``path`` if a link needs it to wait.

        Returns:
            ``True`` when this keeper removes it: a link (after the link updates requested
            before, so that a valid ``last`` exists at every moment), or a checkpoint a link still
            points at (once no link does); ``False`` when the caller should remove it now.
        """
        if os.path.islink(path):
            self._submit(path, None, lambda: self._unlink(path))
            return True
        if self._targeted(path):
            with self._lock:
                if path not in self._held:
                    self._held.append(path)
            return True
        return False

    def _submit(self, link: str, target: str | None, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stagesave-link")
            future = self._pool.submit(self._guard, fn)
            job = _Job(link, target, future)
            self._jobs.append(job)
        future.add_done_callback(lambda _f: self._forget(job))

    def _forget(self, job: _Job) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - delivered by wait()/close()
            log.error("stagesave: keeping a save_last link up to date failed: %s", exc)
            with self._lock:
                self._errors.append(exc)

    # ------------------------------------------------------------------ worker side
    def _relink(self, target: str, link: str, handle: SaveHandle | None) -> None:
        if handle is not None and handle.exception() is not None:
            log.warning("stagesave: %s keeps its previous target because saving %s failed", link, target)
            return
        replace_symlink(target, link)
        self._release_held()

    def _unlink(self, link: str) -> None:
        try:
            os.unlink(link)
        except FileNotFoundError:
            pass
        _fsync_dir(os.path.dirname(os.path.abspath(link)))
        self._release_held()

    def _targeted(self, path: str) -> bool:
        with self._lock:
            pending = any(j.target is not None and _same(j.target, path) for j in self._jobs)
        return pending or bool(links_to(path))

    def _release_held(self) -> None:
        with self._lock:
            held = list(self._held)
        for path in held:
            if not self._targeted(path):
                with self._lock:
                    self._held.remove(path)
                self._remove(path)

    # ------------------------------------------------------------------ waiting
    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def wait(self, timeout: float | None = None, link: str | None = None) -> None:
        """Wait for pending link jobs (only those of ``link`` if given), then raise a failure.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            OSError: a link could not be made (raised once).
        """
        with self._lock:
            futures = [j.future for j in self._jobs if link is None or _same(j.link, link)]
        _, not_done = cf.wait(futures, timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} save_last link updates still waiting after {timeout} s")
        if link is None:
            self._raise_errors()

    def _raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self, timeout: float | None = None) -> None:
        """Finish pending link jobs and end the thread; held removals whose checkpoint is still
        linked are dropped (the file is kept rather than leave a dangling link).

        Raises:
            TimeoutError: link jobs still waiting after ``timeout`` seconds.
            OSError: a link could not be made.
        """
        try:
            self.wait(timeout)
        finally:
            with self._lock:
                pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False)
        self._release_held()
        with self._lock:
            kept, self._held = self._held, []
        for path in kept:
            log.info("stagesave: kept %s because a save_last link still points at it", path)


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
        if trainer.is_global_zero and not _same(filepath, linkpath):
            plugin.link(filepath, linkpath)
        trainer.strategy.barrier()

    _link_checkpoint.__stagesave_hook__ = True  # type: ignore[attr-defined]
    _link_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    ModelCheckpoint._link_checkpoint = staticmethod(_link_checkpoint)  # type: ignore[method-assign]
