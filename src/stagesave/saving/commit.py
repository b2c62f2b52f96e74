"""The commit protocol, in one place: files, folders, links, removals, copies to another store.

Format 2 makes a checkpoint's proof part of its bytes, so committing is publishing:

* **A file** is written to an invisible temporary (POSIX: a dot-named temp file in the same
  directory; S3: an open multipart upload), made durable, then sealed with its proof; under the
  directory's commit lock the save takes its sequence number (one more than any committed in the
  directory), writes the proof, and publishes (POSIX: fsync, rename over the final name, also
  for ``last.ckpt``, directory fsync; S3: completing the upload). A crash leaves the old file or
  the new one, each self-proving, plus debris under temporary names.
* **A folder** is assembled under a dot-named temporary beside it (or in ``staging_dir``): every
  file complete with its own proof, the *carrier* last (a torch file where there is one), whose
  proof names every other file of the folder. It is published by one rename (swapped with the
  old folder by ``RENAME_EXCHANGE`` where the filesystem can; otherwise the old one is moved
  aside first and put back by the next writer after a crash between the two renames). On object
  stores, which cannot rename a folder, the old carrier goes first (the folder is invalid from
  then on), files the new save does not write go next, and the new carrier is written last:
  that object is the commit.
* **A link** (Lightning's ``save_last="link"``) is a relative symbolic link created under a
  temporary name and renamed over the old one.

Removal and retention are :mod:`.retire`, copies :mod:`.transfer`, the rename primitives
:mod:`.publish`. Every mutating filesystem call goes through :mod:`stagesave.stores.posix`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._crash import crash_point
from ..ondisk.manifest import FileEntry, FolderProof, Member
from ..ondisk.names import (
    TMP_MARKER,
)
from ..restore.discovery import next_seq
from ..stores import posix as fsops
from ..stores.base import Store
from ..stores.local import LocalStore, makedirs_durable, temp_name_for
from .publish import (
    clear_for_rewrite,
    drop_sidecars,
    join_name,
    parent_of,
    remove_tree,
    rename_into_place,
    restore_aside,
)
from .retire import remove_checkpoint, retain
from .transfer import copy_checkpoint, copy_file
from .write import FileToWrite, WriteStats, Written, write_data

__all__ = [
    "CARRIER_PREFERENCE",
    "choose_carrier",
    "commit_file",
    "commit_folder",
    "commit_link",
    "copy_checkpoint",
    "copy_file",
    "remove_checkpoint",
    "remove_tree",
    "rename_into_place",
    "restore_aside",
    "retain",
]

#: Which file of a folder carries the folder's proof: the first kind found in this order (torch
#: files end with a footer, so finding the carrier costs one small read).
CARRIER_PREFERENCE = ("dcp-metadata", "torch", "dcp", "safetensors")

Telemetry = Callable[[], dict[str, Any]]


def commit_file(
    store: Store,
    f: FileToWrite,
    *,
    algorithm: str,
    chunk_bytes: int,
    pool: cf.Executor,
    stats: WriteStats,
    metadata: dict[str, Any],
    telemetry: Telemetry,
    written: Written | None = None,
    seq: int | None = None,
    created_ns: int | None = None,
) -> Written:
    """Write, seal and publish one file. Returns it as written (``.manifest``, ``.length``).

    ``written``: the data already written (device staging writes it its own way). ``seq`` and
    ``created_ns`` (migration of older checkpoints): recorded instead of the next sequence number
    of the directory and the time now.

    Raises:
        Whatever failed; nothing is published and the temporary is gone.
    """
    w = (
        written
        if written is not None
        else write_data(
            store, f, algorithm=algorithm, chunk_bytes=chunk_bytes, pool=pool, stats=stats
        )
    )
    directory = parent_of(f.name)
    try:
        with store.commit_lock(f.name):
            restore_aside(store, directory)  # a read never repairs: the next write does
            w.seal(
                seq=next_seq(store, directory) if seq is None else seq,
                created_ns=time.time_ns() if created_ns is None else created_ns,
                metadata=metadata,
                telemetry=telemetry(),
            )
            w.finish(stats)
            w.publish()
            crash_point("after_rename")
    except BaseException:
        w.abort()
        raise
    crash_point("after_commit")
    drop_sidecars(store, f.name)
    return w


def choose_carrier(files: Sequence[FileToWrite]) -> FileToWrite:
    """The file of a folder that carries the folder's proof.

    Raises:
        ValueError: only raw files (none of them can hold a proof).
    """
    for kind in CARRIER_PREFERENCE:
        for f in files:
            if f.image.kind == kind:
                return f
    raise ValueError(
        "a folder checkpoint needs at least one torch or safetensors file to carry its proof; "
        "it holds only raw files"
    )


def commit_folder(
    store: Store,
    directory: str,
    files: Sequence[FileToWrite],
    *,
    algorithm: str,
    chunk_bytes: int,
    pool: cf.Executor,
    stats: WriteStats,
    metadata: dict[str, Any],
    telemetry: Telemetry,
    staging_dir: str | None = None,
    write: Callable[[Store, FileToWrite], Written] | None = None,
    seq: int | None = None,
    created_ns: int | None = None,
    nested: Sequence[str] = (),
) -> list[Written]:
    """Write ``files`` (names relative to ``directory``) and commit them as one folder checkpoint.

    Returns the files as written, the carrier last. ``seq``/``created_ns`` as in
    :func:`commit_file`.
    ``nested``: sub-folders that are folder checkpoints of their own and will be in the folder
    (moved in by the caller, e.g. an FSDP checkpoint's DCP parts): named in its proof.

    ``write`` writes one file's data (default :func:`write_data`; device staging passes its own).
    ``staging_dir`` (a local target's parent): assemble the folder there instead of beside the
    target (same filesystem).

    Raises:
        ValueError: the folder has no file that can carry its proof.
    """
    carrier = choose_carrier(files)
    ordered = [f for f in files if f is not carrier] + [carrier]
    token = secrets.token_hex(16)
    parent, leaf = parent_of(directory), directory.rpartition("/")[2]
    local_parent = store.local_path(parent)
    wstore: Store = store
    if local_parent and staging_dir:
        makedirs_durable(staging_dir)
        wstore = LocalStore(staging_dir, direct_io=getattr(store, "direct_io", True))
        staging = f"{leaf}.{os.getpid()}-{secrets.token_hex(4)}{TMP_MARKER}"
    elif local_parent:
        staging = join_name(parent, f".{leaf}.{os.getpid()}-{secrets.token_hex(4)}{TMP_MARKER}")
    else:
        staging = directory
        clear_for_rewrite(store, directory, {(f.entry_name or f.name) for f in files})

    def write_one(f: FileToWrite) -> Written:
        target = FileToWrite(
            f"{staging}/{f.entry_name or f.name}",
            f.image,
            f.view,
            f.crcs,
            f.device_data,
            f.entry_name or f.name,
        )
        if write is not None:
            return write(wstore, target)
        return write_data(
            wstore, target, algorithm=algorithm, chunk_bytes=chunk_bytes, pool=pool, stats=stats
        )

    pending: list[Written] = []
    try:
        members: list[Member] = []
        listed: list[FileEntry] = []
        carrier_name = carrier.entry_name or carrier.name
        created = time.time_ns() if created_ns is None else created_ns
        for f in ordered[:-1]:
            w = write_one(f)
            pending.append(w)
            w.seal(
                seq=None,
                created_ns=created,
                metadata={},
                folder=FolderProof(token, carrier_name).to_doc(False),
                summary_folder=(token, carrier_name),
            )
            w.finish(stats)
            w.publish()
            if f.image.kind == "raw":
                listed.append(w.entry)
            else:
                members.append(Member(w.entry.name, w.length, w.proof_crc))
        w = write_one(carrier)
        pending.append(w)
        folder_doc = FolderProof(token, carrier_name, members, listed, list(nested)).to_doc(True)
        with store.commit_lock(directory):
            if local_parent:
                restore_aside(store, parent)
            w.seal(
                seq=next_seq(store, parent) if seq is None else seq,
                created_ns=created,
                metadata=metadata,
                folder=folder_doc,
                summary_folder=(token, carrier_name),
                telemetry=telemetry(),
            )
            w.finish(stats)
            w.publish()
            if local_parent:
                src = wstore.local_path(staging)
                dst = store.local_path(directory)
                assert src is not None and dst is not None
                fsops.fsync_dir(src)
                rename_into_place(store, src, dst, directory)
            else:
                crash_point("after_rename")
                crash_point("after_commit")
    except BaseException:
        for p in pending:
            p.abort()
        if local_parent:
            remove_tree(wstore, staging)
        raise
    store.folder_committed(directory)
    return pending


def commit_link(link: str, target: str) -> None:
    """Point the symbolic link ``link`` at ``target`` (both local paths) atomically and durably.

    A relative link is created under a temporary name beside ``link`` and renamed over it; a
    real folder of the link's name is removed first in one step.
    """
    link, target = os.path.abspath(link), os.path.abspath(target)
    directory = os.path.dirname(link)
    tmp = temp_name_for(link)
    fsops.symlink(os.path.relpath(target, directory), tmp)
    try:
        if os.path.isdir(link) and not os.path.islink(link):
            debris = temp_name_for(link)
            fsops.rename(link, debris)
            fsops.rmtree(debris)
        fsops.replace(tmp, link)
    except BaseException:
        with contextlib.suppress(OSError):
            fsops.unlink(tmp)
        raise
    crash_point("after_rename")
    fsops.fsync_dir(directory)
