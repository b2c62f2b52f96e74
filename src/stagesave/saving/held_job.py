"""The job of a held save (:mod:`.behind`): planned, staged and written on the writer thread.

The caller copied the storages and kept the walk; this job makes the state again over that
copy, plans it through the Checkpointer's plan cache (whose template then serves the next
saves), stages it into a staging buffer as any save, lets the scratch copy go, and writes the
file as :func:`.jobs.file_job` writes any file (through the writer agent when there is one).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import time
from collections.abc import Callable
from typing import Any

from ..handle import SaveHandle
from ..stores.base import Store
from .behind import Held, repoint
from .jobs import file_job
from .pipeline import Job

__all__ = ["held_job"]


def held_job(handle: SaveHandle, store: Store, name: str, held: Held, *, checkpointer: Any,
             meta: dict[str, Any], t_start: float, done: Callable[[], None]) -> Job:
    """The job writing ``held`` to ``name``; ``done`` is called once its scratch copy is let go
    (staged, or failed). ``checkpointer``: its plans, stager, writer and settings."""
    ck, tel = checkpointer, handle.telemetry

    def commit(pool: cf.Executor) -> None:
        try:
            p0 = time.perf_counter()
            state = held.thaw()
            image = ck.plans.plan(state)
            tel.plan_behind_s = time.perf_counter() - p0
            store.check_writable(name, image.size)
            staged = ck.stager.stage([(name, image)], store, tel, algorithm=ck.checksum,
                                     folder=False, behind=True)
            del state  # its tensors view the scratch copy, staged now
            ck.plans.adopt(functools.partial(repoint, held=held))
        finally:
            held.release()
            done()
        blocking = tel.blocking_s  # (a hand-over to the agent would count this job's time)
        try:
            job = ck.writer.route(file_job(handle, store, name, staged, settings=ck, meta=meta,
                                           t_start=t_start), ck)
        except BaseException:
            staged.give_back()
            raise
        tel.blocking_s = blocking
        try:
            if job.settle is not None:
                job.settle(True)  # taken: this job runs it now
            staged.wait()
            job.commit(pool)
            if job.retire is not None:
                job.retire()
        finally:
            staged.give_back()

    return Job(handle, f"saving checkpoint {tel.path}", commit)
