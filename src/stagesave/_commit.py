"""The commit protocol, in one place.

One order serves every store, because each store maps the steps onto its own atomic primitive:

1. data to an invisible temporary (POSIX: a temp file; S3: an open multipart upload), written in
   parallel chunks, each hashed as it is written unless its digest was computed during the
   staging copy, then made durable (fsync / all parts up);
2. the manifest to its final name (``<file>.<serialization_id>.stagesave.json``), durably;
3. the atomic publish of the data (POSIX: rename over the old file + directory fsync;
   S3: completing the multipart upload);
4. removal of the manifest of the file that was replaced.

A crash before 3 leaves the old file with its own manifest (the new manifest names an id that no
file has: debris); after 3, the new file with its own. Nothing is ever half-visible, and a
failure at any step aborts the temporary and removes the new manifest, so an error never
publishes.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from . import _fsops as fsops
from ._checksum import digest
from ._crash import crash_point
from ._manifest import FileEntry, Manifest, StorageRecord
from ._names import manifest_name, split_manifest_name
from ._store import PendingWrite, Store

__all__ = ["FileToWrite", "commit_files", "file_entry", "finish_data", "run_all", "write_file"]

T = TypeVar("T")


@dataclass
class FileToWrite:
    """A data file whose bytes are ``image[:size]``."""

    name: str
    image: memoryview
    size: int
    kind: str = "torch"
    serialization_id: str | None = None
    id_offset: int | None = None
    storages: Sequence[StorageRecord] = ()
    #: Name recorded in the manifest (relative to the manifest's directory).
    entry_name: str | None = None
    #: Chunk digests computed while staging (then the writers only write).
    digests: Sequence[str] | None = None
    #: With device staging: the bytes in device memory (a uint8 tensor), instead of ``image``.
    device_data: Any = None


@dataclass
class WriteStats:
    write_s: float = 0.0
    checksum_s: float = 0.0
    fsync_s: float = 0.0
    direct_io: bool | None = None


def run_all(pool: cf.Executor, fn: Callable[[int], T], n: int) -> list[T]:
    """``[fn(0), ..., fn(n - 1)]`` on ``pool``; on failure, raise the first error in order only
    after every call has ended (``Executor.map`` would leave started calls running behind the
    caller's cleanup: writes into a closed or reused descriptor)."""
    futures: list[cf.Future[T]] = []
    try:
        for i in range(n):
            futures.append(pool.submit(fn, i))
    except BaseException:  # e.g. the pool shut down meanwhile: let the submitted ones end first
        for f in futures:
            f.cancel()
        cf.wait(futures)
        raise
    done, _ = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
    if any(f.exception() is not None for f in done):
        for f in futures:
            f.cancel()  # those not started yet
        cf.wait(futures)
    return [f.result() for f in futures]


def finish_data(pending: PendingWrite, stats: WriteStats) -> None:
    """Make a temporary's written data durable (step 1's end), timed into ``stats.fsync_s``."""
    crash_point("after_data")
    f0 = time.perf_counter()
    pending.finish()
    stats.fsync_s += time.perf_counter() - f0
    crash_point("after_data_fsync")


def write_file(
    store: Store,
    f: FileToWrite,
    *,
    algorithm: str,
    chunk_bytes: int,
    pool: cf.Executor,
    stats: WriteStats,
) -> tuple[FileEntry, Callable[[], None], Callable[[], None]]:
    """Write ``f`` to an invisible temporary, hashing each chunk as it is written.

    Returns:
        The manifest entry, and the publish and abort callables of the temporary.
    """
    t0 = time.perf_counter()
    crash_point("before_data")
    pending = store.begin_write(f.name, f.image, f.size)
    try:
        n_chunks = (f.size + chunk_bytes - 1) // chunk_bytes
        hash_time = [0.0] * n_chunks

        pre = f.digests
        if pre is not None and len(pre) != n_chunks:
            raise ValueError(f"{len(pre)} precomputed digests for {n_chunks} chunks")

        def one(i: int) -> str:
            lo, hi = i * chunk_bytes, min(f.size, (i + 1) * chunk_bytes)
            if pre is not None:
                d = pre[i]
            else:
                h0 = time.perf_counter()
                d = digest(algorithm, f.image[lo:hi])
                hash_time[i] = time.perf_counter() - h0
            pending.write_range(lo, hi)
            if i == 0 and n_chunks > 1:
                crash_point("mid_data")
            return d

        digests = run_all(pool, one, n_chunks)
        finish_data(pending, stats)
    except BaseException:
        pending.abort()
        raise
    stats.checksum_s += sum(hash_time)
    stats.write_s += time.perf_counter() - t0
    stats.direct_io = getattr(pending, "direct", None)
    return file_entry(f, algorithm, chunk_bytes, digests), pending.publish, pending.abort


class _WrittenFile(Protocol):
    name: str
    entry_name: str | None
    size: int
    kind: str
    serialization_id: str | None
    id_offset: int | None
    storages: Sequence[StorageRecord]


def file_entry(f: _WrittenFile, algorithm: str, chunk_bytes: int, digests: Sequence[str]) -> FileEntry:
    """The manifest entry of a data file written with these chunk digests."""
    return FileEntry(
        name=f.entry_name or f.name.rsplit("/", 1)[-1],
        size=f.size,
        algorithm=algorithm,
        chunk_bytes=chunk_bytes,
        chunks=tuple(digests),
        kind=f.kind,
        serialization_id=f.serialization_id,
        id_offset=f.id_offset,
        storages=tuple(f.storages),
    )


def chunk_digests(
    view: memoryview, size: int, *, algorithm: str, chunk_bytes: int, pool: cf.Executor
) -> list[str]:
    """Digests of every chunk of ``view[:size]``, computed in parallel (the hashes drop the GIL)."""
    n = (size + chunk_bytes - 1) // chunk_bytes
    return list(pool.map(lambda i: digest(algorithm, view[i * chunk_bytes : min(size, (i + 1) * chunk_bytes)]), range(n)))


def commit_files(
    store: Store,
    manifest_path: str,
    manifest: Manifest,
    publishers: Sequence[Callable[[], None]],
    aborters: Sequence[Callable[[], None]],
    replaced_manifests: Sequence[str] = (),
    *,
    name: str | None = None,
) -> None:
    """Steps 2-4: manifest, atomic publish of every file, removal of replaced manifests.

    With ``name``, the manifests to replace are listed under the store's commit lock, which is
    held until they are removed: two processes committing the same path cannot delete each
    other's manifest (the later rename wins, with its own manifest).
    """
    with store.commit_lock(name) if name is not None else contextlib.nullcontext():
        replaced = list(replaced_manifests)
        if name is not None:
            try:
                replaced = sibling_manifests(store, name)
            except OSError:
                replaced = []
        try:
            crash_point("before_manifest")
            store.put_atomic(manifest_path, manifest.to_json())
            crash_point("after_manifest")
        except BaseException:
            for abort in aborters:
                abort()
            raise
        try:
            for publish in publishers:
                publish()
                crash_point("after_rename")
        except BaseException:
            for abort in aborters:
                abort()
            store.delete(manifest_path)
            raise
        crash_point("after_commit")
        for old in replaced:
            if old != manifest_path:
                store.delete(old)


def sibling_manifests(store: Store, name: str) -> list[str]:
    """Manifests in ``name``'s directory that belong to a file called ``name``."""
    directory, _, base = name.rpartition("/")
    out = []
    for info in store.list(directory):
        leaf = info.name.rpartition("/")[2]
        parsed = split_manifest_name(leaf)
        if parsed is not None and parsed[0] == base:
            out.append(info.name)
    return out


def manifest_path_for(name: str, serialization_id: str) -> str:
    directory, slash, base = name.rpartition("/")
    return f"{directory}{slash}{manifest_name(base, serialization_id)}"


def retire_file(store: Store, name: str, manifests: Sequence[str]) -> None:
    """Delete a committed file so that no step of the deletion leaves a valid-looking checkpoint.

    Locally the data file is first renamed to a temporary name (an atomic step that makes it
    debris), then its manifests go, then the debris. On object stores, which cannot rename, the
    manifests go first and the data object after.
    """
    from ._local import temp_name_for

    local = store.local_path(name)
    if local is not None:
        debris = temp_name_for(local)
        try:
            fsops.rename(local, debris)
        except FileNotFoundError:
            debris = ""
        for m in manifests:
            store.delete(m)
        crash_point("during_retention")
        if debris:
            fsops.unlink(debris)
        return
    for m in manifests:
        store.delete(m)
    crash_point("during_retention")
    store.delete(name)
