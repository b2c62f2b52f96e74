"""Copies of committed checkpoints to another store (a tier upload, an export).

The committed bytes are written as they are, every chunk checked against the proof on the way
(before any byte goes out): the copy proves itself too.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import secrets
import time
from collections.abc import Callable

from .._crash import crash_point
from ..errors import IntegrityError
from ..ondisk.manifest import FileEntry, Manifest
from ..ondisk.names import (
    TMP_MARKER,
)
from ..restore.discovery import CheckpointInfo
from ..restore.proof import chunk_problems
from ..stores import posix as fsops
from ..stores.base import Store
from .publish import clear_for_rewrite, join_name, parent_of, remove_tree, rename_into_place
from .write import WriteStats, run_all

__all__ = ["copy_checkpoint", "copy_file"]

#: Bytes per write when copying a committed file (page-aligned, whatever its proof's chunk size).
_COPY_SPAN = 32 << 20


def copy_file(
    dst: Store,
    name: str,
    data: memoryview,
    entry: FileEntry,
    *,
    pool: cf.Executor,
    stats: WriteStats,
) -> None:
    """Write the committed bytes ``data`` of one file to ``dst`` under ``name`` and publish them,
    checking each chunk against ``entry`` on the way (a copy that rotted is never published).

    Raises:
        IntegrityError: a chunk does not match the proof.
    """
    t0 = time.perf_counter()
    size = len(data)
    # before any byte goes out: a copy that rotted never does
    problems = chunk_problems(None, Manifest([entry], 0), pool,
                              read=lambda lo, n: data[lo : lo + n], where=name)
    if problems:
        raise IntegrityError(
            f"the local copy of {name} no longer matches its proof ({problems[0]}): it was not "
            f"copied to {dst.describe(name)}. The local disk may be failing."
        )
    step = _COPY_SPAN
    pending = dst.begin_write(name, data, size)
    try:

        def one(i: int) -> None:
            pending.write_range(i * step, min(size, (i + 1) * step))
            crash_point("during_upload")

        run_all(pool, one, max(1, (size + step - 1) // step))
        pending.finish()
        pending.publish()
    except BaseException:
        pending.abort()
        raise
    stats.write_s += time.perf_counter() - t0


def copy_checkpoint(
    src: Store,
    info: CheckpointInfo,
    dst: Store,
    *,
    pool: cf.Executor,
    stats: WriteStats,
    read: Callable[[str], contextlib.AbstractContextManager[memoryview]],
) -> None:
    """Copy a committed checkpoint (file or folder) from ``src`` to the same name in ``dst``.

    ``read(name)`` gives a file's bytes (a memory map of the local copy). A folder is copied
    carrier last, after the old folder's carrier was removed (object stores) or assembled beside
    and renamed (local destinations).
    """
    m = info.manifest
    assert m is not None
    if not info.is_dir:
        with read(info.name) as data:
            copy_file(dst, info.name, data, m.files[0], pool=pool, stats=stats)
        return
    from ..restore.discovery import folder_entries

    entries, problems = folder_entries(src, info)
    if problems:
        raise IntegrityError(f"{info.path} is not intact: {problems[0]}")
    parent, leaf = parent_of(info.name), info.name.rpartition("/")[2]
    local_parent = dst.local_path(parent)
    staging = (
        join_name(parent, f".{leaf}.{os.getpid()}-{secrets.token_hex(4)}{TMP_MARKER}")
        if local_parent
        else info.name
    )
    if not local_parent:
        clear_for_rewrite(dst, info.name, {e[0] for e in entries})
    carrier = m.folder.carrier if m.folder is not None else None
    order = [e for e in entries if e[0] != carrier] + [e for e in entries if e[0] == carrier]
    try:
        for fname, own, listed in order:
            entry = listed if listed is not None else (own.files[0] if own is not None else None)
            assert entry is not None
            with read(f"{info.name}/{fname}") as data:
                copy_file(dst, f"{staging}/{fname}", data, entry, pool=pool, stats=stats)
        if local_parent:
            src_path, dst_path = dst.local_path(staging), dst.local_path(info.name)
            assert src_path is not None and dst_path is not None
            with dst.commit_lock(info.name):
                fsops.fsync_dir(src_path)
                rename_into_place(dst, src_path, dst_path, info.name)
    except BaseException:
        if local_parent:
            remove_tree(dst, staging)
        raise
