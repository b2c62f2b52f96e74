"""The Checkpointer: ``save`` returns after one copy into host memory; the rest is background."""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import json
import os
import signal
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .errors import (
    CheckpointError,
    CheckpointPermissionError,
    ClosedError,
    StorageError,
    UnsupportedObjectError,
    oserror_to_checkpoint_error,
)
from .formats import plan_file
from .handle import SaveHandle
from .ondisk.checksum import CRYPTOGRAPHIC, DEFAULT_ALGORITHM, check_algorithm
from .ondisk.manifest import MAX_DEPTH, plain_json
from .ondisk.names import (
    ALIGNMENT,
    DEFAULT_CHUNK_BYTES,
    TELEMETRY_FILE,
    TMP_MARKER,
    check_target_name,
)
from .ondisk.signing import current as signing_keys
from .restore.discovery import (
    CheckpointInfo,
    scan,
)
from .restore.load import load_checkpoint
from .restore.select import latest_in, resume_choice
from .restore.verify import verify_checkpoint
from .saving import inflight as _inflight
from .saving.buffers import BufferPool, HostBuffer
from .saving.commit import commit_file, commit_folder, remove_checkpoint, retain
from .saving.fastplan import fast_path_enabled
from .saving.fastplan import plan as plan_torch_file
from .saving.pipeline import JobQueue, current_queue
from .saving.plan import FileImage
from .saving.stage import ImageCrcs, many_small_slots, on_host, stage_and_crc, stage_image
from .saving.stage_device import device_of, gpudirect_kvikio, stage_on_device, write_device_data
from .saving.write import FileToWrite, WriteStats, Written, proof_room
from .saving.ziplayout import forget_layouts
from .stores.base import Store, check_name
from .stores.local import LocalStore
from .stores.targets import StoreResolver
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
    from .stores.local import makedirs_durable

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


def _checked_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """The user's metadata, refused now (not in the background) if it cannot go into a proof.

    Raises:
        UnsupportedObjectError: not a dict of JSON values (NaN and infinities are not JSON).
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise UnsupportedObjectError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        plain_json(json.loads(json.dumps(metadata, allow_nan=False)), "metadata", "metadata")
    except (TypeError, ValueError, RecursionError) as exc:  # ManifestError is a ValueError too
        raise UnsupportedObjectError(
            f"metadata must hold JSON values (str, numbers, bool, None, lists, dicts) nested at most "
            f"{MAX_DEPTH} deep: {exc}"
        ) from exc
    return dict(metadata)


class _Resources:
    """The threads and buffers of one Checkpointer, apart from it: when a Checkpointer is
    garbage-collected without ``close()`` (dropped with its Trainer or Accelerator), a
    finalizer releases them. It holds nothing that refers back to the Checkpointer, and a
    Checkpointer with jobs still queued is referenced by them, so it is collected idle only.
    """

    def __init__(self, pool: BufferPool, device_pools: dict[torch.device, BufferPool]) -> None:
        self.pool = pool
        self.device_pools = device_pools
        self.queue: JobQueue | None = None
        self.hash_pool: cf.ThreadPoolExecutor | None = None

    def release(self) -> None:
        queue, self.queue = self.queue, None
        if queue is not None:
            queue.stop(None)
        hash_pool, self.hash_pool = self.hash_pool, None
        if hash_pool is not None:
            hash_pool.shutdown(wait=False)
        self.pool.close()
        for pool in list(self.device_pools.values()):
            pool.close()


def _check_inside_root(store: Store, name: str) -> None:
    """Refuse a target whose directory a symbolic link puts outside the store's root.

    Readers never follow a link out of the root (``LocalStore`` refuses it), so such a save
    could never be loaded, verified or found by ``latest()``: it is refused before anything is
    written. Links that stay inside the root work end to end; a link as the target's own name
    is replaced by the new file, never followed.

    Raises:
        CheckpointPermissionError: the target's directory resolves outside the root.
    """
    local, root = store.local_path(name), store.local_path("")
    if local is None or root is None:
        return
    real_root = os.path.realpath(root)
    parent = os.path.realpath(os.path.dirname(local))
    if parent != real_root and not parent.startswith(real_root.rstrip(os.sep) + os.sep):
        raise CheckpointPermissionError(
            f"refusing to save {local}: its directory is a symbolic link to {parent}, outside the "
            f"checkpoint root {root}, and stagesave never reads through links out of the root. Use "
            f"the link's target as the root (or pass an absolute path), or a directory inside {root}."
        )


class Checkpointer:
    """Asynchronous, verifiable checkpoints of any torch state.

    Args:
        root: Default directory (local path, fsspec URL or a :class:`Store`) for relative paths
            and for ``latest()``/``list()`` without arguments. Absolute paths and URLs given to
            ``save``/``load`` work without it.
        max_pending: Saves that may be in flight (one staging buffer each); a further save waits
            for a buffer instead of allocating more memory.
        checksum: ``"crc32"`` (default: at memory speed, and the same CRCs make every zip record
            valid), ``"xxh3_128"``, ``"xxh3_64"``, or the cryptographic ``"blake3"`` and
            ``"sha256"`` (an extra pass over the bytes in the background). While a signing key
            is in force (:mod:`stagesave.signing`) a non-cryptographic choice becomes ``"blake3"``.
        keep_last: After each commit keep only this many committed checkpoints in that
            directory (the lowest sequence numbers removed first, each in one step). ``None``
            keeps all.
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
            make the caller wait for the device) or when the state is many small tensors
            (tensors averaging under 1 MiB: hashing them costs Python steps per tensor rather
            than memory bandwidth). Hashing in the background costs a training
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
        self._checksum = check_algorithm(checksum)
        signing_keys()  # a bad key or key file in the environment is a clear error now, not at a load
        if checksum_in not in ("auto", "background", "staging"):
            raise ValueError(f"checksum_in must be 'auto', 'background' or 'staging', got {checksum_in!r}")
        self.checksum_in = checksum_in
        if not isinstance(device_staging, bool):
            raise TypeError(f"device_staging must be True or False, got {device_staging!r}")
        self.device_staging = device_staging
        self._device_pools: dict[torch.device, BufferPool] = {}
        self._warned_device_memory = False
        self._no_room: dict[torch.device, int] = {}  # smallest image size that found no room
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
        self._res = _Resources(self._pool, self._device_pools)
        # Dropped without close(): its threads and buffers go with it. Not at exit, where
        # the flush of every live Checkpointer commits what is pending first.
        weakref.finalize(self, self._res.release).atexit = False
        self._lock = threading.Lock()
        self._failed: list[SaveHandle] = []
        self._closed = False
        _live.add(self)
        fast_path_enabled()  # the once-per-process check of the planner, before the first save

    @property
    def _queue(self) -> JobQueue | None:
        return self._res.queue

    @_queue.setter
    def _queue(self, queue: JobQueue | None) -> None:
        self._res.queue = queue

    @property
    def _hash_pool(self) -> cf.ThreadPoolExecutor | None:
        return self._res.hash_pool

    @_hash_pool.setter
    def _hash_pool(self, pool: cf.ThreadPoolExecutor | None) -> None:
        self._res.hash_pool = pool

    @property
    def checksum(self) -> str:
        """The chunk checksum of the next save: the one chosen, or ``"blake3"`` while a signing
        key is in force and the one chosen is not cryptographic (a signature over CRCs would
        prove nothing)."""
        if self._checksum not in CRYPTOGRAPHIC and signing_keys() is not None:
            return "blake3"
        return self._checksum

    # ------------------------------------------------------------------ saving
    def save(self, state: Any, path: str | os.PathLike[str], *, metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Stage ``state`` and write it to ``path`` in the background.

        Returns after the state has been copied into host memory; changing ``state`` afterwards
        does not change the checkpoint. The file is a genuine ``torch.save`` file that carries
        its own proof.

        Raises:
            CheckpointError: an earlier background save failed (raised once, here or elsewhere);
                the target cannot be written; the state holds an unsupported object; closed.
        """
        self._check_open()
        self._raise_failures()
        t_start = time.perf_counter()
        store, name = self._targets.split(path)
        check_target_name(name)
        _check_inside_root(store, name)
        tel = SaveTelemetry(path=store.describe(name), started_at=time.time())
        if hasattr(store, "attach_telemetry"):
            tel.tier = "local"
        meta = _checked_metadata(metadata)
        image = plan_torch_file(state)
        tel.plan_s = time.perf_counter() - t_start
        store.check_writable(name, image.size)
        device = device_of([image], store) if self.device_staging else None
        pool, buf, device, tel.buffer_wait_s = self._acquire(image.size, device)
        try:
            if device is None:
                wait_device, crcs = self._stage(image, buf, 0, tel)
            else:
                s0 = time.perf_counter()
                wait_device, crcs = stage_on_device(image, buf), None
                tel.stage_s += time.perf_counter() - s0
                tel.staged_on = str(device)
        except BaseException:
            pool.release(buf)
            raise
        tel.bytes = image.covered
        tel.tensor_bytes = image.tensor_bytes
        tel.blocking_s = time.perf_counter() - t_start
        handle = SaveHandle(tel.path, tel)
        key = tel.path
        self._track(key, handle)
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
                stats = WriteStats()
                f = FileToWrite(name, image, buf.view if device is None else None, crcs,
                                buf.tensor if device is not None else None)
                written = self._write_device(store, f, stats, tel) if device is not None else None
                c0 = time.perf_counter()
                done = commit_file(store, f, algorithm=self.checksum, chunk_bytes=self.chunk_bytes,
                                   pool=self._io_pool(), stats=stats, metadata=meta,
                                   telemetry=lambda: self._record(tel, stats), written=written)
                tel.bytes = done.length
                tel.commit_s = time.perf_counter() - c0 - (stats.write_s if written is None else 0.0)
                tel.time_to_commit_s = time.perf_counter() - t_submit
                tel.committed_at = time.time()
                if self.keep_last is not None:
                    retain(store, name.rpartition("/")[0], self.keep_last)
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
    ) -> tuple[Callable[[], None] | None, ImageCrcs | None]:
        """Copy ``image`` into ``buf[base:]`` on the caller's time, CRC-ing it too when it should.

        Adds to ``tel.stage_s`` (and ``tel.checksum_s``). Returns a callable that waits for
        pending device copies (``None`` when the bytes are in place) and the CRCs (``None`` when
        the background computes them).
        """
        s0 = time.perf_counter()
        crcs = None
        # CRCs serve the zip records of torch files and the crc32 chunk checksums; other digests
        # are computed after the CRC fields are filled in (in the background)
        wanted = self.checksum == "crc32" or image.kind == "torch"
        if on_host(image):
            wait_device = None
            if wanted and self._hash_while_staging(device_copy_pending=False, image=image):
                crcs = stage_and_crc(image, buf, base, chunk_bytes=self.chunk_bytes, pool=self._staging_pool())
                tel.checksum_s += crcs.seconds
            else:
                stage_image(image, buf, base)
        else:
            wait_device = stage_image(image, buf, base)
            if wanted and self._hash_while_staging(device_copy_pending=wait_device is not None, image=image):
                if wait_device is not None:
                    wait_device()
                    wait_device = None
                from .saving.stage import crc_image

                h0 = time.perf_counter()
                crcs = crc_image(image, buf.view[base : base + image.size], chunk_bytes=self.chunk_bytes,
                                 pool=self._staging_pool())
                tel.checksum_s += time.perf_counter() - h0
        tel.stage_s += time.perf_counter() - s0
        return wait_device, crcs

    def _hash_while_staging(self, *, device_copy_pending: bool, image: FileImage) -> bool:
        """Whether this save hashes its chunks on the caller's time (see ``checksum_in``).

        ``"auto"`` hashes in the staging copy (free: the bytes are in cache) unless a device copy
        is pending or the state is many small tensors: there hashing costs Python steps per
        tensor on the caller's thread, which the background pays instead.
        """
        if self.checksum_in == "auto":
            return not device_copy_pending and not many_small_slots(image)
        return self.checksum_in == "staging"

    def _staging_pool(self) -> cf.ThreadPoolExecutor:
        """The threads that copy-and-hash on the caller's time (created on first use, joined by ``close``)."""
        with self._lock:
            self._check_open()  # a save racing close() must not start threads nobody joins
            if self._hash_pool is None:
                self._hash_pool = cf.ThreadPoolExecutor(max(1, torch.get_num_threads()),
                                                        thread_name_prefix="stagesave-hash")
            return self._hash_pool

    def _write_device(self, store: Store, f: FileToWrite, stats: WriteStats, tel: SaveTelemetry) -> Written:
        """Write the data of a file staged in device memory (``device_staging``)."""
        assert isinstance(store, LocalStore)
        kvikio = gpudirect_kvikio()
        tel.gpudirect = kvikio is not None
        return write_device_data(store, f, algorithm=self.checksum, chunk_bytes=self.chunk_bytes,
                                 pool=self._io_pool(), stats=stats, kvikio=kvikio)

    def _io_pool(self) -> cf.Executor:
        queue = self._queue
        assert queue is not None
        return queue.io_pool

    @staticmethod
    def _record(tel: SaveTelemetry, stats: WriteStats) -> dict[str, Any]:
        """Fold the write's figures into ``tel``; what goes into the file's index."""
        tel.write_s, tel.fsync_s, tel.direct_io = stats.write_s, stats.fsync_s, stats.direct_io
        tel.checksum_s += stats.checksum_s
        stats.checksum_s = 0.0
        tel.throughput_bytes_per_s = tel.bytes / stats.write_s if stats.write_s > 0 else 0.0
        return _manifest_telemetry(tel)

    def save_dir(
        self,
        files: dict[str, Any],
        directory: str | os.PathLike[str],
        *,
        metadata: dict[str, Any] | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
        nested: Sequence[str] = (),
    ) -> SaveHandle:
        """Stage several files and commit them together as one folder checkpoint.

        ``files`` maps names inside ``directory`` (e.g. ``"optimizer.bin"``) to a state saved
        as a torch file, to :class:`stagesave.formats.Safetensors` or to
        :class:`stagesave.formats.Raw` bytes. The folder holds exactly these files; each torch
        and safetensors file carries its own proof, and one of them (the carrier) also proves
        the set of files. The folder appears only once everything is durable; an existing
        folder is replaced atomically. ``staging_dir`` (local targets, and tiered roots: their
        local tier): where the folder is assembled before it is renamed into place, instead of
        a hidden sibling of the target; it must be on the same filesystem. A tiered root
        uploads the folder once it is in place. ``nested``: names of sub-folders, folder
        checkpoints of their own, that the caller moves into the folder after this commit (an
        FSDP checkpoint's DCP parts): the folder's proof names them.

        Raises:
            ValueError: no files, an invalid file name, or only raw files (nothing can carry
                the folder's proof).
            Like :meth:`save` otherwise.
        """
        self._check_open()
        self._raise_failures()
        if not files:
            raise ValueError("save_dir needs at least one file")
        t_start = time.perf_counter()
        store, dname = self._targets.split(directory)
        check_target_name(dname)
        _check_inside_root(store, dname)
        tel = SaveTelemetry(path=store.describe(dname), started_at=time.time())
        meta = _checked_metadata(metadata)
        for fname in files:
            try:
                check_name(fname)
                check_target_name(fname)
            except ValueError as exc:
                raise ValueError(f"invalid file name {fname!r} in directory checkpoint: {exc}") from exc
        planned = self._plan_folder(files, meta)
        tel.plan_s = time.perf_counter() - t_start
        bases, total = [], 0
        for _, image in planned:
            bases.append(total)
            total += (image.size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        # Check the parent with a sibling name: the folder itself must not appear before its commit.
        parent, _, leaf = dname.rpartition("/")
        store.check_writable(f"{parent}/.{leaf}{TMP_MARKER}" if parent else f".{leaf}{TMP_MARKER}", total)
        if staging_dir is not None:
            _check_same_filesystem(store, dname, staging_dir)
        images = [image for _, image in planned]
        device = device_of(images, store) if self.device_staging else None
        pool, buf, device, tel.buffer_wait_s = self._acquire(total, device)
        waits = []
        all_crcs: list[ImageCrcs | None] = []
        try:
            for base, image in zip(bases, images):
                if device is None:
                    w, c = self._stage(image, buf, base, tel)
                else:
                    s0 = time.perf_counter()
                    w, c = stage_on_device(image, buf, base), None
                    tel.stage_s += time.perf_counter() - s0
                all_crcs.append(c)
                if w is not None:
                    waits.append(w)
        except BaseException:
            pool.release(buf)
            raise
        if device is not None:
            tel.staged_on = str(device)
        tel.bytes = sum(im.covered for _, im in planned)
        tel.tensor_bytes = sum(im.tensor_bytes for _, im in planned)
        tel.blocking_s = time.perf_counter() - t_start
        handle = SaveHandle(tel.path, tel)
        key = tel.path
        self._track(key, handle)
        to_write = []
        for base, (fname, image), crcs in zip(bases, planned, all_crcs):
            cap = (image.size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
            on_device = buf.tensor[base : base + cap] if device is not None else None
            view = buf.view[base : base + cap] if device is None else None
            to_write.append(FileToWrite(fname, image, view, crcs, on_device, fname))

        def give_back() -> None:
            """Return the buffer, once no device copy can still land in it."""
            for w in waits:
                with contextlib.suppress(Exception):
                    w()
            for v in to_write:
                if v.view is not None:
                    v.view.release()
            pool.release(buf)

        def job() -> None:
            error: BaseException | None = None
            try:
                for w in waits:
                    w()
                stats = WriteStats()
                write = None
                if device is not None:
                    def write(s: Store, f: FileToWrite) -> Written:
                        return self._write_device(s, f, stats, tel)
                c0 = time.perf_counter()
                done = commit_folder(store, dname, to_write, algorithm=self.checksum,
                                     chunk_bytes=self.chunk_bytes, pool=self._io_pool(), stats=stats,
                                     metadata=meta, telemetry=lambda: self._record(tel, stats),
                                     staging_dir=os.fspath(staging_dir) if staging_dir is not None else None,
                                     write=write, nested=list(nested))
                self._record(tel, stats)
                tel.bytes = sum(w.length for w in done)
                tel.commit_s = time.perf_counter() - c0 - stats.write_s
                tel.time_to_commit_s = time.perf_counter() - t_start
                tel.committed_at = time.time()
                if self.keep_last is not None:
                    # removed folders wait for their deletion in staging_dir too, out of the listing
                    debris = os.fspath(staging_dir) if staging_dir is not None and store.local_path("") else None
                    retain(store, dname.rpartition("/")[0], self.keep_last, debris_dir=debris)
            except BaseException as exc:  # noqa: BLE001 - delivered through the handle
                error = _as_checkpoint_error(exc, f"saving checkpoint {tel.path} failed")
                tel.error = str(error)
            finally:
                give_back()
            self._finish(key, handle, error)

        self._submit(job, handle, key, release=give_back)
        return handle

    def _plan_folder(self, files: dict[str, Any], metadata: dict[str, Any]) -> list[tuple[str, FileImage]]:
        """Plan every file of a folder; a safetensors file gets room for its proof (and, if it
        will be the carrier, for the folder's list of files)."""
        from .formats import Safetensors

        plain = {n: c for n, c in files.items() if not isinstance(c, Safetensors)}
        planned = {n: plan_file(c)[1] for n, c in plain.items()}
        st_carrier = not any(im.kind in ("torch", "dcp", "dcp-metadata") for im in planned.values())
        for n, content in files.items():
            if n in planned:
                continue
            # the carrier is the first safetensors file in the folder's order (_commit.choose_carrier)
            carrier = st_carrier and n == next(k for k, c in files.items() if isinstance(c, Safetensors))
            folder = self._folder_bound(files, planned) if carrier else {"token": "f" * 32, "carrier": "x" * 255}

            def room(size: int, storages: list[list[object]], folder: dict[str, Any] = folder,
                     carrier: bool = carrier) -> int:
                return proof_room(size, storages, algorithm=self.checksum, chunk_bytes=self.chunk_bytes,
                                  metadata=metadata if carrier else {}, folder=folder)

            planned[n] = plan_file(content, proof_room=room)[1]
        return [(n, planned[n]) for n in files]

    def _folder_bound(self, files: dict[str, Any], planned: dict[str, FileImage]) -> dict[str, Any]:
        """A folder section at least as long as the real one will be (to size a reservation)."""
        from .ondisk.checksum import DIGEST_HEX_LEN

        hex_len = DIGEST_HEX_LEN[self.checksum]
        members = [[n, 1 << 50, 0xFFFFFFFF] for n in files]
        listed = [{"name": n, "size": 1 << 50, "algorithm": self.checksum, "chunk_bytes": self.chunk_bytes,
                   "chunks": ["f" * hex_len] * ((im.size + self.chunk_bytes - 1) // self.chunk_bytes + 1),
                   "kind": "raw", "serialization_id": None, "id_offset": None, "storages": []}
                  for n, im in planned.items() if im.kind == "raw"]
        return {"token": "f" * 32, "carrier": "x" * 255, "members": members, "listed": listed}

    def remove(self, path: str | os.PathLike[str]) -> SaveHandle:
        """Delete a checkpoint after every save submitted before this call (by any Checkpointer
        of this process, for that path).

        Returns a handle; ``result()`` waits for the removal.
        """
        self._check_open()
        store, name = self._targets.split(path)
        tel = SaveTelemetry(path=store.describe(name), started_at=time.time())
        handle = SaveHandle(tel.path, tel, kind="remove")
        key = tel.path
        before = _inflight.pending(key)  # other instances' saves of this path come first

        def job() -> None:
            error: BaseException | None = None
            try:
                for earlier in before:
                    earlier.exception()
                remove_checkpoint(store, name)
            except BaseException as exc:  # noqa: BLE001
                error = _as_checkpoint_error(exc, f"removing checkpoint {tel.path} failed")
            self._finish(key, handle, error)

        self._track(key, handle)
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

    @staticmethod
    def _track(key: str, handle: SaveHandle) -> None:
        """Show ``handle`` as pending on ``key`` to the whole process until it finishes."""
        _inflight.register(key, handle)

    @staticmethod
    def _forget(key: str, handle: SaveHandle) -> None:
        """Drop ``handle`` from the pending operations of ``key``."""
        _inflight.forget(key, handle)

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

        Called by an action of this Checkpointer (``run_after``), it does not wait: the jobs
        queued before the action have finished, and those after it wait for it.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointError: a background save failed and its error was not delivered yet.
        """
        queue = self._queue
        if queue is not None and queue is not current_queue() and not queue.drain(timeout):
            raise TimeoutError(f"{queue.pending()} checkpoint operations still running after {timeout} s")
        self._raise_failures()

    def pending(self) -> int:
        """Number of saves and removals not finished yet."""
        q = self._queue
        return q.pending() if q is not None else 0

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

        Waits for pending saves of the same path. The file is opened once: its proof and its
        bytes come from that one version, even if the name is replaced meanwhile. With
        ``verify`` (default) every byte is checked against the proof before anything is
        unpickled. Local files load with ``mmap`` by default (tensors are backed by the
        verified file's pages, copy-on-write).

        Raises:
            CheckpointNotFoundError: no such file.
            IntegrityError: the file does not match its proof.
            UnsafeCheckpointError: the file needs a class that is not allow-listed.
        """
        store, name = self._targets.split(path)
        return load_checkpoint(store, name, self._io, chunk_bytes=self.chunk_bytes,
                               map_location=map_location, verify=verify, mmap=mmap, trusted=trusted,
                               safe_globals=[*self.safe_globals, *safe_globals])

    def _io(self) -> cf.Executor:
        """The I/O threads reads use (those of the writer queue, created on first use)."""
        with self._lock:
            if self._queue is None:
                self._queue = self._new_queue()
            return self._queue.io_pool

    def verify(self, path: str | os.PathLike[str]) -> CheckpointInfo:
        """Check a checkpoint (file or folder) against its proof, reading every byte.

        Returns its :class:`CheckpointInfo` with ``status`` ``"verified"``, ``"corrupt"``
        (``problems`` says what) or ``"unverified"`` (a plain torch file with no proof).

        Raises:
            CheckpointNotFoundError: no such file.
        """
        store, name = self._targets.split(path)
        return verify_checkpoint(store, name, self._io)

    def list(self, root: str | os.PathLike[str] | None = None) -> list[CheckpointInfo]:
        """Checkpoints directly in ``root``, newest first (committed, unverified and corrupt).

        Format-2 files are listed from their summaries (``manifest`` is ``None`` until
        :meth:`verify` or :meth:`latest` reads the whole proof).
        """
        store = self._targets.dir_store(root)
        self._settle(store)
        return scan(store, settle=True)

    def latest(self, root: str | os.PathLike[str] | None = None, *, verify: bool = True) -> CheckpointInfo | None:
        """The newest checkpoint in ``root`` that a resume can load (``None`` if there is none).

        Candidates are tried newest first; one that fails is skipped with a warning naming it
        and what is wrong. With ``verify`` (default) the one returned was verified: every byte
        of a checkpoint with a proof matched it (``status == "verified"``); a file without a
        proof (a plain ``torch.save`` file, ``status == "unverified"``, older than any
        checkpoint with a proof) is offered only if it is a torch zip whose records match their
        CRC-32s, or a legacy torch or safetensors file that parses. The :meth:`load` that
        follows in this process does not hash the same unchanged file again, so a verified
        resume reads the checkpoint once, like a verified load alone.

        ``verify=False`` is the cheap choice for listings: a proof is read and checked (a torn
        or damaged proof is skipped) but not the bytes it proves, and a file without a proof is
        offered if its structure would load. Such a choice can still fail at ``load()`` with an
        :class:`IntegrityError`.

        Reading never writes: a folder left aside by a crash during a replacement is offered
        where it lies (its name ends in ``.stagesave-aside``) and put back by the next save
        into the directory or by ``stagesave gc``; a read-only root works the same.

        A checkpoint that another process replaces while it is being checked (on S3, the object
        changes under the read) is checked again, and the directory listed again, as a load
        reads the new version: never an error. One replaced again and again is skipped with a
        warning.

        Raises:
            CheckpointError: the directory cannot be listed.
        """
        return latest_in(self._targets.dir_store(root), verify, self._io, self._settle)

    def resume_from(self, path: str | os.PathLike[str], *, verify: bool = True) -> str | None:
        """What a resume pointed at ``path`` as *the newest checkpoint* should load.

        For callers that resolved "the newest" themselves (Lightning's ``ckpt_path="last"``):
        ``path`` if a resume can load it (checked as :meth:`latest` checks a candidate);
        otherwise, after a warning naming it and what is wrong, the newest checkpoint beside it
        (in its directory) that a resume can load; ``None`` if there is none. The check reads
        every byte with ``verify`` and the load that follows does not hash them again.

        Raises:
            CheckpointError: the directory cannot be listed.
        """
        store, name = self._targets.split(path)
        chosen = resume_choice(store, name, verify, self._io, self._settle, self._targets.dir_store)
        if chosen is True:
            return os.fspath(path)
        return None if chosen is None or chosen is False else chosen.path

    def _settle(self, store: Store) -> None:
        """Before listing ``store``'s directory: wait for this instance's queue (link updates
        and actions included) and for every save and removal pending inside it in the process."""
        self.wait_quietly()
        _inflight.wait_under(store.describe(""))

    def wait_quietly(self) -> None:
        """Wait for pending work without raising (errors stay queued for the next call)."""
        q = self._queue
        if q is not None and q is not current_queue():  # a job of this queue would wait for itself
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
            if not _live:  # the last one: nothing planned stays behind
                forget_layouts()
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
