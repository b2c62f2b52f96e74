"""The background side: one ordered job queue and a pool of I/O threads.

Jobs (saves, removals) run one at a time in submission order, so a removal submitted after a
save never overtakes it; each save's chunks are written by the I/O pool in parallel. These
threads only make syscalls, copy memory and hash: no CPU torch op and no collective ever runs here
(either one was reported to switch libgomp into passive waiting and slow training for as long as
the thread lives; ``benchmarks/bench_omp.py`` did not reproduce it on a 2-vCPU VM, the rule stays
as a free precaution). With ``device_staging`` they also queue device-to-host copies on CUDA
streams of their own (``_device.py``): GPU work, no OpenMP team. They run at a lower CPU priority so that the training threads win when cores are scarce.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import threading
from collections.abc import Callable

__all__ = ["JobQueue", "current_queue", "lower_priority"]

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
                raise RuntimeError("job queue is stopped")
            self._jobs.append(job)
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs) + (1 if self._busy else 0)

    def stop(self, timeout: float | None = None) -> bool:
        """Finish queued jobs, then end the threads. False if they did not end in time."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if threading.current_thread() is self._thread:  # a finalizer run by a job's garbage collection
            self.io_pool.shutdown(wait=False)
            return False
        self._thread.join(timeout)
        finished = not self._thread.is_alive()
        self.io_pool.shutdown(wait=finished)
        return finished

    def _run(self) -> None:
        lower_priority()
        _this_thread.queue = self
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                job()  # jobs record their own errors on their handles
            finally:
                del job  # an idle thread holds no job (nor the Checkpointer its closure holds)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
