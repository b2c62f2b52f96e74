"""Tiered storage: commit to a fast local tier first, upload to a remote tier in the background.

A save that has to reach S3 before it counts is as slow as the link; a save on local NVMe is
durable in seconds but dies with the node. The tiered store gets both: the whole commit protocol
(``_commit.py``) runs against the local tier, so a checkpoint is committed as soon as it is on
local disk, and every local commit queues an upload that copies the committed bytes, which carry
their own proof, to the remote tier (invisible until published, a folder's carrier last),
reading the committed local file through ``mmap`` and checking each chunk against its proof on
the way, so a copy that rotted on disk is never published remotely. A failed upload never fails the save: it is reported (stderr,
telemetry with ``tier="remote"`` and ``error``) and retried after the next local commit.

Each tier has its own retention; local retention never removes a checkpoint whose upload is still
pending (it would be the only copy). Reads choose, per checkpoint, the newest committed copy,
preferring the local tier on a tie, so ``latest()`` restores from local disk when the local copy
is valid and from the remote tier otherwise (another node wrote a newer one, or the local disk
was wiped). While the remote tier fails, reads skip it for ``remote_retry_after_s``.
"""

from __future__ import annotations

import builtins
import concurrent.futures as cf
import contextlib
import mmap
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from ..errors import IntegrityError
from ..ondisk.names import DIR_MANIFEST, TMP_MARKER, split_manifest_name
from ..restore.discovery import CheckpointInfo, resolve, resolve_dir, scan
from ..saving.commit import copy_checkpoint, remove_checkpoint, retain
from ..saving.pipeline import JobQueue
from ..saving.write import WriteStats
from ..telemetry import SaveTelemetry, TelemetryCallback
from .base import ObjectInfo, PendingWrite, Reader, Store

__all__ = ["TieredStore"]

T = TypeVar("T")

LOCAL, REMOTE = "local", "remote"
_live: weakref.WeakSet[TieredStore] = weakref.WeakSet()
_exit_hook_registered = False


def _flush_at_exit() -> None:
    # Checkpointers first: their last local commits queue uploads that must run too.
    try:
        from ..checkpointer import _close_all_at_exit

        _close_all_at_exit()
    except Exception as exc:  # noqa: BLE001 - report, never hang the exit
        print(f"stagesave: flushing checkpointers before exit failed: {exc}", file=sys.stderr)
    for store in list(_live):
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001
            print(f"stagesave: uploads to {store.remote.url} did not finish before exit: {exc}", file=sys.stderr)


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True
    # threading's exit hooks run before concurrent.futures refuses new work (LIFO order).
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_flush_at_exit)
    else:  # pragma: no cover - other Python implementations
        import atexit

        atexit.register(_flush_at_exit)


def _store_for(target: Store | str | os.PathLike[str], storage_options: dict[str, Any] | None) -> Store:
    if isinstance(target, Store):
        return target
    url = os.fspath(target)
    if url.startswith(("s3://", "s3a://")):
        from .s3 import S3Store

        return S3Store(url, storage_options)
    if "://" in url and not url.startswith("file://"):
        from .fsspec import FsspecStore

        return FsspecStore(url, storage_options)
    from .local import LocalStore

    return LocalStore(url.removeprefix("file://"))


def _parent(name: str) -> str:
    return name.rpartition("/")[0]


class _LocalWrite(PendingWrite):
    """The local tier's pending write; its publish is the local commit, which queues an upload."""

    def __init__(self, store: TieredStore, name: str, inner: PendingWrite) -> None:
        self.store = store
        self.name = name
        self.inner = inner
        self.direct = getattr(inner, "direct", None)

    def write_range(self, lo: int, hi: int) -> None:
        self.inner.write_range(lo, hi)

    def write_tail(self, data: bytes) -> None:
        self.inner.write_tail(data)

    def flush(self) -> None:
        self.inner.flush()

    def finish(self) -> None:
        self.inner.finish()

    def publish(self) -> None:
        self.inner.publish()
        if TMP_MARKER in self.name:
            return  # a file of a folder being assembled: the folder uploads once committed
        self.store._committed_locally(self.name)

    def abort(self) -> None:
        self.inner.abort()


class TieredStore(Store):
    """A fast local tier and a remote tier behind one checkpoint root.

    Args:
        local: The local tier: a :class:`LocalStore` or a directory (NVMe).
        remote: The remote tier: a store or a URL (``s3://...``, any fsspec URL, a path).
        storage_options: fsspec/s3fs options used when ``remote`` is a URL.
        keep_local: Committed checkpoints kept on the local tier (``None``: all). A checkpoint
            whose upload has not succeeded yet is never removed from the local tier.
        keep_remote: Committed checkpoints kept on the remote tier (``None``: all).
        upload_threads: Threads uploading chunks of one file in parallel.
        telemetry_callback: Called with a :class:`SaveTelemetry` (``tier="remote"``) after each
            upload, committed or failed.
        remote_retry_after_s: After a remote failure, reads skip the remote tier this long.
        remote_timeout_s: A read of the remote tier (listing, choosing a tier) that takes
            longer counts as a failure (uploads have no such deadline).

    Raises:
        ValueError: a retention count below 1.
    """

    def __init__(
        self,
        local: Store | str | os.PathLike[str],
        remote: Store | str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        keep_local: int | None = None,
        keep_remote: int | None = None,
        upload_threads: int = 4,
        telemetry_callback: TelemetryCallback | None = None,
        remote_retry_after_s: float = 30.0,
        remote_timeout_s: float = 10.0,
    ) -> None:
        for what, n in (("keep_local", keep_local), ("keep_remote", keep_remote)):
            if n is not None and n < 1:
                raise ValueError(f"{what} must be >= 1 or None, got {n}")
        self.local = _store_for(local, None)
        self.remote = _store_for(remote, storage_options)
        if self.local.local_path("") is None:
            raise ValueError(f"the local tier must be a local directory, got {self.local.url}")
        self.url = self.remote.url
        self.keep_local = keep_local
        self.keep_remote = keep_remote
        self.remote_retry_after_s = remote_retry_after_s
        self.remote_timeout_s = remote_timeout_s
        self._probe_pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="stagesave-probe")
        self._callbacks: list[TelemetryCallback] = [telemetry_callback] if telemetry_callback else []
        self._queue = JobQueue(io_threads=upload_threads, name="stagesave-upload")
        self._lock = threading.Lock()
        self._route: dict[str, str] = {}
        self._pending: dict[str, float] = {}  # name -> when it was committed locally
        # remote copies of deleted names whose queued removal has not run yet: hidden from list()
        self._deleting: dict[str, int] = {}
        self._records: deque[SaveTelemetry] = deque(maxlen=10_000)
        self._remote_down_until = 0.0
        self._closed = False
        _live.add(self)
        _register_exit_hook()

    # ------------------------------------------------------------------ routing
    def _key(self, name: str) -> str:
        """The checkpoint a name belongs to: a data file (with its manifests) or a folder."""
        with self._lock:
            return self._key_unlocked(name)

    def _remote_usable(self) -> bool:
        return time.monotonic() >= self._remote_down_until

    def _remote_failed(self) -> None:
        self._remote_down_until = time.monotonic() + self.remote_retry_after_s

    def _probe(self, store: Store, key: str) -> tuple[bool, tuple[float, float] | None]:
        """(exists, (seq, created) if committed) of one checkpoint in one tier."""
        try:
            if key == "dir:":  # the root itself is never a folder checkpoint
                return False, None
            if key.startswith("dir:"):
                ci = resolve_dir(store, key[4:])
                exists = ci.manifest is not None or ci.status == "corrupt"
            else:
                ci = resolve(store, key)
                exists = True
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return False, None
        order = (float(ci.seq if ci.seq is not None else -1), ci.created)
        return exists, order if ci.status == "committed" else None

    def _decide(self, key: str) -> str:
        """Route ``key`` to the tier with the newest committed copy (local on a tie)."""
        local_exists, local_created = self._probe(self.local, key)
        remote_exists, remote_created = False, None
        try:
            remote_exists, remote_created = self._remote_call(lambda: self._probe(self.remote, key))
        except (OSError, TimeoutError):
            pass  # the remote tier is down: route by the local tier alone
        if local_created is not None and (remote_created is None or local_created >= remote_created):
            tier = LOCAL
        elif remote_created is not None:
            tier = REMOTE
        else:
            tier = LOCAL if local_exists or not remote_exists else REMOTE
        if key.startswith("dir:") and not (local_exists or remote_exists):
            with self._lock:
                self._route.pop(key, None)  # not (or no longer) a folder checkpoint
            return tier  # its files keep their own routes
        with self._lock:
            self._route[key] = tier
        return tier

    def _tier(self, name: str) -> Store:
        with self._lock:
            tier = self._route.get(self._key_unlocked(name))
        return self.remote if tier == REMOTE else self.local

    def _key_unlocked(self, name: str) -> str:
        parent, _, leaf = name.rpartition("/")
        if leaf == DIR_MANIFEST:
            return f"dir:{parent}"
        parsed = split_manifest_name(leaf)
        if parsed is not None:
            return f"{parent}/{parsed[0]}" if parent else parsed[0]
        parts = name.split("/")
        for i in range(len(parts) - 1, 0, -1):  # the innermost folder checkpoint holding it
            key = "dir:" + "/".join(parts[:i])
            if key in self._route:
                return key
        return name

    def _set_local(self, name: str) -> None:
        key = self._key(name)
        with self._lock:
            self._route[key] = LOCAL

    def tier_of(self, name: str) -> str:
        """``"local"`` or ``"remote"``: where reads of ``name`` go now (after ``info``/``latest``)."""
        return REMOTE if self._tier(name) is self.remote else LOCAL

    # ------------------------------------------------------------------ Store: writing (local)
    def check_writable(self, name: str, size: int) -> None:
        self.local.check_writable(name, size)

    def begin_write(self, name: str, image: memoryview, size: int, *, tail: bool = False) -> PendingWrite:
        self._set_local(name)
        return _LocalWrite(self, name, self.local.begin_write(name, image, size, tail=tail))

    def put_atomic(self, name: str, data: bytes) -> None:
        self.local.put_atomic(name, data)
        self._set_local(name)
        parent, _, leaf = name.rpartition("/")
        if leaf == DIR_MANIFEST and TMP_MARKER not in parent:
            # A folder manifest written where the folder already is: that write is the commit.
            # A folder assembled under a temporary name commits when it is renamed into place
            # (``folder_committed``).
            self._committed_locally(parent)

    def folder_committed(self, directory: str) -> None:
        """The folder ``directory`` was renamed into place on the local tier: queue its upload.

        Wherever the folder was assembled (a hidden sibling, or a ``staging_dir`` outside the
        root), the upload reads the committed folder under its final name.
        """
        try:
            self._committed_locally(directory)
        except RuntimeError as exc:  # the upload queue is closed: report, the commit stands
            self._report_failure(directory, f"uploading {self.remote.describe(directory)} was not "
                                 f"queued ({exc}); the local checkpoint is committed", None)

    @property
    def direct_io(self) -> bool:
        """Whether the local tier writes with O_DIRECT (folders staged outside it write alike)."""
        return bool(getattr(self.local, "direct_io", True))

    def commit_lock(self, name: str) -> AbstractContextManager[None]:
        """The local tier's commit lock: every commit (and aside repair) happens there."""
        return self.local.commit_lock(name)

    def delete(self, name: str) -> None:
        """Delete a file from both tiers (the remote one after the uploads queued before this call)."""
        self.local.delete(name)
        with self._lock:
            self._pending.pop(name, None)
        self._delete_remote(name, lambda: self.remote.delete(name))

    def retire(self, name: str, is_dir: bool | None, debris_dir: str | None = None) -> None:
        """Remove the checkpoint ``name`` from both tiers (``_commit.remove_checkpoint``): at once
        from the local tier, from the remote tier after the uploads queued before this call."""
        local = self.local.local_path(name)
        if is_dir is None:
            is_dir = local is not None and os.path.isdir(local)
        remove_checkpoint(self.local, name, is_dir=is_dir, debris_dir=debris_dir)
        with self._lock:
            self._pending.pop(name, None)
        self._delete_remote(name, lambda: remove_checkpoint(self.remote, name, is_dir=is_dir))

    def _delete_remote(self, name: str, fn: Callable[[], None]) -> None:
        with self._lock:
            self._deleting[name] = self._deleting.get(name, 0) + 1

        def remote_delete() -> None:
            try:
                fn()
            except OSError as exc:
                self._report_failure(name, f"removing {self.remote.describe(name)} failed: {exc}", None)
            finally:
                with self._lock:
                    left = self._deleting.pop(name, 1) - 1
                    if left > 0:
                        self._deleting[name] = left

        self._queue.submit(remote_delete)

    # ------------------------------------------------------------------ Store: reading (routed)
    def info(self, name: str) -> ObjectInfo:
        store, fallback = self._route_for_read(name)
        try:
            return store.info(name)
        except FileNotFoundError:
            if fallback is None:
                raise
            return fallback.info(name)

    def open(self, name: str) -> Reader:
        store, fallback = self._route_for_read(name)
        try:
            return store.open(name)
        except FileNotFoundError:
            if fallback is None:
                raise
            return fallback.open(name)

    def _route_for_read(self, name: str) -> tuple[Store, Store | None]:
        """The tier to read ``name`` from, and the one to try when it is not there (if any)."""
        with self._lock:
            deleting = name in self._deleting
        if deleting:  # deleted; only a new local commit of the same name can exist
            return self.local, None
        store = self._route_tier(name)
        other = self.remote if store is self.local else self.local
        if other is self.remote and not self._remote_usable():
            return store, None
        return store, other

    def _route_tier(self, name: str) -> Store:
        key = self._key(name)
        if key == name:
            self._decide(key)  # the first read of a checkpoint: choose the tier afresh
        elif key.startswith("dir:") and name.rpartition("/")[0] == key[4:]:
            with self._lock:
                known = key in self._route
            if not known:
                self._decide(key)
        return self._tier(name)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        return self._tier(name).read_range(name, offset, length)

    def read_into(self, name: str, offset: int, out: memoryview) -> int:
        return self._tier(name).read_into(name, offset, out)

    def local_path(self, name: str) -> str | None:
        return self.local.local_path(name) if self._tier(name) is self.local else None

    def describe(self, name: str) -> str:
        return self._tier(name).describe(name)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Both tiers' files; for a checkpoint routed to one tier, that tier's file and manifests.

        A name deleted from both tiers is not listed from the remote tier while its queued
        remote removal has not run yet (the removal follows the uploads queued before it).
        """
        only = self._folder_tier(prefix)
        if only is not None:  # a folder checkpoint is read from one tier, all of it
            return only.list(prefix)
        local = {i.name: i for i in self.local.list(prefix)}
        remote_files = self._remote_list(lambda: self.remote.list(prefix))
        with self._lock:
            deleting = set(self._deleting)
        remote = {i.name: i for i in remote_files if i.name not in deleting}
        out = []
        for name in sorted(local.keys() | remote.keys()):
            with self._lock:
                routed = self._route.get(self._key_unlocked(name))
            first, second = (remote, local) if routed == REMOTE else (local, remote)
            info = first.get(name)
            if info is None:
                if routed is not None and split_manifest_name(name.rpartition("/")[2]) is not None:
                    continue  # a manifest of the copy that is not read
                info = second[name]
            out.append(info)
        return out

    def _folder_tier(self, prefix: str) -> Store | None:
        """The one tier to read a folder checkpoint (or a folder inside one) from, else ``None``.

        Listing a folder is where reading a folder checkpoint starts: its tier is chosen afresh
        there, as a file's is when it is first read.
        """
        if not prefix:
            return None
        with self._lock:
            outer = self._key_unlocked(prefix)
        if not outer.startswith("dir:"):
            self._decide(f"dir:{prefix}")
        with self._lock:
            tier = self._route.get(self._key_unlocked(f"{prefix}/x"))
        return None if tier is None else (self.remote if tier == REMOTE else self.local)

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        only = self._folder_tier(prefix)
        if only is not None:
            return only.list_dirs(prefix)
        dirs = set(self.local.list_dirs(prefix))
        dirs.update(self._remote_list(lambda: self.remote.list_dirs(prefix)))
        return sorted(dirs)

    def _remote_list(self, fn: Callable[[], builtins.list[Any]]) -> builtins.list[Any]:
        try:
            result: builtins.list[Any] = self._remote_call(fn)
        except (OSError, TimeoutError) as exc:
            print(f"stagesave: listing the remote tier {self.remote.url} failed ({exc}); "
                  f"using the local tier only for {self.remote_retry_after_s:.0f} s", file=sys.stderr)
            return []
        return result

    def _remote_call(self, fn: Callable[[], T]) -> T:
        """A read of the remote tier, given up after ``remote_timeout_s``.

        Reads of the remote tier sit on paths that must stay fast while the remote is down (the
        local commit lists its directory), and a store's own retry budget can be long: past the
        deadline the remote counts as down for ``remote_retry_after_s`` (the call itself is left
        to finish in the background).

        Raises:
            TimeoutError: the deadline passed, or the remote is known to be down.
            OSError: the remote failed.
        """
        if not self._remote_usable():
            raise TimeoutError(f"the remote tier {self.remote.url} failed recently")
        future = self._probe_pool.submit(fn)
        done, _ = cf.wait([future], timeout=self.remote_timeout_s)
        if not done:
            self._remote_failed()
            raise TimeoutError(
                f"the remote tier {self.remote.url} did not answer within {self.remote_timeout_s:.0f} s"
            )
        try:
            return future.result()
        except FileNotFoundError:
            raise
        except OSError:
            self._remote_failed()
            raise

    # ------------------------------------------------------------------ uploads
    def _committed_locally(self, name: str) -> None:
        """``name`` (a file or a folder) is committed on the local tier: queue its upload."""
        when = time.time()
        with self._lock:
            self._pending[name] = when
        directory = _parent(name)
        self._queue.submit(lambda: self._sync(directory))

    def attach_telemetry(self, callback: TelemetryCallback) -> None:
        """Also send upload telemetry to ``callback`` (e.g. the Checkpointer's own)."""
        self._callbacks.append(callback)

    def wait_uploads(self, timeout: float | None = None) -> builtins.list[SaveTelemetry]:
        """Wait until every queued upload has finished; return the records since the last call.

        Raises:
            TimeoutError: uploads still running after ``timeout`` seconds.
        """
        if not self._queue.drain(timeout):
            raise TimeoutError(f"uploads to {self.remote.url} still running after {timeout} s")
        with self._lock:
            out = list(self._records)
            self._records.clear()
        return out

    def pending_uploads(self) -> builtins.list[str]:
        """Names committed locally whose upload has not succeeded yet."""
        with self._lock:
            return sorted(self._pending)

    def _sync(self, directory: str) -> None:
        """Upload the pending checkpoints of ``directory`` (newest first), then apply retention."""
        with self._lock:
            names = {n: t for n, t in self._pending.items() if _parent(n) == directory}
        found = {c.name: c for c in scan(self.local, directory)}
        for name in sorted(names, key=lambda n: names[n], reverse=True):
            info = found.get(name)
            if info is None or info.status != "committed":
                with self._lock:
                    if self._pending.get(name) == names[name]:
                        self._pending.pop(name)
                if info is not None:  # the local copy rotted since its commit: say so, never upload it
                    self._report_failure(name, f"the local copy of {info.path} no longer matches its proof "
                                         f"({'; '.join(info.problems)}): it was not uploaded. The local disk "
                                         "may be failing.", None)
                continue  # removed or replaced meanwhile: nothing of it to upload
            if not self._upload(info, names[name]):
                return  # the remote tier is failing; the next local commit retries
            with self._lock:
                if self._pending.get(name) == names[name]:
                    self._pending.pop(name)
        self._retain(directory)

    def _upload(self, info: CheckpointInfo, committed_at: float) -> bool:
        tel = SaveTelemetry(path=self.remote.describe(info.name), started_at=time.time(), tier=REMOTE)
        t0 = time.perf_counter()
        try:
            stats = WriteStats()
            if info.manifest is None:
                info = resolve(self.local, info.name)
            if info.status != "committed" or info.manifest is None:
                raise IntegrityError(f"the local copy of {info.path} no longer matches its proof "
                                     f"({'; '.join(info.problems)}): it was not uploaded. The local disk may "
                                     "be failing.")
            tel.bytes = info.size
            copy_checkpoint(self.local, info, self.remote, pool=self._queue.io_pool, stats=stats, read=self._mapped)
            tel.write_s, tel.checksum_s = stats.write_s, stats.checksum_s
            tel.time_to_commit_s = time.time() - committed_at
            tel.commit_s = max(0.0, time.perf_counter() - t0 - stats.write_s)
            tel.throughput_bytes_per_s = tel.bytes / stats.write_s if stats.write_s > 0 else 0.0
            tel.committed_at = time.time()
        except Exception as exc:  # noqa: BLE001 - reported, never fails the (local) save
            self._remote_failed()
            self._report_failure(
                info.name,
                f"uploading {info.path} to {tel.path} failed: {exc}. The local checkpoint is "
                "committed; the upload is retried after the next save",
                tel,
            )
            return False
        self._emit(tel)
        return True

    @contextlib.contextmanager
    def _mapped(self, name: str) -> Iterator[memoryview]:
        """A committed local file as a read-only memory map."""
        path = self.local.local_path(name)
        assert path is not None
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                yield memoryview(b"")
                return
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        view = memoryview(m)
        try:
            yield view
        finally:
            view.release()
            with contextlib.suppress(BufferError):
                m.close()

    def _retain(self, directory: str) -> None:
        try:
            if self.keep_remote is not None:
                retain(self.remote, directory, self.keep_remote)
            if self.keep_local is not None:
                with self._lock:
                    pending = set(self._pending)
                # never remove the only copy: a checkpoint whose upload has not succeeded yet
                retain(self.local, directory, self.keep_local, skip=lambda c: c.name in pending)
        except OSError as exc:
            self._report_failure(directory, f"retention in {self.remote.url} failed: {exc}", None)

    def _report_failure(self, name: str, message: str, tel: SaveTelemetry | None) -> None:
        print(f"stagesave: {message}", file=sys.stderr)
        if tel is None:
            tel = SaveTelemetry(path=self.remote.describe(name), started_at=time.time(), tier=REMOTE)
        tel.error = message
        self._emit(tel)

    def _emit(self, tel: SaveTelemetry) -> None:
        with self._lock:
            self._records.append(tel)
        for cb in list(self._callbacks):
            try:
                cb(tel)
            except Exception as exc:  # noqa: BLE001 - a broken callback must not fail uploads
                print(f"stagesave: telemetry callback failed: {exc!r}", file=sys.stderr)

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float | None = None) -> None:
        """Finish queued uploads, then release both tiers. Safe to call more than once.

        Raises:
            TimeoutError: uploads still running after ``timeout`` seconds (they are abandoned).
        """
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        try:
            if not self._queue.stop(timeout):
                raise TimeoutError(f"uploads to {self.remote.url} still running after {timeout} s")
        finally:
            self._probe_pool.shutdown(wait=False)
            self.local.close()
            self.remote.close()

    def __enter__(self) -> TieredStore:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
