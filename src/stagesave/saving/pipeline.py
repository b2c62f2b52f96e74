"""The background side of a save: one ordered job queue, a pool of I/O threads, and the one job
body every save, folder save, sharded (DCP) save, removal and action runs through:

    wait for device copies -> write and commit -> retire old checkpoints -> give the buffer
    back -> finish (the handle completes, a failure is kept for the next call, telemetry out)

Jobs run one at a time in submission order, so a removal submitted after a
save never overtakes it; each save's chunks are written by the I/O pool in parallel. These
threads only make syscalls, copy memory and hash: no CPU torch op and no collective ever runs here
(either one was reported to switch libgomp into passive waiting and slow training for as long as
the thread lives; ``benchmarks/bench_omp.py`` did not reproduce it on a 2-vCPU VM, the rule stays
as a free precaution). With ``device_staging`` they also queue device-to-host copies on CUDA
streams of their own (``stage_device.py``): GPU work, no OpenMP team. They run at a lower CPU
priority so that the training threads win when cores are scarce.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import sys
import threading
from collections.abc import Callable
from typing import Protocol

from ..errors import ClosedError, UsageError, as_checkpoint_error
from ..handle import SaveHandle
from ..stores.base import Store
from ..telemetry import SaveTelemetry
from . import after_report, inflight

__all__ = ["Job", "JobQueue", "Pipeline", "current_queue", "lower_priority"]

#: Nice value for background threads (Linux applies nice per thread).
BACKGROUND_NICE = 10

_this_thread = threading.local()


def current_queue() -> JobQueue | None:
    """The queue whose writer thread is calling, or ``None`` outside every queue's jobs.

    A job (an action queued with ``Checkpointer.run_after``) that waits for pending work would
    wait for itself and for every job queued behind it: callers use this to wait for nothing
    there (the jobs queued before it have finished, in order).
    """
    queue: JobQueue | None = getattr(_this_thread, "queue", None)
    return queue


def lower_priority() -> None:
    """Raise this thread's nice value; silently keeps the priority where that is not allowed."""
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(current, BACKGROUND_NICE))
    except (OSError, AttributeError):
        pass


class JobQueue:
    """FIFO of callables run by one daemon thread, plus an I/O pool for parallel chunks."""

    def __init__(self, io_threads: int, name: str = "stagesave") -> None:
        self.io_pool = cf.ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix=f"{name}-io", initializer=lower_priority
        )
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            if self._stopping:
                raise ClosedError("the job queue is stopped")
            self._jobs.append(job)
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (no job can be submitted)."""
        with self._cond:
            return self._stopping

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs) + (1 if self._busy else 0)

    def stop(self, timeout: float | None = None) -> bool:
        """Finish queued jobs, then end the threads. False if they did not end in time."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if (
            threading.current_thread() is self._thread
        ):  # a finalizer run by a job's garbage collection
            self.io_pool.shutdown(wait=False)
            return False
        self._thread.join(timeout)
        finished = not self._thread.is_alive()
        if finished:  # (else the writer thread shuts them once its last job is done)
            self.io_pool.shutdown(wait=True)
        return finished

    def _run(self) -> None:
        lower_priority()
        _this_thread.queue = self
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    break
                job = self._jobs.popleft()
                self._busy = True
            try:
                job()  # jobs record their own errors on their handles
            finally:
                del job  # an idle thread holds no job (nor the Checkpointer its closure holds)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        self.io_pool.shutdown(wait=False)  # stopped: no job of this queue uses them again


class Staging(Protocol):
    """What a job holds from staging: device copies to wait for, a buffer to give back."""

    def wait(self) -> None: ...

    def give_back(self) -> None: ...


class Job:
    """One unit of background work: a save (file, folder, sharded rank), a removal or an action.

    ``commit`` writes and commits (it gets the I/O threads); ``retire`` applies retention after
    a commit; ``on_error`` may replace the error reported (and clean up) when a step failed;
    ``settle`` is told whether the queue took the job (``False``: refused, it will never run):
    what was handed over for it (a writer agent's order) is confirmed or taken back.
    """

    __slots__ = ("commit", "handle", "key", "on_error", "retire", "settle", "spec", "staged",
                 "what")

    def __init__(
        self,
        handle: SaveHandle,
        what: str,
        commit: Callable[[cf.Executor], None],
        *,
        staged: Staging | None = None,
        retire: Callable[[], None] | None = None,
        on_error: Callable[[BaseException, BaseException], BaseException] | None = None,
        key: str | None = None,
        spec: object = None,
        settle: Callable[[bool], None] | None = None,
    ) -> None:
        """``spec``: what a save job writes, for a writer agent (:class:`.jobs.SaveSpec`)."""
        self.handle, self.what, self.commit = handle, what, commit
        self.spec, self.settle = spec, settle
        self.staged, self.retire, self.on_error = staged, retire, on_error
        self.key = handle.path if key is None else key


class Pipeline:
    """The background of one Checkpointer: its queue, its failures, its in-flight saves.

    Every job is shown to the whole process while it is pending (``inflight``: a load or a
    listing by another Checkpointer waits for it). A job's failure completes its handle and is
    kept for the next ``save``/``wait``/``close`` of this Checkpointer, raised once.
    """

    def __init__(self, io_threads: int, emit: Callable[[SaveTelemetry], None]) -> None:
        self.io_threads = io_threads
        self._emit = emit
        self.queue: JobQueue | None = None
        self._failed: list[SaveHandle] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        #: A forked child's own I/O threads for reads (it has none of the parent's threads).
        self._child_pool: tuple[int, cf.ThreadPoolExecutor] | None = None
        self._child_lock = threading.Lock()  # taken in forked children only

    # ---------------------------------------------------------------- caller's side
    def io_pool(self) -> cf.Executor:
        """The I/O threads (the queue's; reads use them too), created on first use; in a forked
        child, threads of its own (the parent's pools have no threads there)."""
        pid = os.getpid()
        if pid != self._pid:  # (not under self._lock: a parent's thread may have held it)
            with self._child_lock:
                if self._child_pool is None or self._child_pool[0] != pid:
                    self._child_pool = (pid, cf.ThreadPoolExecutor(
                        self.io_threads, thread_name_prefix="stagesave-io"))
                return self._child_pool[1]
        with self._lock:
            if self.queue is None:
                self.queue = JobQueue(io_threads=self.io_threads)
            return self.queue.io_pool

    def check_open(self) -> None:
        if os.getpid() != self._pid:
            raise UsageError(
                f"this Checkpointer belongs to process {self._pid}, which this one was forked "
                "from: its writer is that process's, so a forked child can load, verify and "
                "list through it but not save or remove; make a new Checkpointer in the child"
            )
        if self._closed:
            raise ClosedError(
                "this Checkpointer is closed; create a new one to save or remove checkpoints"
            )

    def check_usable(self) -> None:
        """Raise if closed, or the undelivered error of an earlier background job."""
        self.check_open()
        self.raise_failures()

    def submit(self, job: Job, *, track: bool = True) -> SaveHandle:
        """Queue ``job`` behind every earlier one; if ``close()`` came first, give back what it
        holds and raise :class:`ClosedError`.

        ``track``: show it as pending on its key to the whole process (saves and removals).
        """
        if track:
            inflight.register(job.key, job.handle)
        with self._lock:
            queue = None
            if not self._closed:
                if self.queue is None:
                    self.queue = JobQueue(io_threads=self.io_threads)
                queue = self.queue
        if queue is not None:
            try:
                queue.submit(lambda: self._run(job))
            except ClosedError:  # stopped by a close() racing this call
                pass
            else:
                if job.settle is not None:
                    job.settle(True)
                return job.handle
        if job.settle is not None:  # before its buffer is given back: nobody may write it
            job.settle(False)
        if job.staged is not None:
            job.staged.give_back()
        error = ClosedError(
            f"the Checkpointer was closed while {job.handle.path} was being "
            "staged; it was not written"
        )
        inflight.forget(job.key, job.handle)
        job.handle._set_done(error)
        raise error

    def raise_failures(self) -> None:
        """Raise the first undelivered failure (the others are printed)."""
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

    def report_failures(self) -> None:
        """Print undelivered failures (on the way out, where raising helps nobody)."""
        for handle in self._failed:
            err = handle._claim_error()
            if err is not None:
                print(f"stagesave: a checkpoint save failed: {err}", file=sys.stderr)

    def pending(self) -> int:
        q = self.queue
        return q.pending() if q is not None and os.getpid() == self._pid else 0

    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted job finished (a job of this queue waits for nothing).

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointError: a background job failed and its error was not delivered yet.
        """
        if not self.drain(timeout):
            raise TimeoutError(
                f"{self.pending()} checkpoint operations still running after {timeout} s"
            )
        self.raise_failures()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for the queue without raising; False on timeout."""
        q = self.queue
        if q is None or q is current_queue():  # a job of this queue would wait for itself
            return True
        if os.getpid() != self._pid:  # a forked child: the queue and its thread are the
            return True  # parent's (its state as of the fork would never change here)
        return q.drain(timeout)

    def mark_closed(self) -> bool:
        """Refuse new jobs from now on; returns whether this call closed it (the first)."""
        with self._lock:
            was_closed, self._closed = self._closed, True
        return not was_closed

    def stop(self, timeout: float | None = None) -> None:
        """Finish the queued jobs and end the threads (after :meth:`mark_closed`).

        Raises:
            TimeoutError: jobs still running after ``timeout`` seconds (not committed yet).
        """
        q = self.queue
        if q is not None and not q.stop(timeout):
            raise TimeoutError(
                f"stagesave: {q.pending()} checkpoint operations still running after "
                f"{timeout} s; they are not committed yet (they go on in the background: a "
                "writer agent's finish even if this process exits, a writer thread's only "
                "while it runs)"
            )

    def settle(self, store: Store) -> None:
        """Before listing ``store``'s directory: wait for this queue (link updates and actions
        included) and for every save and removal pending inside it in the process."""
        self.drain()
        inflight.wait_under(store.describe(""))

    def release(self) -> None:
        """End the threads of an idle pipeline whose Checkpointer was dropped unclosed."""
        queue, self.queue = self.queue, None
        if queue is not None:
            queue.stop(None)

    # ---------------------------------------------------------------- writer's side
    def _run(self, job: Job) -> None:
        """The one job body. What the commit started for afterwards (a tiered store's upload)
        is queued once the handle completed and the telemetry went out, whatever happened; the
        thread counts as inside the job until then (a telemetry callback that waits for the
        store's uploads does not wait for this job's, which only this thread can queue)."""
        error: BaseException | None = None
        after: list[Callable[[], None]] = []
        try:
            with after_report.collecting() as after:
                try:
                    if job.staged is not None:
                        job.staged.wait()
                    job.commit(self.io_pool())
                    if job.retire is not None:
                        job.retire()
                except BaseException as exc:  # noqa: BLE001 - delivered through the handle
                    error = exc  # (whatever happens next, never reported committed)
                    error = as_checkpoint_error(exc, f"{job.what} failed")
                    if job.on_error is not None:
                        try:
                            error = job.on_error(exc, error)
                        except BaseException as inner:  # noqa: BLE001 - deliver the error as is
                            print(f"stagesave: judging {job.what}'s failure failed: {inner!r}",
                                  file=sys.stderr)
                    if job.handle.kind == "save":
                        job.handle.telemetry.error = str(error)
                finally:
                    try:
                        if job.staged is not None:
                            job.staged.give_back()
                    finally:
                        job.handle._set_done(error)
                        with self._lock:  # after: the next call that takes it finds its error
                            if error is not None:
                                self._failed.append(job.handle)
                        # after: a reader that no longer sees it pending finds it done
                        inflight.forget(job.key, job.handle)
                if job.handle.kind == "save":
                    self._emit_safely(job.handle.telemetry)
        finally:
            after_report.run_all(after)

    def _emit_safely(self, tel: SaveTelemetry) -> None:
        """Telemetry out; whatever a callback raises is printed (the writer thread goes on)."""
        try:
            self._emit(tel)
        except BaseException as exc:  # noqa: BLE001 - a callback must not end the writer
            print(f"stagesave: telemetry callback failed: {exc!r}", file=sys.stderr)
