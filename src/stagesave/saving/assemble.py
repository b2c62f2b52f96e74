"""A folder checkpoint assembled from parts that commit separately, published by one rename.

Accelerate's FSDP folder nests DCP folders (``pytorch_model_fsdp_<i>``, ``optimizer_<i>``),
written by every rank and committed by ``stagesave.dcp``'s coordinator, beside files only the
main process writes (scheduler, RNG states, custom objects), committed by
``Checkpointer.save_dir``. Each part commits on its own inside one private work folder that is
never listed (``.<leaf>.<pid>-<hex>.stagesave-tmp`` beside the target, the core's temporary name,
so the same filesystem)::

    work/parts/pytorch_model_fsdp_0     committed by stagesave.dcp (its files carry their proofs)
    work/parts/optimizer_0              committed by stagesave.dcp
    work/folder/<leaf>                  committed by save_dir: the top-level files, one of which
                                        carries the folder's proof (and the nested parts' names)
    work/acks/<rank>.ok                 rank <rank> saw its parts committed (or .failed)

The other ranks learn that a DCP part committed by finding it at its target, so the parts stay
where they are until every rank has said it saw them (its acknowledgement file, written by its
own writer thread once its part handles are done). Then rank 0 moves the DCP folders into
``work/folder/<leaf>`` and renames that folder to the target with the core's folder rename
(:func:`stagesave.saving.publish.rename_into_place`: an atomic swap with an invalid folder being
replaced, directory fsync, undone if that fails): the single step that makes the checkpoint
visible. A crash before it leaves the previous checkpoint the newest (and the work folder as
debris that ``stagesave gc`` removes once its writer is dead); a failed part, a failed rank or a
missing acknowledgement (a rank died) publishes nothing. Every mutating filesystem call goes
through :mod:`stagesave.stores.posix`, so the power-loss recorder sees each step.

These steps run as ``Checkpointer.run_after`` actions, queued on each process's writer thread
behind the parts they follow: they poll a folder and rename (syscalls only: no torch op, no
collective), and their errors are delivered like a failed save's. The carrier's proof is sealed
inside the work folder, so its sequence number is not the next one of the checkpoints root.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import CheckpointError, StorageError
from ..handle import SaveHandle
from ..stores import posix as fsops
from ..stores.local import LocalStore, temp_name_for
from .beside import occupant
from .publish import rename_into_place, restore_aside
from .retire import retain

__all__ = [
    "Assembly",
    "create_work_folder",
    "discard",
    "first_error",
    "folder_in",
    "keep_newest",
    "part_in",
    "publish",
    "write_ack",
]

#: Polling the acknowledgements starts this fast and slows down to ``_POLL_MAX`` (seconds).
_POLL_MIN, _POLL_MAX = 0.005, 0.25
_SUBFOLDERS = ("parts", "folder", "acks")


@dataclass(frozen=True)
class Assembly:
    """One checkpoint to publish: ``parts`` are moved into ``folder``, which becomes ``target``."""

    work: str
    folder: str
    parts: Sequence[tuple[str, str]]  # (committed part folder, name inside the checkpoint)
    handles: Sequence[SaveHandle]  # this process's part commits, then the folder's own
    target: str
    replace_invalid: bool  # the target holds a checkpoint proven invalid before the save
    world: int
    timeout_s: float  # for the other ranks' acknowledgements
    what: str = "checkpoint"  # how messages name it ("FSDP checkpoint")


def create_work_folder(target: str) -> str:
    """Create the private work folder of an assembly beside the local folder ``target``.

    Beside the target under the core's temporary name, so that publishing is one rename and
    ``stagesave gc`` recognizes it as debris once its writer is dead.
    """
    fsops.makedirs(os.path.dirname(target), exist_ok=True)
    work = temp_name_for(target)
    for sub in _SUBFOLDERS:
        fsops.makedirs(os.path.join(work, sub))
    return work


def part_in(work: str, name: str = "") -> str:
    """Where the part ``name`` commits inside ``work`` (no name: the folder of all parts)."""
    return f"{work}/parts/{name}" if name else f"{work}/parts"


def folder_in(work: str, leaf: str) -> str:
    """Where the checkpoint's own files commit inside ``work`` (the folder renamed last)."""
    return f"{work}/folder/{leaf}"


def _acks(work: str) -> str:
    return os.path.join(work, "acks")


def write_ack(work: str, rank: int, error: BaseException | None) -> None:
    """Tell rank 0 this rank is done with the save (best effort: a missing work folder means
    rank 0 already gave up on it)."""
    name = f"{rank}.ok" if error is None else f"{rank}.failed"
    path = os.path.join(_acks(work), name)
    reason = "" if error is None else f"{type(error).__name__}: {error}"[:4096]
    data = reason.encode("utf-8", "replace")
    try:
        fd = fsops.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[fsops.write(fd, view) :]
        finally:
            fsops.close(fd)
        fsops.replace(path + ".tmp", path)
    except FileNotFoundError:
        pass


def _wait_acks(work: str, world: int, timeout_s: float) -> None:
    """Block until every rank but 0 acknowledged.

    Raises:
        CheckpointError: a rank reported a failure, or one did not answer in time.
    """
    deadline = time.monotonic() + timeout_s
    delay = _POLL_MIN
    while True:
        names = set(os.listdir(_acks(work)))
        failed = sorted(n for n in names if n.endswith(".failed"))
        if failed:
            with open(os.path.join(_acks(work), failed[0]), encoding="utf-8") as f:
                reason = f.read()
            rank = failed[0].split(".")[0]
            raise CheckpointError(f"rank {rank} failed its part of the save ({reason})")
        missing = [r for r in range(1, world) if f"{r}.ok" not in names]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise CheckpointError(
                f"rank(s) {', '.join(map(str, missing))} did not confirm their part within "
                f"{timeout_s:.0f} s (killed or hung)"
            )
        time.sleep(delay)
        delay = min(_POLL_MAX, delay * 1.5)


def _publish(a: Assembly) -> None:
    """Move the parts in and rename the folder into place (the commit of the whole checkpoint).

    Raises:
        StorageError: the target appeared meanwhile, or a rename failed.
    """
    for src, name in a.parts:
        fsops.rename(src, os.path.join(a.folder, name))
    fsops.fsync_dir(a.folder)
    parent, leaf = os.path.dirname(a.target), os.path.basename(a.target)
    store = LocalStore(parent)
    with store.commit_lock(leaf):
        restore_aside(store, "")  # a folder a crash left aside mid-replacement goes back first
        if (os.path.lexists(a.target) and not a.replace_invalid
                and _holds_a_checkpoint(store, leaf, a.target)):
            raise StorageError(f"{a.target} appeared while its {a.what} was being written")
        # (a folder of the user's files only, made meanwhile: published into, the files kept)
        # An invalid folder there (proven before the save) is swapped out and removed, or moved
        # aside first where the filesystem cannot swap (put back by the next writer after a crash).
        rename_into_place(store, a.folder, a.target, leaf)


def _holds_a_checkpoint(store: LocalStore, leaf: str, path: str) -> bool:
    """Whether ``path`` holds a stagesave checkpoint (or is not a folder at all)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return True
    return occupant(store, leaf, path).carrier is not None


def first_error(handles: Sequence[SaveHandle]) -> BaseException | None:
    """Wait for ``handles``; the first one's background error (``None``: all committed)."""
    return next((e for e in (h.exception() for h in handles) if e is not None), None)


def publish(a: Assembly, after: Callable[[], None]) -> None:
    """Rank 0, queued behind the parts: publish once every rank acknowledged, then ``after()``.

    Raises:
        CheckpointError: a part failed (it was reported by its own save too), a rank failed or
            never acknowledged, or a rename failed: the checkpoint was not published.
    """
    error = first_error(a.handles)  # done: this runs after them
    try:
        try:
            _wait_acks(a.work, a.world, a.timeout_s)  # before the parts move: ranks look for them
        except CheckpointError as exc:
            error = error or exc
        if error is None:
            _publish(a)
    except OSError as exc:
        raise StorageError(f"the {a.what} {a.target} was not published: {exc}") from exc
    finally:
        fsops.rmtree(a.work)
    if error is not None:
        raise CheckpointError(f"the {a.what} {a.target} was not published: {error}") from error
    after()


def keep_newest(root: str, keep: int | None) -> None:
    """After a publish (rank 0's writer thread): keep the ``keep`` newest committed checkpoints in
    ``root`` (``None``: all), with the core's own retention pass, under the root's commit lock.

    Not through ``stagesave.list_checkpoints``: a listing waits for every save pending in the
    root, and the next save's parts (whose work folder sits in the root, beside its target)
    are queued behind this very job.
    """
    if keep is not None:
        retain(LocalStore(root), "", keep)


def discard(work: str, world: int, timeout_s: float) -> None:
    """Rank 0, queued behind the parts of a save that failed on the training thread: remove the
    work folder once every other rank acknowledged its own parts."""
    with contextlib.suppress(CheckpointError, OSError):
        _wait_acks(work, world, timeout_s)  # the save failed anyway; its folder goes regardless
    fsops.rmtree(work)
