"""The job of a held save (:mod:`.behind`): planned, staged and written on the writer thread.

The caller copied the storages, kept the walk and leased the staging buffer (so that buffers
go to jobs in the order they are queued, as every save's do); this job makes the state again
over that copy, plans it through the Checkpointer's plan cache (whose template then serves the
next saves), stages it into that buffer, lets the scratch copy go, and writes the file as
:func:`.jobs.file_job` writes any file (through the writer agent when there is one).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import time
import traceback
from typing import Any

from ..handle import SaveHandle
from ..stores.base import Store
from .behind import Held, repoint
from .jobs import file_job
from .lease import Lease
from .pipeline import Job

__all__ = ["Holding", "held_job"]


class Holding:
    """What a held save holds until its job gives it back: the scratch copy and the staging
    buffer leased for it (given back once, whatever happens; the job's queue gives it back
    when it refuses the job)."""

    def __init__(self, held: Held, lease: Lease) -> None:
        self.held, self.lease = held, lease

    def wait(self) -> None:
        """Nothing is in flight to a device."""

    def give_back(self) -> None:
        self.held.release()
        self.lease.give_back()


def _forget_frames(exc: BaseException | None) -> None:
    """Clear the frames of ``exc``'s tracebacks, its causes' and contexts' too: a failed plan's
    frames hold the rebuilt state, whose tensors keep the scratch copy (up to gigabytes) for as
    long as the error is kept for the caller."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def held_job(handle: SaveHandle, store: Store, name: str, holding: Holding, *,
             checkpointer: Any, meta: dict[str, Any], t_start: float) -> Job:
    """The job writing ``holding``'s state to ``name``. ``checkpointer``: its plans, stager,
    writer and settings."""
    ck, tel, held = checkpointer, handle.telemetry, holding.held

    def commit(pool: cf.Executor) -> None:
        state: Any = None
        try:
            p0 = time.perf_counter()
            state = held.thaw()
            image = ck.plans.plan(state)
            tel.plan_behind_s = time.perf_counter() - p0
            store.check_writable(name, image.size)
            staged = ck.stager.stage([(name, image)], store, tel, algorithm=ck.checksum,
                                     folder=False, lease=holding.lease)
            state = None  # its tensors view the scratch copy, staged now
            ck.plans.adopt(functools.partial(repoint, held=held))
        except BaseException as exc:
            _forget_frames(exc)
            raise
        finally:
            state = None
            held.release()
        blocking = tel.blocking_s  # (a hand-over to the agent would count this job's time)
        job = ck.writer.route(file_job(handle, store, name, staged, settings=ck, meta=meta,
                                       t_start=t_start), ck)
        tel.blocking_s = blocking
        if job.settle is not None:
            job.settle(True)  # taken: this job runs it now
        staged.wait()
        job.commit(pool)
        if job.retire is not None:
            job.retire()

    return Job(handle, f"saving checkpoint {tel.path}", commit, staged=holding)
