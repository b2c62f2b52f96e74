"""Publishing primitives of the commit protocol: renames that are durable or undone, folders
swapped into place, debris and format-1 sidecars cleared.

A folder is published by one rename, swapped with the old folder by ``RENAME_EXCHANGE`` where
the filesystem can; otherwise the old one is moved aside first and put back by the next writer
after a crash between the two renames (:func:`restore_aside`). A folder that holds files that
are not its checkpoint's (or the working directory) is published into instead (:mod:`.beside`).
Every mutating filesystem call goes through :mod:`stagesave.stores.posix` (the power-loss
recorder wraps it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import warnings
from collections.abc import Callable

from .._crash import crash_point
from ..errors import CheckpointError
from ..ondisk.names import (
    aside_name,
    parse_aside_name,
    split_manifest_name,
)
from ..restore.discovery import is_sidecar_of, resolve_dir
from ..restore.liveness import pid_alive
from ..stores import posix as fsops
from ..stores.base import Store
from .beside import Occupant, holds_cwd, keep_arrivals, occupant, publish_into

__all__ = [
    "FILE_THERE",
    "clear_for_rewrite",
    "drop_sidecars",
    "join_name",
    "parent_of",
    "remove_tree",
    "rename_into_place",
    "restore_aside",
    "sidecars_of",
]


#: Why a folder checkpoint is not written where a file (not a folder) of that name exists.
FILE_THERE = ("a file of that name exists (a folder checkpoint never replaces a file: remove it "
              "or choose another name)")


def parent_of(name: str) -> str:
    return name.rpartition("/")[0]


def join_name(parent: str, leaf: str) -> str:
    return f"{parent}/{leaf}" if parent else leaf


def sidecars_of(store: Store, name: str) -> list[str]:
    """The format-1 manifests of ``name`` (files named like one that do not parse as one, or that
    describe another file, are a user's and never returned)."""
    directory, _, base = name.rpartition("/")
    try:
        listing = store.list(directory)
    except OSError:
        return []
    return [
        info.name
        for info in listing
        if (parsed := split_manifest_name(info.name.rpartition("/")[2])) is not None
        and parsed[0] == base
        and is_sidecar_of(store, info.name, base)
    ]


def drop_sidecars(store: Store, name: str) -> None:
    """Format-1 manifests of a name that now holds a format-2 file (or none) are debris."""
    for m in sidecars_of(store, name):
        with contextlib.suppress(OSError):
            store.delete(m)


def clear_for_rewrite(
    store: Store, directory: str, keep: set[str], *, removing: bool = False
) -> None:
    """Before a folder is rewritten in place (object stores): its old carrier first, so nothing
    half-overwritten is ever valid, then every file of the old checkpoint the new save will not
    write. Files that are not the old checkpoint's (the user's) stay; ``removing`` a folder
    that holds no checkpoint removes it whole, as asked."""
    try:
        old = resolve_dir(store, directory)
    except OSError:
        old = None
    owned: set[str] = set()
    nested: tuple[str, ...] = ()
    if old is not None and old.manifest is not None:
        if old.manifest.folder is not None:
            store.delete(f"{directory}/{old.manifest.folder.carrier}")
            owned, nested = old.manifest.folder.names(), tuple(old.manifest.folder.nested)
        elif old.manifest_name is not None:
            store.delete(old.manifest_name)
            owned = {f.name for f in old.manifest.files}
    from ..restore.discovery import list_tree

    everything = removing and (old is None or old.manifest is None)
    prefix = len(directory) + 1
    for info in list_tree(store, directory):
        rel = info.name[prefix:]
        if rel in keep:
            continue
        if everything or rel in owned or rel.startswith(tuple(n + "/" for n in nested)):
            store.delete(info.name)


def remove_tree(store: Store, name: str) -> None:
    path = store.local_path(name)
    if path and os.path.isdir(path) and not os.path.islink(path):
        fsops.rmtree(path)


def rename_into_place(store: Store, src: str, dst: str, directory: str) -> None:
    """Rename the folder ``src`` to ``dst`` (swap, or aside then rename, when ``dst`` exists),
    durably; files at ``dst`` that are not its checkpoint's are kept (:mod:`.beside`)."""
    if not os.path.lexists(dst):
        try:
            fsops.rename(src, dst)
        except OSError as exc:  # made meanwhile, and written into (the user's): go on below
            if exc.errno == errno.ENOTDIR and not os.path.isdir(dst):  # a file made meanwhile
                raise CheckpointError(f"cannot commit folder checkpoint {dst}: {FILE_THERE}") \
                    from exc
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        else:
            _durable_or_undone(dst, lambda: _quietly(fsops.rename, dst, src))
            return
    if not os.path.isdir(dst) and not os.path.islink(dst):  # never a file of the user's
        raise CheckpointError(f"cannot commit folder checkpoint {dst}: {FILE_THERE}")
    old = Occupant()
    if os.path.isdir(dst) and not os.path.islink(dst):
        old = occupant(store, directory, dst)
        if old.foreign or holds_cwd(dst):
            publish_into(src, dst, old)
            crash_point("after_rename")
            crash_point("after_commit")
            return
    try:
        fsops.exchange(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    else:
        _durable_or_undone(dst, lambda: _quietly(fsops.exchange, src, dst))
        if os.path.islink(src):
            fsops.unlink(src)  # a link was there: the link goes, never what it points to
        elif os.path.isdir(src):
            keep_arrivals(src, dst, old)
            fsops.rmtree(src)  # now holds the replaced folder
        return
    parent, leaf = parent_of(directory), directory.rpartition("/")[2]
    aside = store.local_path(
        join_name(parent, aside_name(leaf, f"{os.getpid()}-{secrets.token_hex(4)}"))
    )
    assert aside is not None
    fsops.rename(dst, aside)
    crash_point("after_aside")
    try:
        fsops.rename(src, dst)
    except BaseException:
        fsops.rename(aside, dst)
        raise

    def undo() -> None:
        _quietly(fsops.rename, dst, src)
        _quietly(fsops.rename, aside, dst)

    _durable_or_undone(dst, undo)
    if os.path.islink(aside):
        fsops.unlink(aside)
        return
    if os.path.isdir(aside):
        keep_arrivals(aside, dst, old)
    fsops.rmtree(aside)


def _durable_or_undone(dst: str, undo: Callable[[], None]) -> None:
    """After the publishing rename of ``dst``: fsync its directory, or undo the publish and
    raise."""
    crash_point("after_rename")
    try:
        fsops.fsync_dir(os.path.dirname(dst))
    except BaseException:
        undo()
        raise
    crash_point("after_commit")


def _quietly(fn: Callable[[str, str], None], a: str, b: str) -> None:
    with contextlib.suppress(OSError):
        fn(a, b)


def restore_aside(store: Store, parent: str) -> None:
    """Move back folders left aside by a crash between the two renames of a replacement.

    Runs on the write path (under the commit lock of ``parent``: every file and folder commit,
    and ``stagesave gc``), never on a read; until then readers offer an aside folder that is
    the only copy where it lies. Where the directory cannot be changed (read-only, permission
    denied) the repair is skipped with a warning: the save's own write reports the cause.
    """
    base = store.local_path(parent)
    if not base:
        return
    for leaf in store.list_dirs(parent):
        parsed = parse_aside_name(leaf)
        if parsed is None:
            continue  # not one of ours, whatever it resembles
        original, pid = parsed
        if pid_alive(pid, ours_alive=False):
            continue  # a live process is in the middle of its two renames
        src = os.path.join(base, leaf)
        dst = os.path.join(base, original)
        try:
            if original and not os.path.lexists(dst):
                fsops.rename(src, dst)
                fsops.fsync_dir(base)
            else:
                remove_tree(store, join_name(parent, leaf))
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            warnings.warn(
                f"could not move {src} back to {dst} ({exc.strerror or exc}): readers keep "
                "offering it where it is",
                stacklevel=2,
            )


