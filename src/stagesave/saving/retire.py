"""Retiring checkpoints: removal in one step, and retention of the newest ``keep_last``.

Removal makes a checkpoint vanish in one step (rename to a temporary name, then delete; on
object stores the carrier first), so a half-removed checkpoint is never valid. A local folder
that also holds files of the user's (or the working directory) keeps them: only the
checkpoint's own files are removed, its carrier first (:func:`.beside.remove_own`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .._crash import crash_point
from ..ondisk.names import (
    DIR_MANIFEST,
)
from ..restore.discovery import CheckpointInfo, scan
from ..stores import posix as fsops
from ..stores.base import Store
from ..stores.local import temp_name_for
from .beside import holds_cwd, occupant, remove_own
from .publish import clear_for_rewrite, drop_sidecars, join_name, sidecars_of

__all__ = ["remove_checkpoint", "retain"]


def remove_checkpoint(
    store: Store, name: str, *, is_dir: bool | None = None, debris_dir: str | None = None
) -> None:
    """Make the checkpoint ``name`` (file or folder) vanish in one step, then delete its bytes.

    A symbolic link is removed itself, never what it points to. A tiered store removes it from
    both tiers (``TieredStore.retire``). ``debris_dir`` (local, same filesystem): where the bytes
    wait for their deletion instead of a temporary name beside them (a staging folder outside a
    directory that another program lists).
    """
    retire = getattr(store, "retire", None)
    if retire is not None:
        retire(name, is_dir, debris_dir)
        return
    local = store.local_path(name)
    if local is not None:
        if os.path.islink(local):
            fsops.unlink(local)
            fsops.fsync_dir(os.path.dirname(local))
            return
        if is_dir is None:
            is_dir = os.path.isdir(local)
        if is_dir:
            occupied = occupant(store, name, local)
            # a checkpoint among the user's files (or in the working directory): they stay;
            # a folder without a checkpoint is removed as asked
            if occupied.carrier is not None and (occupied.foreign or holds_cwd(local)):
                remove_own(local, occupied)
                drop_sidecars(store, name)
                return
        debris = temp_name_for(local)
        if debris_dir is not None:
            debris = os.path.join(debris_dir, os.path.basename(debris).lstrip("."))
        try:
            fsops.rename(local, debris)
        except FileNotFoundError:
            debris = ""
        crash_point("during_retention")
        if debris:
            fsops.fsync_dir(os.path.dirname(local))
            if is_dir:
                fsops.rmtree(debris)
            else:
                fsops.unlink(debris)
        drop_sidecars(store, name)
        return
    if is_dir is None:
        try:
            store.info(name)
            is_dir = False
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            is_dir = bool(store.list(name)) or bool(store.list_dirs(name))
    if is_dir:
        clear_for_rewrite(store, name, set(), removing=True)
        crash_point("during_retention")
        return
    for m in sidecars_of(
        store, name
    ):  # format 1: the manifest first, so a half-removed file is never valid
        store.delete(m)
    crash_point("during_retention")
    store.delete(name)


def retain(
    store: Store,
    directory: str,
    keep: int,
    *,
    skip: Callable[[CheckpointInfo], bool] | None = None,
    debris_dir: str | None = None,
) -> list[str]:
    """Keep the ``keep`` newest committed checkpoints of ``directory``; remove older ones.

    Runs under the directory's commit lock. ``skip``: checkpoints never to remove (a tiered
    store's not-yet-uploaded ones). ``debris_dir`` as in :func:`remove_checkpoint`. Returns the
    names removed.
    """
    removed = []
    with store.commit_lock(join_name(directory, DIR_MANIFEST)):
        committed = [c for c in scan(store, directory) if c.status == "committed"]
        for old in committed[keep:]:
            if skip is not None and skip(old):
                continue
            remove_checkpoint(store, old.name, is_dir=old.is_dir, debris_dir=debris_dir)
            removed.append(old.name)
    return removed
