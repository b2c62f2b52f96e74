"""Publishing an FSDP checkpoint folder whose parts commit separately.

Accelerate's FSDP folder nests DCP folders (``pytorch_model_fsdp_<i>``, ``optimizer_<i>``),
written by every rank and committed by ``stagesave.dcp``'s coordinator, beside files only the
main process writes (scheduler, RNG states, custom objects), committed by
``Checkpointer.save_dir``. Each part commits on its own inside one private work folder that is
never listed (``<staging>/.<leaf>.<pid>-<hex>.stagesave-tmp``, same filesystem as the target)::

    work/parts/pytorch_model_fsdp_0     committed by stagesave.dcp (its own manifest)
    work/parts/optimizer_0              committed by stagesave.dcp
    work/folder/<leaf>                  committed by save_dir: the top-level files and manifest

Once every part has committed, the DCP folders are moved into ``work/folder/<leaf>`` and that
folder is renamed to the target: the single step that makes the checkpoint visible. A crash
before it leaves the previous checkpoint the newest (and the work folder as debris that
``stagesave gc`` removes once its writer is dead); a failed part publishes nothing.

This waits on handles and renames on one small thread of its own (syscalls only: no torch op,
no collective). The core has no public way yet to commit a folder that adopts folders committed
by other saves; when it has, this module goes away.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stagesave import SaveHandle
from stagesave.errors import StorageError

__all__ = ["Assembly", "FolderHandle", "Publisher"]


class FolderHandle(SaveHandle):
    """The handle of a whole FSDP checkpoint: done once the folder is published (or failed)."""

    def finish(self, error: BaseException | None) -> None:
        tel = self.telemetry
        if error is None:
            tel.committed_at = time.time()
            tel.time_to_commit_s = tel.committed_at - tel.started_at
        else:
            tel.error = str(error)
        self._set_done(error)


@dataclass(frozen=True)
class Assembly:
    """One FSDP checkpoint to publish: ``parts`` are moved into ``folder``, then it becomes ``target``."""

    work: str
    folder: str
    parts: Sequence[tuple[str, str]]  # (committed DCP folder, name inside the checkpoint)
    handles: Sequence[SaveHandle]  # every part's commit, then the folder's own
    target: str
    replace_invalid: bool  # the target holds a checkpoint proven invalid before the save
    handle: FolderHandle


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(a: Assembly) -> None:
    """Move the parts in and rename the folder into place (the commit of the whole checkpoint).

    Raises:
        StorageError: the target appeared meanwhile, or a rename failed.
    """
    for src, name in a.parts:
        os.rename(src, os.path.join(a.folder, name))
    _fsync_dir(a.folder)
    if os.path.lexists(a.target):
        if not a.replace_invalid:
            raise StorageError(
                f"{a.target} appeared while its FSDP checkpoint was being written; the new checkpoint "
                f"was not published (it is complete in {a.folder})"
            )
        # Proven invalid before the save (torn or corrupt): nothing of value is lost if a crash
        # strikes between removing it and the rename below.
        shutil.rmtree(a.target)
    os.rename(a.folder, a.target)
    _fsync_dir(os.path.dirname(a.target))


class Publisher:
    """Publishes :class:`Assembly` jobs in submission order, off the training thread.

    Errors of its own (a rename) are raised by the next :meth:`raise_errors`; a part that
    failed is reported by its checkpointer, and its checkpoint is simply never published.
    """

    def __init__(self) -> None:
        self._pool: cf.ThreadPoolExecutor | None = None
        self._futures: list[cf.Future[None]] = []
        self._errors: list[BaseException] = []

    def submit(self, assembly: Assembly, after: Callable[[], None]) -> None:
        """Publish ``assembly`` once its handles are done, then call ``after`` (retention)."""
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="stagesave-accelerate-publish")
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(self._pool.submit(self._run, assembly, after))

    def _run(self, a: Assembly, after: Callable[[], None]) -> None:
        # A failed part is reported by its own checkpointer; the folder then is never published.
        error = next((e for e in (h.exception() for h in a.handles) if e is not None), None)
        try:
            if error is None:
                _publish(a)
        except BaseException as exc:  # noqa: BLE001 - delivered by raise_errors() and the handle
            error = StorageError(f"publishing the FSDP checkpoint {a.target} failed: {exc}")
            error.__cause__ = exc
            self._errors.append(error)
        finally:
            shutil.rmtree(a.work, ignore_errors=True)
        a.handle.finish(error)
        if error is None:
            try:
                after()
            except Exception as exc:  # noqa: BLE001 - delivered by raise_errors()
                self._errors.append(exc)

    def pending(self) -> int:
        return sum(not f.done() for f in self._futures)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every submitted publication.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
        """
        _, not_done = cf.wait(self._futures, timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} FSDP checkpoints still being published after {timeout} s")

    def raise_errors(self) -> None:
        """Raise the first undelivered error (each error is raised once)."""
        errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self, timeout: float | None = None) -> None:
        """Finish pending publications, then end the thread."""
        try:
            self.wait(timeout)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None
