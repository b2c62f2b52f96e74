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
* **Removal** makes a checkpoint vanish in one step (rename to a temporary name, then delete;
  on object stores the carrier first), so a half-removed checkpoint is never valid.
* **A link** (Lightning's ``save_last="link"``) is a relative symbolic link created under a
  temporary name and renamed over the old one.
* **A copy** to another store (a tier upload, an export) writes the committed bytes as they are,
  checking every chunk against the proof on the way: the copy proves itself too.

Every mutating filesystem call goes through ``_fsops`` (the power-loss recorder wraps it).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import os
import secrets
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from .._crash import crash_point
from ..errors import IntegrityError
from ..ondisk.checksum import digest
from ..ondisk.manifest import FileEntry, FolderProof, Member
from ..ondisk.names import (
    DIR_MANIFEST,
    TMP_MARKER,
    aside_name,
    parse_aside_name,
    split_manifest_name,
)
from ..restore.discovery import CheckpointInfo, is_sidecar_of, next_seq, resolve_dir, scan
from ..stores import posix as fsops
from ..stores.base import Store
from ..stores.local import LocalStore, makedirs_durable, temp_name_for
from .write import FileToWrite, WriteStats, Written, run_all, write_data

__all__ = [
    "CARRIER_PREFERENCE", "commit_file", "commit_folder", "commit_link", "copy_checkpoint", "remove_checkpoint",
    "restore_aside",
]

#: Which file of a folder carries the folder's proof: the first kind found in this order (torch
#: files end with a footer, so finding the carrier costs one small read).
CARRIER_PREFERENCE = ("dcp-metadata", "torch", "dcp", "safetensors")

Telemetry = Callable[[], dict[str, Any]]
#: Bytes per write when copying a committed file (page-aligned, whatever its proof's chunk size).
_COPY_SPAN = 32 << 20


def _parent(name: str) -> str:
    return name.rpartition("/")[0]


def _join(parent: str, leaf: str) -> str:
    return f"{parent}/{leaf}" if parent else leaf


# ---------------------------------------------------------------------------- files
def commit_file(
    store: Store, f: FileToWrite, *, algorithm: str, chunk_bytes: int, pool: cf.Executor, stats: WriteStats,
    metadata: dict[str, Any], telemetry: Telemetry, written: Written | None = None,
    seq: int | None = None, created_ns: int | None = None,
) -> Written:
    """Write, seal and publish one file. Returns it as written (``.manifest``, ``.length``).

    ``written``: the data already written (device staging writes it its own way). ``seq`` and
    ``created_ns`` (migration of older checkpoints): recorded instead of the next sequence number
    of the directory and the time now.

    Raises:
        Whatever failed; nothing is published and the temporary is gone.
    """
    w = written if written is not None else write_data(store, f, algorithm=algorithm, chunk_bytes=chunk_bytes,
                                                       pool=pool, stats=stats)
    directory = _parent(f.name)
    try:
        with store.commit_lock(f.name):
            restore_aside(store, directory)  # a read never repairs: the next write does
            w.seal(seq=next_seq(store, directory) if seq is None else seq,
                   created_ns=time.time_ns() if created_ns is None else created_ns, metadata=metadata,
                   tensors=_tensor_index(f), telemetry=telemetry())
            w.finish(stats)
            w.publish()
            crash_point("after_rename")
    except BaseException:
        w.abort()
        raise
    crash_point("after_commit")
    _drop_sidecars(store, f.name)
    return w


def _tensor_index(f: FileToWrite) -> list[dict[str, Any]]:
    return [
        {"name": t.name, "storage": t.storage_key, "dtype": t.dtype, "shape": list(t.shape),
         "stride": list(t.stride), "storage_offset": t.storage_offset}
        for t in f.image.tensors
    ]


def _sidecars_of(store: Store, name: str) -> list[str]:
    """The format-1 manifests of ``name`` (files named like one that do not parse as one, or that
    describe another file, are a user's and never returned)."""
    directory, _, base = name.rpartition("/")
    try:
        listing = store.list(directory)
    except OSError:
        return []
    return [info.name for info in listing
            if (parsed := split_manifest_name(info.name.rpartition("/")[2])) is not None and parsed[0] == base
            and is_sidecar_of(store, info.name, base)]


def _drop_sidecars(store: Store, name: str) -> None:
    """Format-1 manifests of a name that now holds a format-2 file (or none) are debris."""
    for m in _sidecars_of(store, name):
        with contextlib.suppress(OSError):
            store.delete(m)


# ---------------------------------------------------------------------------- folders
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
    store: Store, directory: str, files: Sequence[FileToWrite], *, algorithm: str, chunk_bytes: int,
    pool: cf.Executor, stats: WriteStats, metadata: dict[str, Any], telemetry: Telemetry,
    staging_dir: str | None = None, write: Callable[[Store, FileToWrite], Written] | None = None,
    seq: int | None = None, created_ns: int | None = None, nested: Sequence[str] = (),
) -> list[Written]:
    """Write ``files`` (names relative to ``directory``) and commit them as one folder checkpoint.

    Returns the files as written, the carrier last. ``seq``/``created_ns`` as in :func:`commit_file`.
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
    parent, leaf = _parent(directory), directory.rpartition("/")[2]
    local_parent = store.local_path(parent)
    wstore: Store = store
    if local_parent and staging_dir:
        makedirs_durable(staging_dir)
        wstore = LocalStore(staging_dir, direct_io=getattr(store, "direct_io", True))
        staging = f"{leaf}.{os.getpid()}-{secrets.token_hex(4)}{TMP_MARKER}"
    elif local_parent:
        staging = _join(parent, f".{leaf}.{os.getpid()}-{secrets.token_hex(4)}{TMP_MARKER}")
    else:
        staging = directory
        _clear_for_rewrite(store, directory, {(f.entry_name or f.name) for f in files})

    def write_one(f: FileToWrite) -> Written:
        target = FileToWrite(f"{staging}/{f.entry_name or f.name}", f.image, f.view, f.crcs, f.device_data,
                             f.entry_name or f.name)
        if write is not None:
            return write(wstore, target)
        return write_data(wstore, target, algorithm=algorithm, chunk_bytes=chunk_bytes, pool=pool, stats=stats)

    pending: list[Written] = []
    try:
        members: list[Member] = []
        listed: list[FileEntry] = []
        carrier_name = carrier.entry_name or carrier.name
        created = time.time_ns() if created_ns is None else created_ns
        for f in ordered[:-1]:
            w = write_one(f)
            pending.append(w)
            w.seal(seq=None, created_ns=created, metadata={}, folder=FolderProof(token, carrier_name).to_doc(False),
                   summary_folder=(token, carrier_name))
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
            w.seal(seq=next_seq(store, parent) if seq is None else seq, created_ns=created, metadata=metadata,
                   folder=folder_doc,
                   summary_folder=(token, carrier_name), tensors=_tensor_index(carrier), telemetry=telemetry())
            w.finish(stats)
            w.publish()
            if local_parent:
                src = wstore.local_path(staging)
                dst = store.local_path(directory)
                assert src is not None and dst is not None
                fsops.fsync_dir(src)
                _rename_into_place(store, src, dst, directory)
            else:
                crash_point("after_rename")
                crash_point("after_commit")
    except BaseException:
        for p in pending:
            p.abort()
        if local_parent:
            _remove_tree(wstore, staging)
        raise
    store.folder_committed(directory)
    return pending


def _clear_for_rewrite(store: Store, directory: str, keep: set[str]) -> None:
    """Before a folder is rewritten in place (object stores): its old carrier first, so nothing
    half-overwritten is ever valid, then every file the new save will not write."""
    try:
        old = resolve_dir(store, directory)
    except OSError:
        old = None
    if old is not None and old.manifest is not None:
        if old.manifest.folder is not None:
            store.delete(f"{directory}/{old.manifest.folder.carrier}")
        elif old.manifest_name is not None:
            store.delete(old.manifest_name)
    from ..restore.discovery import list_tree

    prefix = len(directory) + 1
    for info in list_tree(store, directory):
        if info.name[prefix:] not in keep:
            store.delete(info.name)


def _remove_tree(store: Store, name: str) -> None:
    path = store.local_path(name)
    if path and os.path.isdir(path) and not os.path.islink(path):
        fsops.rmtree(path)


def _rename_into_place(store: Store, src: str, dst: str, directory: str) -> None:
    """Rename ``src`` to ``dst`` (swap, or aside then rename, when ``dst`` exists), durably."""
    if not os.path.lexists(dst):
        fsops.rename(src, dst)
        _durable_or_undone(dst, lambda: _quietly(fsops.rename, dst, src))
        return
    try:
        fsops.exchange(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    else:
        _durable_or_undone(dst, lambda: _quietly(fsops.exchange, src, dst))
        if os.path.isdir(src) and not os.path.islink(src):
            fsops.rmtree(src)  # now holds the replaced folder
        return
    parent, leaf = _parent(directory), directory.rpartition("/")[2]
    aside = store.local_path(_join(parent, aside_name(leaf, f"{os.getpid()}-{secrets.token_hex(4)}")))
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
    fsops.rmtree(aside)


def _durable_or_undone(dst: str, undo: Callable[[], None]) -> None:
    """After the publishing rename of ``dst``: fsync its directory, or undo the publish and raise."""
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
        if pid_alive(str(pid)):
            continue  # a live process is in the middle of its two renames
        src = os.path.join(base, leaf)
        dst = os.path.join(base, original)
        try:
            if original and not os.path.lexists(dst):
                fsops.rename(src, dst)
                fsops.fsync_dir(base)
            else:
                _remove_tree(store, _join(parent, leaf))
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            warnings.warn(f"could not move {src} back to {dst} ({exc.strerror or exc}): readers keep "
                          "offering it where it is", stacklevel=2)


def pid_alive(text: str) -> bool:
    """Whether the process whose id is ``text`` (from a temporary's name) is alive on this host.

    Our own pid counts as dead: names this process created are its own to clean.
    """
    if not text.isdigit():
        return False
    pid = int(text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------- removal
def remove_checkpoint(store: Store, name: str, *, is_dir: bool | None = None, debris_dir: str | None = None) -> None:
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
        _drop_sidecars(store, name)
        return
    if is_dir is None:
        try:
            store.info(name)
            is_dir = False
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            is_dir = bool(store.list(name)) or bool(store.list_dirs(name))
    if is_dir:
        _clear_for_rewrite(store, name, set())
        crash_point("during_retention")
        return
    for m in _sidecars_of(store, name):  # format 1: the manifest first, so a half-removed file is never valid
        store.delete(m)
    crash_point("during_retention")
    store.delete(name)


def retain(
    store: Store, directory: str, keep: int, *, skip: Callable[[CheckpointInfo], bool] | None = None,
    debris_dir: str | None = None,
) -> list[str]:
    """Keep the ``keep`` newest committed checkpoints of ``directory``; remove older ones.

    Runs under the directory's commit lock. ``skip``: checkpoints never to remove (a tiered
    store's not-yet-uploaded ones). ``debris_dir`` as in :func:`remove_checkpoint`. Returns the
    names removed.
    """
    removed = []
    with store.commit_lock(_join(directory, DIR_MANIFEST)):
        committed = [c for c in scan(store, directory) if c.status == "committed"]
        for old in committed[keep:]:
            if skip is not None and skip(old):
                continue
            remove_checkpoint(store, old.name, is_dir=old.is_dir, debris_dir=debris_dir)
            removed.append(old.name)
    return removed


# ---------------------------------------------------------------------------- links
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


# ---------------------------------------------------------------------------- copies
def copy_file(
    dst: Store, name: str, data: memoryview, entry: FileEntry, *, pool: cf.Executor, stats: WriteStats,
) -> None:
    """Write the committed bytes ``data`` of one file to ``dst`` under ``name`` and publish them,
    checking each chunk against ``entry`` on the way (a copy that rotted is never published).

    Raises:
        IntegrityError: a chunk does not match the proof.
    """
    t0 = time.perf_counter()
    size = len(data)
    cb = entry.chunk_bytes

    def check(i: int) -> None:
        lo, hi = i * cb, min(entry.end, (i + 1) * cb)
        chunk = data[lo:hi]
        if entry.blank is not None and lo < entry.blank[0] + entry.blank[1] and entry.blank[0] < hi:
            b = bytearray(chunk)
            a, z = max(lo, entry.blank[0]), min(hi, entry.blank[0] + entry.blank[1])
            b[a - lo : z - lo] = b" " * (z - a)
            chunk = memoryview(bytes(b))
        if digest(entry.algorithm, chunk) != entry.chunks[i]:
            raise IntegrityError(f"the local copy of {name} no longer matches its proof (bytes [{lo}, {hi}) "
                                 f"differ): it was not copied to {dst.describe(name)}. The local disk may be "
                                 "failing.")

    run_all(pool, check, len(entry.chunks))  # before any byte goes out: a copy that rotted never does
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
    src: Store, info: CheckpointInfo, dst: Store, *, pool: cf.Executor, stats: WriteStats,
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
    parent, leaf = _parent(info.name), info.name.rpartition("/")[2]
    local_parent = dst.local_path(parent)
    staging = _join(parent, f".{leaf}.{os.getpid()}-{secrets.token_hex(4)}{TMP_MARKER}") if local_parent else info.name
    if not local_parent:
        _clear_for_rewrite(dst, info.name, {e[0] for e in entries})
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
                _rename_into_place(dst, src_path, dst_path, info.name)
    except BaseException:
        if local_parent:
            _remove_tree(dst, staging)
        raise
