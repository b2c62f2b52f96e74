"""Committing a directory of files as one checkpoint (Accelerate's layout, sharded saves).

On a POSIX store the files are written into a hidden temporary directory beside the target (or,
with ``staging_dir``, into ``<staging_dir>/<name>.<token>`` on the same filesystem, outside a
folder that another program lists), the directory manifest goes in last, and the whole directory
is renamed into place: a reader (or Accelerate's own ``load_state``) never sees a half-written
checkpoint folder. Only after that rename does the store hear of the commit
(``Store.folder_committed``: a tiered store then uploads the folder), so no store has to guess
the final name from a temporary one. Replacing an
existing folder moves the old one aside first (``.<name>.<token>.stagesave-aside``) and deletes it
after the new one is in place; if a crash strikes between the two renames, discovery moves the
aside folder back. On object stores there is no directory rename: the old directory manifest is
deleted first (so nothing half-overwritten is ever valid), the files are written, and the
manifest is written last, which is the commit.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from . import _fsops as fsops
from ._commit import FileToWrite, WriteStats, write_file
from ._crash import crash_point
from ._device import DeviceFile, write_device_file
from ._local import LocalStore, _fsync_dir, makedirs_durable
from ._manifest import FileEntry, Manifest
from ._names import DIR_MANIFEST, TMP_MARKER, aside_name
from ._store import Store

__all__ = ["commit_directory", "restore_aside"]


def _split(name: str) -> tuple[str, str]:
    parent, _, leaf = name.rpartition("/")
    return parent, leaf


def _join(parent: str, leaf: str) -> str:
    return f"{parent}/{leaf}" if parent else leaf


def commit_directory(
    store: Store,
    directory: str,
    files: Sequence[FileToWrite],
    make_manifest: Callable[[list[FileEntry]], Manifest],
    *,
    algorithm: str,
    chunk_bytes: int,
    pool: cf.Executor,
    stats: WriteStats,
    staging_dir: str | None = None,
    kvikio: Any | None = None,
) -> None:
    """Write ``files`` (names relative to ``directory``) and commit them together.

    Files staged in device memory (``device_data``) are written by :func:`write_device_file`,
    through ``kvikio`` when given (GPUDirect Storage); they need a local target.

    ``staging_dir`` (stores whose target parent is a local directory: a local root, a tiered
    root's local tier): stage the folder there instead of beside the target, e.g. outside a
    folder that another program lists (it must be on the same filesystem). Its files are written
    as the store writes its own (``direct_io``), then the folder is renamed into place.
    """
    parent, leaf = _split(directory)
    local_parent = store.local_path(parent)
    token = f"{os.getpid()}-{secrets.token_hex(4)}{TMP_MARKER}"
    wstore: Store = store
    if local_parent and staging_dir:
        makedirs_durable(staging_dir)
        wstore = LocalStore(staging_dir, direct_io=getattr(store, "direct_io", True))
        staging = f"{leaf}.{token}"
    else:
        staging = _join(parent, f".{leaf}.{token}") if local_parent else directory
    if not local_parent:
        store.delete(f"{directory}/{DIR_MANIFEST}")  # an overwritten folder is never valid
    publishers: list[Callable[[], None]] = []
    aborters: list[Callable[[], None]] = []
    try:
        entries = []
        for f in files:
            if f.device_data is not None:
                assert isinstance(wstore, LocalStore), "device staging writes local files only"
                entry, publish, abort = write_device_file(
                    wstore,
                    DeviceFile(f"{staging}/{f.name}", f.device_data, f.size, f.serialization_id,
                               f.id_offset, f.storages, kind=f.kind, entry_name=f.name),
                    algorithm=algorithm, chunk_bytes=chunk_bytes, pool=pool, stats=stats, kvikio=kvikio,
                )
            else:
                target = FileToWrite(
                    f"{staging}/{f.name}", f.image, f.size, f.kind, f.serialization_id, f.id_offset,
                    f.storages, entry_name=f.name, digests=f.digests,
                )
                entry, publish, abort = write_file(
                    wstore, target, algorithm=algorithm, chunk_bytes=chunk_bytes, pool=pool, stats=stats
                )
            entries.append(entry)
            publishers.append(publish)
            aborters.append(abort)
        for publish in publishers:
            publish()
        crash_point("before_manifest")
        wstore.put_atomic(f"{staging}/{DIR_MANIFEST}", make_manifest(entries).to_json())
        crash_point("after_manifest")
        if local_parent:
            _move_into_place(store, staging, directory, src_path=wstore.local_path(staging))
    except BaseException:
        for abort in aborters:
            abort()
        if local_parent:
            _remove_tree(wstore, staging)
        raise


def _remove_tree(store: Store, name: str) -> None:
    path = store.local_path(name)
    if path and os.path.isdir(path) and not os.path.islink(path):
        fsops.rmtree(path)


def _move_into_place(store: Store, staging: str, directory: str, *, src_path: str | None = None) -> None:
    """Publish the staged folder under its final name, then tell the store (``folder_committed``).

    The rename runs under the directory's commit lock. Replacing an existing folder swaps the two
    atomically (``renameat2(RENAME_EXCHANGE)``) where the filesystem can, so readers never see the
    name missing; elsewhere the old folder is moved aside first. If the directory fsync that makes
    the publish durable fails, the publish is undone (the old folder back under its name) before
    the error propagates, and the store hears of nothing.
    """
    src = src_path or store.local_path(staging)
    dst = store.local_path(directory)
    assert src is not None and dst is not None
    with store.commit_lock(directory):
        _rename_into_place(store, src, dst, directory)
    store.folder_committed(directory)


def _rename_into_place(store: Store, src: str, dst: str, directory: str) -> None:
    """Rename ``src`` to ``dst`` (swap, or aside then rename, when ``dst`` exists), durably."""
    parent, leaf = _split(directory)
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
    _replace_with_aside(store, src, dst, parent, leaf)


def _replace_with_aside(store: Store, src: str, dst: str, parent: str, leaf: str) -> None:
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
    _remove_tree(store, _join(parent, os.path.basename(aside)))


def _durable_or_undone(dst: str, undo: Callable[[], None]) -> None:
    """After the publishing rename of ``dst``: fsync its directory, or undo the publish and raise."""
    crash_point("after_rename")
    try:
        _fsync_dir(os.path.dirname(dst))
    except BaseException:
        undo()
        raise
    crash_point("after_commit")


def _quietly(fn: Callable[[str, str], None], a: str, b: str) -> None:
    try:
        fn(a, b)
    except OSError:
        pass


def restore_aside(store: Store, parent: str) -> None:
    """Move back folders left aside by a crash between the two renames of a replacement."""
    base = store.local_path(parent)
    if not base:
        return
    for leaf in store.list_dirs(parent):
        if not leaf.endswith(".stagesave-aside") or not leaf.startswith("."):
            continue
        original, _, token = leaf[1 : -len(".stagesave-aside")].rpartition(".")
        if _pid_alive(token.split("-", 1)[0]):
            continue  # a live process is in the middle of its two renames
        src = os.path.join(base, leaf)
        dst = os.path.join(base, original)
        if original and not os.path.lexists(dst):
            fsops.rename(src, dst)
            _fsync_dir(base)
        else:
            _remove_tree(store, _join(parent, leaf))


def _pid_alive(text: str) -> bool:
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
