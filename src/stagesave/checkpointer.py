"""The Checkpointer: ``save`` returns after one copy into host memory; the rest is background."""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import io
import os
import signal
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import _fsops as fsops
from ._background import JobQueue
from ._checksum import DEFAULT_ALGORITHM, check_algorithm, digest
from ._commit import (
    FileToWrite,
    WriteStats,
    chunk_digests,
    commit_files,
    manifest_path_for,
    retire_file,
    sibling_manifests,
    write_file,
)
from ._crash import crash_point
from ._device import DeviceFile, device_of, gpudirect_kvikio, stage_on_device, write_device_file
from ._dircommit import commit_directory, restore_aside
from ._discovery import CheckpointInfo, raise_if_corrupt, resolve, resolve_dir, scan, verify_entry
from ._image import FileImage, plan_torch_file
from ._local import LocalStore
from ._manifest import FileEntry, Manifest, StorageRecord
from ._names import ALIGNMENT, DEFAULT_CHUNK_BYTES, DIR_MANIFEST, TELEMETRY_FILE, TMP_MARKER
from ._pool import BufferPool, HostBuffer
from ._stage import on_host, stage_and_hash, stage_image
from ._store import Store
from ._targets import StoreResolver
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ClosedError,
    IntegrityError,
    StorageError,
    oserror_to_checkpoint_error,
)
from .formats import plan_file
from .handle import SaveHandle
from .safety import safe_torch_load
from .telemetry import SaveTelemetry, TelemetryCallback

__all__ = ["Checkpointer"]

_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def flush_all(timeout: float | None = None) -> bool:
    """Wait (at most ``timeout`` seconds in all) for the pending saves of every Checkpointer.

    Failures are printed, not raised (this runs on the way out). Returns whether all finished.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    ok = True
    for ckpt in list(_live):
        q = ckpt._queue
        if q is None:
            continue
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not q.drain(left):
            ok = False
            print(f"stagesave: {q.pending()} checkpoint operations still running after {timeout} s; "
                  "they are not committed", file=sys.stderr)
        for h in ckpt._failed:
            err = h._claim_error()
            if err is not None:
                print(f"stagesave: a checkpoint save failed: {err}", file=sys.stderr)
    return ok


def flush_on_sigterm(timeout: float = 60.0) -> None:
    """On SIGTERM, let pending saves commit (for at most ``timeout`` s), then terminate as before.

    For loops outside a framework that handles SIGTERM itself (schedulers send it before a
    kill). The previous handler runs afterwards; with the default one the process then dies of
    SIGTERM as it would have. Call it from the main thread.
    """
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        flush_all(timeout)
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)


def _close_all_at_exit() -> None:
    for ckpt in list(_live):
        try:
            ckpt.close()
        except BaseException as exc:  # noqa: BLE001 - report, never hang the exit
            print(f"stagesave: a checkpoint save failed before exit: {exc}", file=sys.stderr)


# Flush before concurrent.futures refuses new work at interpreter shutdown: threading's exit
# hooks run in reverse order of registration, before atexit handlers and before
# concurrent.futures (imported above, so registered earlier) shuts its pools.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_close_all_at_exit)
else:  # pragma: no cover - other Python implementations
    atexit.register(_close_all_at_exit)


def _as_checkpoint_error(exc: BaseException, what: str) -> BaseException:
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        err = oserror_to_checkpoint_error(exc, what)
    elif isinstance(exc, Exception):
        err = StorageError(f"{what}: {type(exc).__name__}: {exc}")
    else:
        return exc
    err.__cause__ = exc
    return err


def _check_same_filesystem(store: Store, dname: str, staging_dir: str | os.PathLike[str]) -> None:
    """Refuse a ``staging_dir`` the folder cannot be renamed from (the target's local parent:
    a local root, or a tiered root's local tier)."""
    target_parent = store.local_path(dname.rpartition("/")[0])
    if target_parent is None:
        raise ValueError("staging_dir only applies to local targets (a local root or a tiered root's local tier)")
    from ._local import makedirs_durable

    makedirs_durable(os.fspath(staging_dir))
    if os.stat(staging_dir).st_dev != os.stat(target_parent).st_dev:
        raise ValueError(
            f"staging_dir {os.fspath(staging_dir)} is on another filesystem than {target_parent}: "
            "the finished folder is renamed into place, which needs the same filesystem"
        )


#: Telemetry fields known only after the commit: kept out of the manifest (written before it).
_POST_COMMIT = ("path", "error", "commit_s", "time_to_commit_s", "committed_at", "tier")


def _manifest_telemetry(tel: SaveTelemetry) -> dict[str, Any]:
    return {k: v for k, v in tel.to_dict().items() if k not in _POST_COMMIT}


def _lock_name(directory: str) -> str:
    """A name whose commit lock is the lock of ``directory`` itself (the root for ``""``)."""
    return f"{directory}/{DIR_MANIFEST}" if directory else ""


def _has(store: Store, name: str) -> bool:
    try:
        store.info(name)
        return True
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return False


class Checkpointer:
    """Asynchronous, verifiable checkpoints of any torch state.

    Args:
        root: Default directory (local path, fsspec URL or a :class:`Store`) for relative paths
            and for ``latest()``/``list()`` without arguments. Absolute paths and URLs given to
            ``save``/``load`` work without it.
        max_pending: Saves that may be in flight (one staging buffer each); a further save waits
            for a buffer instead of allocating more memory.
        checksum: ``"xxh3_128"`` (default, fast), ``"xxh3_64"``, ``"blake3"`` or ``"sha256"``.
        keep_last: After each commit keep only this many committed checkpoints in that
            directory (oldest removed first, manifest before data). ``None`` keeps all.
        io_threads: Threads writing chunks of one file in parallel.
        chunk_bytes: Size of a checksum chunk and of one write.
        direct_io: Write local files with O_DIRECT where the filesystem allows it.
        storage_options: Passed to fsspec for URLs (endpoint, credentials, region).
        telemetry_callback: Called with each save's :class:`SaveTelemetry`.
        telemetry_jsonl: ``True`` to append telemetry JSON lines to ``stagesave-telemetry.jsonl``
            beside local checkpoints, or a file path to append them to.
        safe_globals: Extra classes allowed when loading (see :mod:`stagesave.safety`).
        pinned: Pin staging buffers (default: when CUDA is available).
        checksum_in: where each chunk's checksum is computed (:meth:`save`, :meth:`save_dir`
            and ``stagesave.dcp``). ``"staging"``: on the caller's
            time, in the same pass as the copy of host state (each thread copies half an L2
            cache and hashes it while it is in cache), so the background only makes syscalls;
            ``"background"``: by the writer threads as they write each chunk;
            ``"auto"`` (default): ``"staging"`` when every byte was copied from host memory,
            ``"background"`` when a device-to-host copy is still in flight (hashing then would
            make the caller wait for the device). Hashing in the background costs a training
            loop that keeps every core busy more than the ~50 ms per GiB it adds to the
            blocking copy (BENCHMARKS.md, "training time lost per save").
        device_staging: Stage the state of a CUDA device in a reused buffer on that device
            (device-to-device copies) instead of host memory, and write it from there in the
            background: with GPUDirect Storage through kvikio when it is installed, otherwise
            through a pinned host bounce buffer. Costs one device buffer of the checkpoint's
            size per save in flight. Applies to :meth:`save` and :meth:`save_dir` of local
            files whose device tensors are on one CUDA device; other saves stage in host memory
            as usual.
    """

    def __init__(
        self,
        root: Store | str | os.PathLike[str] | None = None,
        *,
        max_pending: int = 2,
        checksum: str = DEFAULT_ALGORITHM,
        keep_last: int | None = None,
        io_threads: int = 4,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        direct_io: bool = True,
        storage_options: dict[str, Any] | None = None,
        telemetry_callback: TelemetryCallback | None = None,
        telemetry_jsonl: bool | str = False,
        safe_globals: Iterable[Any] = (),
        pinned: bool | None = None,
        checksum_in: str = "auto",
        device_staging: bool = False,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if chunk_bytes < ALIGNMENT or chunk_bytes % ALIGNMENT:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGNMENT}, got {chunk_bytes}")
        self.checksum = check_algorithm(checksum)
        if checksum_in not in ("auto", "background", "staging"):
            raise ValueError(f"checksum_in must be 'auto', 'background' or 'staging', got {checksum_in!r}")
        self.checksum_in = checksum_in
        if not isinstance(device_staging, bool):
            raise TypeError(f"device_staging must be True or False, got {device_staging!r}")
        self.device_staging = device_staging
        self._device_pools: dict[torch.device, BufferPool] = {}
        self._warned_device_memory = False
        self._no_room: dict[torch.device, int] = {}  # smallest image size that found no room
        self._hash_pool: cf.ThreadPoolExecutor | None = None
        self.keep_last = keep_last
        self.io_threads = io_threads
        self.chunk_bytes = chunk_bytes
        self.telemetry_callback = telemetry_callback
        self.telemetry_jsonl = telemetry_jsonl
        self.safe_globals = list(safe_globals)
        self._targets = StoreResolver(root, storage_options=storage_options, direct_io=direct_io)
        root_store = self._targets.root
        attach = getattr(root_store, "attach_telemetry", None)
        if attach is not None:  # a tiered root: its remote commits reach the same callback/JSONL
            attach(self._emit)
        self._pool = BufferPool(max_pending, pinned)
        self._queue: JobQueue | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, list[SaveHandle]] = {}
        self._failed: list[SaveHandle] = []
        self._closed = False
        _live.add(self)

    # ------------------------------------------------------------------ saving
    def save(self, state: Any, path: str | os.PathLike[str], *, metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Stage ``state`` and write it to ``path`` in the background.

        Returns after the state has been copied into host memory; changing ``state`` afterwards
        does not change the checkpoint. The file is a genuine ``torch.save`` file.

        Raises:
            CheckpointError: an earlier background save failed (raised once, here or elsewhere);
                the target cannot be written; the state holds an unsupported object; closed.
        """
        self._check_open()
        self._raise_failures()
        t_start = time.perf_counter()
        store, name = self._targets.split(path)
        tel = SaveTelemetry(path=store.describe(name), started_at=time.time())
        if hasattr(store, "attach_telemetry"):
            tel.tier = "local"
        image = plan_torch_file(state)
        tel.plan_s = time.perf_counter() - t_start
        store.check_writable(name, image.size)
        device = device_of([image], store) if self.device_staging else None
        pool, buf, device, tel.buffer_wait_s = self._acquire(image.size, device)
        try:
            if device is None:
                wait_device, digests = self._stage(image, buf, 0, tel)
            else:
                s0 = time.perf_counter()
                wait_device, digests = stage_on_device(image, buf), None
                tel.stage_s += time.perf_counter() - s0
                tel.staged_on = str(device)
        except BaseException:
            pool.release(buf)
            raise
        tel.bytes = image.size
        tel.tensor_bytes = image.tensor_bytes
        tel.blocking_s = time.perf_counter() - t_start
        handle = SaveHandle(tel.path, tel)
        key = tel.path
        with self._lock:
            self._pending.setdefault(key, []).append(handle)
        t_submit = t_start

        def give_back() -> None:
            """Return the buffer, once no device copy can still land in it."""
            if wait_device is not None:
                with contextlib.suppress(Exception):
                    wait_device()
            pool.release(buf)

        def job() -> None:
            error: BaseException | None = None
            try:
                if wait_device is not None:
                    wait_device()
                if device is None:
                    self._write_and_commit(store, name, image, buf.view, tel, metadata or {}, digests)
                else:
                    self._write_and_commit_device(store, name, image, buf, tel, metadata or {})
                tel.time_to_commit_s = time.perf_counter() - t_submit
                tel.committed_at = time.time()
                if self.keep_last is not None:
                    self._retain(store, name.rpartition("/")[0])
            except BaseException as exc:  # noqa: BLE001 - delivered through the handle
                error = _as_checkpoint_error(exc, f"saving checkpoint {tel.path} failed")
                tel.error = str(error)
            finally:
                give_back()
            self._finish(key, handle, error)

        self._submit(job, handle, key, release=give_back)
        return handle

    def _acquire(
        self, nbytes: int, device: torch.device | None,
    ) -> tuple[BufferPool, HostBuffer, torch.device | None, float]:
        """A staging buffer: on ``device`` (device staging) when it has room, else in host memory.

        Returns:
            The pool to give it back to, the buffer, the device it is on (``None``: host) and
            the seconds spent waiting for it.
        """
        if device is not None and nbytes >= self._no_room.get(device, nbytes + 1):
            device = None  # this size did not fit on the device before: do not retry every save
        pool = self._pool if device is None else self._device_pool(device)
        try:
            buf, waited = pool.acquire(nbytes)
        except torch.OutOfMemoryError as exc:
            if device is None:
                raise
            # An optimization must not fail the save: stage this one in host memory, say so once,
            # and stage saves at least this large in host memory from now on (a failed CUDA
            # allocation first empties the allocator's cache, which training would pay for).
            self._no_room[device] = min(nbytes, self._no_room.get(device, nbytes))
            if not self._warned_device_memory:
                self._warned_device_memory = True
                warnings.warn(
                    f"device_staging: no room on {device} for a {nbytes / 2**30:.2f} GiB staging "
                    f"buffer ({str(exc).splitlines()[0]}); staging in host memory instead "
                    "(SaveTelemetry.staged_on tells which each save used)",
                    RuntimeWarning, stacklevel=3,
                )
            pool, device = self._pool, None
            buf, waited = pool.acquire(nbytes)
        return pool, buf, device, waited

    def _device_pool(self, device: torch.device) -> BufferPool:
        """The device buffers of ``device`` (``max_pending`` at most, created on first use)."""
        with self._lock:
            self._check_open()
            pool = self._device_pools.get(device)
            if pool is None:
                pool = self._device_pools[device] = BufferPool(self._pool.max_buffers, device=device)
            return pool

    def _stage(
        self, image: FileImage, buf: HostBuffer, base: int, tel: SaveTelemetry,
    ) -> tuple[Callable[[], None] | None, list[str] | None]:
        """Copy ``image`` into ``buf[base:]`` on the caller's time, hashing it too when it should.

        Adds to ``tel.stage_s`` (and ``tel.checksum_s``). Returns a callable that waits for
        pending device copies (``None`` when the bytes are in place) and the chunk digests
        (``None`` when the writers hash).
        """
        s0 = time.perf_counter()
        digests = None
        if on_host(image):
            wait_device = None
            if self._hash_while_staging(device_copy_pending=False):
                digests, hashing = stage_and_hash(image, buf, base, algorithm=self.checksum,
                                                  chunk_bytes=self.chunk_bytes, pool=self._staging_pool())
                tel.checksum_s += hashing
            else:
                stage_image(image, buf, base)
        else:
            wait_device = stage_image(image, buf, base)
            if self._hash_while_staging(device_copy_pending=wait_device is not None):
                if wait_device is not None:
                    wait_device()
                    wait_device = None
                h0 = time.perf_counter()
                digests = chunk_digests(buf.view[base:], image.size, algorithm=self.checksum,
                                        chunk_bytes=self.chunk_bytes, pool=self._staging_pool())
                tel.checksum_s += time.perf_counter() - h0
        tel.stage_s += time.perf_counter() - s0
        return wait_device, digests

    def _hash_while_staging(self, *, device_copy_pending: bool) -> bool:
        """Whether this save hashes its chunks on the caller's time (see ``checksum_in``)."""
        if self.checksum_in == "auto":
            return not device_copy_pending
        return self.checksum_in == "staging"

    def _staging_pool(self) -> cf.ThreadPoolExecutor:
        """The threads that copy-and-hash on the caller's time (created on first use, joined by ``close``)."""
        with self._lock:
            self._check_open()  # a save racing close() must not start threads nobody joins
            if self._hash_pool is None:
                self._hash_pool = cf.ThreadPoolExecutor(max(1, torch.get_num_threads()),
                                                        thread_name_prefix="stagesave-hash")
            return self._hash_pool

    def _write_and_commit(
        self, store: Store, name: str, image: FileImage, view: memoryview, tel: SaveTelemetry,
        metadata: dict[str, Any], digests: list[str] | None = None,
    ) -> None:
        stats = WriteStats()
        queue = self._queue
        assert queue is not None
        storages = [StorageRecord(s.key, s.offset, s.nbytes) for s in image.slots]
        entry, publish, abort = write_file(
            store,
            FileToWrite(name, view, image.size, "torch", image.serialization_id, image.id_offset, storages,
                        digests=digests),
            algorithm=self.checksum,
            chunk_bytes=self.chunk_bytes,
            pool=queue.io_pool,
            stats=stats,
        )
        self._commit_entry(store, name, image, (entry, publish, abort), stats, tel, metadata)

    def _write_and_commit_device(
        self, store: Store, name: str, image: FileImage, buf: HostBuffer, tel: SaveTelemetry,
        metadata: dict[str, Any],
    ) -> None:
        """:meth:`_write_and_commit` for an image staged in device memory (``device_staging``)."""
        assert isinstance(store, LocalStore) and self._queue is not None
        stats = WriteStats()
        kvikio = gpudirect_kvikio()
        tel.gpudirect = kvikio is not None
        written = write_device_file(
            store,
            DeviceFile(name, buf.tensor, image.size, image.serialization_id, image.id_offset,
                       [StorageRecord(s.key, s.offset, s.nbytes) for s in image.slots]),
            algorithm=self.checksum, chunk_bytes=self.chunk_bytes, pool=self._queue.io_pool,
            stats=stats, kvikio=kvikio,
        )
        self._commit_entry(store, name, image, written, stats, tel, metadata)

    def _commit_entry(
        self, store: Store, name: str, image: FileImage,
        written: tuple[FileEntry, Callable[[], None], Callable[[], None]], stats: WriteStats,
        tel: SaveTelemetry, metadata: dict[str, Any],
    ) -> None:
        """Record the write in the telemetry and commit the file's manifest."""
        entry, publish, abort = written
        tel.write_s, tel.fsync_s, tel.direct_io = stats.write_s, stats.fsync_s, stats.direct_io
        tel.checksum_s += stats.checksum_s
        tel.throughput_bytes_per_s = image.size / stats.write_s if stats.write_s > 0 else 0.0
        manifest = Manifest(
            files=[entry],
            created_ns=time.time_ns(),
            tensors=[
                {"name": t.name, "storage": t.storage_key, "dtype": t.dtype, "shape": list(t.shape),
                 "stride": list(t.stride), "storage_offset": t.storage_offset}
                for t in image.tensors
            ],
            metadata=dict(metadata),
            telemetry=_manifest_telemetry(tel),
        )
        c0 = time.perf_counter()
        commit_files(store, manifest_path_for(name, image.serialization_id), manifest, [publish], [abort],
                     name=name)
        tel.commit_s = time.perf_counter() - c0

    def _retain(self, store: Store, directory: str) -> None:
        """Keep the ``keep_last`` newest committed checkpoints of ``directory``.

        Runs under the directory's commit lock, so that another remover of the same directory
        (a tiered store's ``keep_local``, another process) cannot make a checkpoint look torn to
        this scan while it deletes it, which would make an older one look like the second newest.
        """
        assert self.keep_last is not None
        with store.commit_lock(_lock_name(directory)):
            committed = [c for c in scan(store, directory) if c.status == "committed"]
            for old in committed[self.keep_last :]:
                if old.is_dir:
                    if old.manifest_name is not None:
                        store.delete(old.manifest_name)  # manifest first: half-deleted is never valid
                    crash_point("during_retention")
                    self._delete_dir(store, old.name)
                else:
                    retire_file(store, old.name, sibling_manifests(store, old.name))

    @staticmethod
    def _delete_dir(store: Store, name: str) -> None:
        local = store.local_path(name)
        if local is not None:
            if os.path.isdir(local) and not os.path.islink(local):
                fsops.rmtree(local)
            return
        for info in store.list(name):
            store.delete(info.name)

    def save_dir(
        self,
        files: dict[str, Any],
        directory: str | os.PathLike[str],
        *,
        metadata: dict[str, Any] | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
    ) -> SaveHandle:
        """Stage several files and commit them together as one directory checkpoint.

        ``files`` maps names inside ``directory`` (e.g. ``"optimizer.bin"``) to a state saved
        as a torch file, or to :class:`stagesave.formats.Safetensors`. The folder appears only
        once every file and the manifest are durable; an existing folder is replaced atomically.
        ``staging_dir`` (local targets, and tiered roots: their local tier): where the folder is
        assembled before it is renamed into place, instead of a hidden sibling of the target; it
        must be on the same filesystem. A tiered root uploads the folder once it is in place.

        Raises:
            Like :meth:`save`.
        """
        self._check_open()
        self._raise_failures()
        if not files:
            raise ValueError("save_dir needs at least one file")
        t_start = time.perf_counter()
        store, dname = self._targets.split(directory)
        tel = SaveTelemetry(path=store.describe(dname), started_at=time.time())
        planned = []
        for fname, content in files.items():
            try:
                from ._store import check_name

                check_name(fname)
            except ValueError as exc:
                raise ValueError(f"invalid file name {fname!r} in directory checkpoint: {exc}") from exc
            kind, image = plan_file(content)
            planned.append((fname, kind, image))
        tel.plan_s = time.perf_counter() - t_start
        bases, total = [], 0
        for _, _, image in planned:
            bases.append(total)
            total += (image.size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        # Check the parent with a sibling name: the folder itself must not appear before its commit.
        parent, _, leaf = dname.rpartition("/")
        store.check_writable(f"{parent}/.{leaf}{TMP_MARKER}" if parent else f".{leaf}{TMP_MARKER}", total)
        if staging_dir is not None:
            _check_same_filesystem(store, dname, staging_dir)
        images = [image for _, _, image in planned]
        device = device_of(images, store) if self.device_staging else None
        pool, buf, device, tel.buffer_wait_s = self._acquire(total, device)
        waits = []
        digests: list[list[str] | None] = []
        try:
            for base, image in zip(bases, images):
                if device is None:
                    w, d = self._stage(image, buf, base, tel)
                else:
                    s0 = time.perf_counter()
                    w, d = stage_on_device(image, buf, base), None
                    tel.stage_s += time.perf_counter() - s0
                digests.append(d)
                if w is not None:
                    waits.append(w)
        except BaseException:
            pool.release(buf)
            raise
        if device is not None:
            tel.staged_on = str(device)
        tel.bytes = sum(im.size for _, _, im in planned)
        tel.tensor_bytes = sum(im.tensor_bytes for _, _, im in planned)
        tel.blocking_s = time.perf_counter() - t_start
        handle = SaveHandle(tel.path, tel)
        key = tel.path
        with self._lock:
            self._pending.setdefault(key, []).append(handle)
        to_write = []
        for base, (fname, kind, image), pre in zip(bases, planned, digests):
            cap = (image.size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
            storages = [StorageRecord(s.key, s.offset, s.nbytes) for s in image.slots]
            on_device = buf.tensor[base : base + cap] if device is not None else None
            to_write.append(FileToWrite(fname, buf.view[base : base + cap], image.size, kind,
                                        image.serialization_id or None,
                                        image.id_offset if image.serialization_id else None, storages,
                                        digests=pre, device_data=on_device))

        stats = WriteStats()

        def give_back() -> None:
            """Return the buffer, once no device copy can still land in it."""
            for w in waits:
                with contextlib.suppress(Exception):
                    w()
            for v in to_write:
                v.image.release()
            pool.release(buf)

        def make_manifest(entries: list[Any]) -> Manifest:
            tel.write_s, tel.checksum_s, tel.fsync_s, tel.direct_io = (
                stats.write_s, tel.checksum_s + stats.checksum_s, stats.fsync_s, stats.direct_io)
            return Manifest(files=entries, created_ns=time.time_ns(), metadata=dict(metadata or {}),
                            telemetry=_manifest_telemetry(tel))

        def job() -> None:
            error: BaseException | None = None
            try:
                for w in waits:
                    w()
                assert self._queue is not None
                kvikio = None
                if device is not None:
                    kvikio = gpudirect_kvikio()
                    tel.gpudirect = kvikio is not None
                c0 = time.perf_counter()
                commit_directory(store, dname, to_write, make_manifest, algorithm=self.checksum,
                                 chunk_bytes=self.chunk_bytes, pool=self._queue.io_pool, stats=stats,
                                 staging_dir=os.fspath(staging_dir) if staging_dir is not None else None,
                                 kvikio=kvikio)
                tel.commit_s = time.perf_counter() - c0 - stats.write_s
                tel.throughput_bytes_per_s = tel.bytes / stats.write_s if stats.write_s > 0 else 0.0
                tel.time_to_commit_s = time.perf_counter() - t_start
                tel.committed_at = time.time()
                if self.keep_last is not None:
                    self._retain(store, dname.rpartition("/")[0])
            except BaseException as exc:  # noqa: BLE001 - delivered through the handle
                error = _as_checkpoint_error(exc, f"saving checkpoint {tel.path} failed")
                tel.error = str(error)
            finally:
                give_back()
            self._finish(key, handle, error)

        self._submit(job, handle, key, release=give_back)
        return handle

    def remove(self, path: str | os.PathLike[str]) -> SaveHandle:
        """Delete a checkpoint after every save submitted before this call.

        Returns a handle; ``result()`` waits for the removal.
        """
        self._check_open()
        store, name = self._targets.split(path)
        tel = SaveTelemetry(path=store.describe(name), started_at=time.time())
        handle = SaveHandle(tel.path, tel, kind="remove")
        key = tel.path

        def job() -> None:
            error: BaseException | None = None
            try:
                local = store.local_path(name)
                if local is not None and os.path.islink(local):
                    fsops.unlink(local)  # a link: remove the link, never what it points to
                elif (local is not None and os.path.isdir(local)) or store.list_dirs(name) or _has(store, f"{name}/{DIR_MANIFEST}"):
                    store.delete(f"{name}/{DIR_MANIFEST}")
                    self._delete_dir(store, name)
                else:
                    retire_file(store, name, sibling_manifests(store, name))
            except BaseException as exc:  # noqa: BLE001
                error = _as_checkpoint_error(exc, f"removing checkpoint {tel.path} failed")
            self._finish(key, handle, error)

        with self._lock:
            self._pending.setdefault(key, []).append(handle)
        self._submit(job, handle, key)
        return handle

    def run_after(self, fn: Callable[[], None], *, description: str = "action") -> SaveHandle:
        """Run ``fn`` on the writer thread after every save and removal submitted before it.

        For small ordered steps such as pointing a link at a checkpoint once it is committed.
        ``fn`` must not run torch operations or collectives (see DESIGN.md). Its exception is
        delivered like a failed save's.
        """
        self._check_open()
        tel = SaveTelemetry(path=description, started_at=time.time())
        handle = SaveHandle(description, tel, kind="action")

        def job() -> None:
            error: BaseException | None = None
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - delivered through the handle
                error = _as_checkpoint_error(exc, f"{description} failed")
            self._finish(description, handle, error)

        self._submit(job, handle, description)
        return handle

    def _submit(self, job: Any, handle: SaveHandle, key: str, release: Callable[[], None] | None = None) -> None:
        """Queue ``job``; if ``close()`` came first, give back what it holds and raise ClosedError.

        ``release`` frees what the caller acquired for the job (its staging buffer).
        """
        with self._lock:
            queue = None
            if not self._closed:
                if self._queue is None:
                    self._queue = self._new_queue()
                queue = self._queue
        if queue is not None:
            try:
                queue.submit(job)
                return
            except RuntimeError:  # stopped by a close() racing this call
                pass
        if release is not None:
            release()
        error = ClosedError(f"the Checkpointer was closed while {handle.path} was being staged; "
                            "it was not written")
        with self._lock:
            self._forget(key, handle)
        handle._set_done(error)
        raise error

    def _new_queue(self) -> JobQueue:
        return JobQueue(io_threads=self.io_threads)

    def _forget(self, key: str, handle: SaveHandle) -> None:
        """Drop ``handle`` from the pending operations of ``key`` (hold ``self._lock``)."""
        lst = self._pending.get(key, [])
        if handle in lst:
            lst.remove(handle)
        if not lst:
            self._pending.pop(key, None)

    def _finish(self, key: str, handle: SaveHandle, error: BaseException | None) -> None:
        with self._lock:
            self._forget(key, handle)
            if error is not None:
                self._failed.append(handle)
        handle._set_done(error)
        if handle.kind == "save":
            self._emit(handle.telemetry)

    def _emit(self, tel: SaveTelemetry) -> None:
        if self.telemetry_callback is not None:
            try:
                self.telemetry_callback(tel)
            except Exception as exc:  # noqa: BLE001 - a broken callback must not fail saves
                print(f"stagesave: telemetry callback failed: {exc!r}", file=sys.stderr)
        if self.telemetry_jsonl:
            target = self.telemetry_jsonl
            if target is True:
                if tel.path.startswith("/"):
                    target = os.path.join(os.path.dirname(tel.path), TELEMETRY_FILE)
                else:
                    return
            try:
                with open(str(target), "a", encoding="utf-8") as f:
                    f.write(tel.to_json() + "\n")
            except OSError as exc:
                print(f"stagesave: cannot append telemetry to {target}: {exc}", file=sys.stderr)

    # ------------------------------------------------------------------ waiting
    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted save and removal has finished.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointError: a background save failed and its error was not delivered yet.
        """
        queue = self._queue
        if queue is not None and not queue.drain(timeout):
            raise TimeoutError(f"{queue.pending()} checkpoint operations still running after {timeout} s")
        self._raise_failures()

    def pending(self) -> int:
        """Number of saves and removals not finished yet."""
        q = self._queue
        return q.pending() if q is not None else 0

    def _wait_path(self, key: str, timeout: float | None = None) -> None:
        with self._lock:
            handles = list(self._pending.get(key, []))
        for h in handles:
            h.exception(timeout)

    def _raise_failures(self) -> None:
        with self._lock:
            failed, self._failed = self._failed, []
        errors = [e for e in (h._claim_error() for h in failed) if e is not None]
        if errors:
            if len(errors) > 1:
                print(
                    f"stagesave: {len(errors) - 1} more background saves failed: "
                    + "; ".join(str(e) for e in errors[1:]),
                    file=sys.stderr,
                )
            raise errors[0]

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this Checkpointer is closed; create a new one to save or remove checkpoints")

    # ------------------------------------------------------------------ reading
    def load(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        *,
        verify: bool = True,
        mmap: bool | None = None,
        trusted: bool = False,
        safe_globals: Iterable[Any] = (),
    ) -> Any:
        """Load a checkpoint written by stagesave or by ``torch.save``.

        Waits for pending saves of the same path. With ``verify`` (default) every byte is
        checked against the manifest before anything is unpickled. Local files load with
        ``mmap`` by default (tensors are backed by the verified file's pages, copy-on-write).

        Raises:
            CheckpointNotFoundError: no such file.
            IntegrityError: the file does not match its manifest.
            UnsafeCheckpointError: the file needs a class that is not allow-listed.
        """
        store, name = self._targets.split(path)
        where = store.describe(name)
        self._wait_path(where)
        try:
            info = resolve(store, name)
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise CheckpointNotFoundError(f"no checkpoint at {where}") from exc
        if info.status == "corrupt":
            raise IntegrityError(f"checkpoint {where} is corrupt: {'; '.join(info.problems)}")
        entry = info.manifest.file((info.judged or name).rpartition("/")[2]) if info.manifest else None
        globs = [*self.safe_globals, *safe_globals]
        local = store.local_path(info.judged or name)  # the file judged, even if a link moved since
        if local is not None:
            return self._load_local(local, entry, where, map_location, verify, mmap, trusted, globs)
        data = bytearray(info.size)
        view = memoryview(data)
        self._read_parallel(store, name, view)
        if verify and entry is not None:
            raise_if_corrupt(self._verify_memory(entry, view, where), where)
        return safe_torch_load(io.BytesIO(data), map_location=map_location, trusted=trusted, safe_globals=globs, where=where)

    def _load_local(
        self, local: str, entry: Any, where: str, map_location: Any, verify: bool, mmap: bool | None,
        trusted: bool, globs: list[Any],
    ) -> Any:
        fd = os.open(local, os.O_RDONLY)
        try:
            if verify and entry is not None:
                size = os.fstat(fd).st_size
                if size != entry.size:
                    raise IntegrityError(f"checkpoint {where} is corrupt: {size} bytes, manifest says {entry.size}")

                scratch = threading.local()

                def read(lo: int, n: int) -> memoryview:
                    # One reused buffer per I/O thread: no allocation (and page faults) per chunk.
                    buf = getattr(scratch, "buf", None)
                    if buf is None or len(buf) < n:
                        buf = scratch.buf = bytearray(n)
                    view = memoryview(buf)[:n]
                    got = os.preadv(fd, [view], lo)
                    return view[:got]

                raise_if_corrupt(self._verify_reader(entry, read, where), where)
            is_zip = os.pread(fd, 4, 0) == b"PK\x03\x04"
            use_mmap = is_zip if mmap is None else mmap
            # Load the very inode we verified, even if the name was replaced meanwhile.
            proc = f"/proc/self/fd/{fd}"
            source = proc if os.path.exists(proc) else local
            return safe_torch_load(source, map_location=map_location, mmap=use_mmap, trusted=trusted,
                                   safe_globals=globs, where=where)
        finally:
            os.close(fd)

    def _io_map(self, fn: Any, items: Iterable[Any]) -> list[Any]:
        with self._lock:
            if self._queue is None:
                self._queue = self._new_queue()
            pool = self._queue.io_pool
        return list(pool.map(fn, items))

    def _verify_reader(self, entry: Any, read: Any, where: str) -> list[str]:
        def check(i: int) -> str | None:
            lo, hi = entry.chunk_range(i)
            data = read(lo, hi - lo)
            if len(data) != hi - lo:
                return f"truncated at byte {lo + len(data)} (expected {entry.size} bytes)"
            if digest(entry.algorithm, data) != entry.chunks[i]:
                return f"checksum mismatch in bytes [{lo}, {hi}) (chunk {i})"
            return None

        return [p for p in self._io_map(check, range(len(entry.chunks))) if p]

    def _verify_memory(self, entry: Any, view: memoryview, where: str) -> list[str]:
        return self._verify_reader(entry, lambda lo, n: view[lo : lo + n], where)

    def _read_parallel(self, store: Store, name: str, view: memoryview) -> None:
        step = self.chunk_bytes

        def one(lo: int) -> None:
            n = store.read_into(name, lo, view[lo : lo + step])
            if n != len(view[lo : lo + step]):
                raise IntegrityError(f"checkpoint {store.describe(name)} is truncated at byte {lo + n}")

        self._io_map(one, range(0, len(view), step))

    def verify(self, path: str | os.PathLike[str]) -> CheckpointInfo:
        """Check a file against its manifest, reading every byte.

        Returns its :class:`CheckpointInfo` with ``status`` ``"verified"``, ``"corrupt"``
        (``problems`` says what) or ``"unverified"`` (a plain torch file with no manifest).

        Raises:
            CheckpointNotFoundError: no such file.
        """
        store, name = self._targets.split(path)
        return self._verify_in(store, name)

    def _verify_in(self, store: Store, name: str) -> CheckpointInfo:
        self._wait_path(store.describe(name))
        try:
            info = resolve(store, name)
        except IsADirectoryError:
            info = resolve_dir(store, name)
        except FileNotFoundError as exc:
            if _has(store, f"{name}/{DIR_MANIFEST}"):
                info = resolve_dir(store, name)
            else:
                raise CheckpointNotFoundError(f"no checkpoint at {store.describe(name)}") from exc
        if info.status != "committed" or info.manifest is None:
            return info
        with self._lock:
            if self._queue is None:
                self._queue = self._new_queue()
            pool = self._queue.io_pool
        if info.is_dir:
            problems = []
            for entry in info.manifest.files:
                problems += verify_entry(store, f"{name}/{entry.name}", entry, pool)
        else:
            judged = info.judged or name  # read the link once: the file resolve() judged
            problems = verify_entry(store, judged, info.manifest.file(judged.rpartition("/")[2]), pool)
        info.problems = problems
        info.status = "corrupt" if problems else "verified"
        return info

    def list(self, root: str | os.PathLike[str] | None = None) -> list[CheckpointInfo]:
        """Checkpoints directly in ``root``, newest first (committed, unverified and corrupt)."""
        store = self._targets.dir_store(root)
        self.wait_quietly()
        return scan(store)

    def latest(self, root: str | os.PathLike[str] | None = None, *, verify: bool = False) -> CheckpointInfo | None:
        """The newest valid checkpoint in ``root`` (``None`` if there is none).

        Corrupt checkpoints are skipped with a warning naming the problem; with ``verify`` every
        candidate's bytes are checked too, newest first, until one passes.
        """
        store = self._targets.dir_store(root)
        self.wait_quietly()
        with store.commit_lock(""):
            restore_aside(store, "")
            found = scan(store, warn=True)
        for info in found:
            if not info.valid:
                continue
            if verify and info.manifest is not None:
                checked = self._verify_in(store, info.name)
                if checked.status == "corrupt":
                    import warnings

                    warnings.warn(f"skipping checkpoint {info.path}: {'; '.join(checked.problems)}", stacklevel=2)
                    continue
                return checked
            return info
        return None

    def wait_quietly(self) -> None:
        """Wait for pending work without raising (errors stay queued for the next call)."""
        q = self._queue
        if q is not None:
            q.drain()

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float | None = None) -> None:
        """Finish pending saves, release buffers and threads; raise an undelivered failure.

        Safe to call more than once.
        """
        with self._lock:  # a racing save() then cannot create a device pool this close misses
            was_closed, self._closed = self._closed, True
        if was_closed:
            self._raise_failures()
            return
        q = self._queue
        try:
            if q is not None and not q.stop(timeout):
                raise TimeoutError(
                    f"stagesave: {q.pending()} checkpoint operations still running after {timeout} s; "
                    "they were not committed"
                )
        finally:
            self._pool.close()
            with self._lock:
                device_pools = list(self._device_pools.values())
            for device_pool in device_pools:
                device_pool.close()
            self._targets.close()
            if self._hash_pool is not None:  # only ever busy inside save(): joins at once
                self._hash_pool.shutdown(wait=True)
                self._hash_pool = None
            _live.discard(self)
        self._raise_failures()

    def __enter__(self) -> Checkpointer:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception as close_exc:  # noqa: BLE001 - never mask the user's exception
                print(f"stagesave: while handling another error: {close_exc}", file=sys.stderr)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a Checkpointer holds threads and buffers and cannot be pickled")
