"""Upload: after a local commit on a tiered root, copy the checkpoint to the remote tier.

A tiered root (``stores/tiered.py``) commits on its fast local tier; every local commit queues an
upload here that copies the committed bytes, which carry their own proof, to the remote tier
(invisible until published, a folder's carrier last), reading the committed local file through
``mmap`` and checking each chunk against its proof on the way, so a copy that rotted on disk is
never published remotely. A failed upload never fails the save: it is reported (stderr,
telemetry with ``tier="remote"`` and ``error``) and retried after the next local commit.

After the uploads of a directory, each tier's retention runs; local retention never removes a
checkpoint whose upload is still pending (it would be the only copy). Removals from the remote
tier run on the same ordered queue, after the uploads queued before them. Uploads still queued
when the interpreter exits are finished first (after every Checkpointer's last saves).
"""

from __future__ import annotations

import builtins
import contextlib
import mmap
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

from ..errors import ClosedError, IntegrityError
from ..restore.discovery import scan
from ..restore.info import CheckpointInfo
from ..restore.resolve_file import resolve
from ..stores.base import Store
from ..telemetry import SaveTelemetry, TelemetryCallback
from .after_report import after_report, collecting_here
from .lifecycle import close_all_at_exit
from .pipeline import JobQueue
from .retire import retain
from .transfer import copy_checkpoint
from .write import WriteStats

__all__ = ["Uploader", "register_for_exit", "unregister_for_exit"]

REMOTE = "remote"


class _Flushable(Protocol):
    remote: Store

    def close(self) -> None: ...


_live: weakref.WeakSet[_Flushable] = weakref.WeakSet()
_exit_hook_registered = False


def _flush_at_exit() -> None:
    # Checkpointers first: their last local commits queue uploads that must run too.
    try:
        close_all_at_exit()
    except Exception as exc:  # noqa: BLE001, RUF100 - report, never hang the exit
        print(f"stagesave: flushing checkpointers before exit failed: {exc}", file=sys.stderr)
    for store in list(_live):
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001, RUF100
            print(f"stagesave: uploads to {store.remote.url} did not finish before exit: {exc}",
                  file=sys.stderr)


def _forget_inherited() -> None:
    """In a forked child: the tiered stores it inherited are the parent's to flush."""
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited)


def register_for_exit(store: _Flushable) -> None:
    """Close ``store`` (finishing its uploads) when the interpreter exits."""
    global _exit_hook_registered
    _live.add(store)
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


def unregister_for_exit(store: _Flushable) -> None:
    """``store`` was closed: nothing of it is left to flush at exit."""
    _live.discard(store)


def _parent(name: str) -> str:
    return name.rpartition("/")[0]


class Uploader:
    """The background copy of a local tier's committed checkpoints to a remote tier.

    Args:
        local: The local tier (a directory).
        remote: The remote tier.
        keep_local: Committed checkpoints kept on the local tier (``None``: all).
        keep_remote: Committed checkpoints kept on the remote tier (``None``: all).
        threads: Threads uploading chunks of one file in parallel.
        telemetry_callback: Called with each upload's :class:`SaveTelemetry`.
        on_remote_failure: Called when an upload fails (reads then skip the remote tier a while).
    """

    def __init__(
        self,
        local: Store,
        remote: Store,
        *,
        keep_local: int | None,
        keep_remote: int | None,
        threads: int,
        telemetry_callback: TelemetryCallback | None,
        on_remote_failure: Callable[[], None],
    ) -> None:
        self.local = local
        self.remote = remote
        self.keep_local = keep_local
        self.keep_remote = keep_remote
        self._on_remote_failure = on_remote_failure
        self._callbacks = [telemetry_callback] if telemetry_callback else []
        self._queue = JobQueue(io_threads=threads, name="stagesave-upload")
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}  # name -> when it was committed locally
        # remote copies of deleted names whose queued removal has not run yet: hidden from reads
        self._deleting: dict[str, int] = {}
        self._records: deque[SaveTelemetry] = deque(maxlen=10_000)
        # uploads of local commits not queued yet (held until the commit reported; see committed)
        self._unqueued = 0
        self._pid = os.getpid()  # a forked child's copy has no writer thread to queue them
        # local commits that have not reported yet: no upload takes them before they have
        self._unreported: dict[str, int] = {}
        self._queued = threading.Condition(self._lock)

    # ------------------------------------------------------------------ what is queued
    def committed(self, name: str) -> None:
        """``name`` (a file or a folder) is committed on the local tier: queue its upload.

        Raises:
            ClosedError: the upload queue is stopped.
        """
        when = time.time()
        with self._lock:
            self._pending[name] = when
        directory = _parent(name)
        if self._queue.stopping():
            raise ClosedError("the upload queue is stopped")
        with self._lock:
            self._unqueued += 1
            self._unreported[name] = self._unreported.get(name, 0) + 1

        def queue() -> None:
            with self._lock:  # reported: an upload already queued may take it from now on
                left = self._unreported.pop(name) - 1
                if left:
                    self._unreported[name] = left
            try:
                self._queue.submit(lambda: self._sync(directory))
            except ClosedError as exc:  # stopped since: report, the local commit stands
                self.report_failure(name, f"uploading {self.remote.describe(name)} was not "
                                    f"queued ({exc}); the local checkpoint is committed", None)
            finally:
                with self._lock:
                    self._unqueued -= 1
                    self._queued.notify_all()

        # queued once the local commit has reported (after its handle completed): its
        # telemetry comes before the upload's; wait() waits for it to be queued
        after_report(queue)

    def forget(self, name: str) -> None:
        """``name`` was deleted: its upload, if still pending, no longer holds anything back."""
        with self._lock:
            self._pending.pop(name, None)

    def delete_remote(self, name: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` (removing ``name`` from the remote tier) after the uploads queued so far."""
        with self._lock:
            self._deleting[name] = self._deleting.get(name, 0) + 1

        def remote_delete() -> None:
            try:
                fn()
            except OSError as exc:
                self.report_failure(name, f"removing {self.remote.describe(name)} failed: {exc}",
                                    None)
            finally:
                with self._lock:
                    left = self._deleting.pop(name, 1) - 1
                    if left > 0:
                        self._deleting[name] = left

        self._queue.submit(remote_delete)

    def deleting(self) -> set[str]:
        """Names whose queued remote removal has not run yet."""
        with self._lock:
            return set(self._deleting)

    def is_deleting(self, name: str) -> bool:
        """Whether the queued remote removal of ``name`` has not run yet."""
        with self._lock:
            return name in self._deleting

    def pending(self) -> builtins.list[str]:
        """Names committed locally whose upload has not succeeded yet."""
        with self._lock:
            return sorted(self._pending)

    def wait(self, timeout: float | None = None) -> builtins.list[SaveTelemetry]:
        """Wait until every queued upload has finished; return the records since the last call.

        Raises:
            TimeoutError: uploads still running after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            queued = collecting_here() or os.getpid() != self._pid or self._queued.wait_for(
                lambda: self._unqueued == 0, timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not queued or not self._queue.drain(left):
            raise TimeoutError(f"uploads to {self.remote.url} still running after {timeout} s")
        with self._lock:
            out = list(self._records)
            self._records.clear()
        return out

    def stop(self, timeout: float | None = None) -> bool:
        """Finish queued uploads (and those of commits about to queue theirs), then end the
        threads. False if they did not end in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not collecting_here() and os.getpid() == self._pid:  # (else none will come: this
            with self._lock:  # thread queues them afterwards, or it is a forked child's copy)
                self._queued.wait_for(lambda: self._unqueued == 0, timeout)
        return self._queue.stop(None if deadline is None
                                else max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ the queued work
    def _sync(self, directory: str) -> None:
        """Upload the pending checkpoints of ``directory`` (newest first), then apply retention."""
        with self._lock:
            names = {n: t for n, t in self._pending.items()
                     if _parent(n) == directory and n not in self._unreported}
        found = {c.name: c for c in scan(self.local, directory)}
        for name in sorted(names, key=lambda n: names[n], reverse=True):
            info = found.get(name)
            if info is None or info.status != "committed":
                with self._lock:
                    if self._pending.get(name) == names[name]:
                        self._pending.pop(name)
                if info is not None:  # the local copy rotted since its commit: never upload it
                    self.report_failure(
                        name,
                        f"the local copy of {info.path} no longer matches its proof "
                        f"({'; '.join(info.problems)}): it was not uploaded. The local disk "
                        "may be failing.",
                        None,
                    )
                continue  # removed or replaced meanwhile: nothing of it to upload
            if not self._upload(info, names[name]):
                return  # the remote tier is failing; the next local commit retries
            with self._lock:
                if self._pending.get(name) == names[name]:
                    self._pending.pop(name)
        self._retain(directory)

    def _upload(self, info: CheckpointInfo, committed_at: float) -> bool:
        tel = SaveTelemetry(path=self.remote.describe(info.name), started_at=time.time(),
                            tier=REMOTE)
        t0 = time.perf_counter()
        try:
            stats = WriteStats()
            if info.manifest is None:
                info = resolve(self.local, info.name)
            if info.status != "committed" or info.manifest is None:
                raise IntegrityError(
                    f"the local copy of {info.path} no longer matches its proof "
                    f"({'; '.join(info.problems)}): it was not uploaded. The local disk may "
                    "be failing."
                )
            tel.bytes = info.size
            copy_checkpoint(self.local, info, self.remote, pool=self._queue.io_pool, stats=stats,
                            read=self._mapped)
            tel.write_s, tel.checksum_s = stats.write_s, stats.checksum_s
            tel.time_to_commit_s = time.time() - committed_at
            tel.commit_s = max(0.0, time.perf_counter() - t0 - stats.write_s)
            tel.throughput_bytes_per_s = tel.bytes / stats.write_s if stats.write_s > 0 else 0.0
            tel.committed_at = time.time()
        except Exception as exc:  # noqa: BLE001, RUF100 - reported, never fails the (local) save
            self._on_remote_failure()
            self.report_failure(
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
            self.report_failure(directory, f"retention in {self.remote.url} failed: {exc}", None)

    # ------------------------------------------------------------------ telemetry
    def attach_telemetry(self, callback: TelemetryCallback) -> None:
        """Also send upload telemetry to ``callback`` (e.g. the Checkpointer's own)."""
        self._callbacks.append(callback)

    def report_failure(self, name: str, message: str, tel: SaveTelemetry | None) -> None:
        """Print ``message`` and send it as a failed remote record of ``name``."""
        print(f"stagesave: {message}", file=sys.stderr)
        if tel is None:
            tel = SaveTelemetry(path=self.remote.describe(name), started_at=time.time(),
                                tier=REMOTE)
        tel.error = message
        self._emit(tel)

    def _emit(self, tel: SaveTelemetry) -> None:
        with self._lock:
            self._records.append(tel)
        for cb in list(self._callbacks):
            try:
                cb(tel)
            except Exception as exc:  # noqa: BLE001, RUF100 - a broken callback must not fail uploads
                print(f"stagesave: telemetry callback failed: {exc!r}", file=sys.stderr)
