"""Work a commit starts that must follow the commit's own report.

A tiered store queues a checkpoint's upload when its local copy is published, inside the save's
job on the writer thread; the upload's telemetry must not reach the user before the local
commit's own. The pipeline runs each job inside :func:`collecting`, and the store hands its
queueing to :func:`after_report`: inside a job it runs once the job's handle completed and its
telemetry is out (the store counts what it has yet to queue, so that ``result()`` followed by
``wait_uploads()`` waits for the upload); anywhere else at once.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator

__all__ = ["after_report", "collecting", "collecting_here", "run_all"]

_local = threading.local()


@contextlib.contextmanager
def collecting() -> Iterator[list[Callable[[], None]]]:
    """Collect the :func:`after_report` calls made on this thread until the block ends."""
    outer = getattr(_local, "pending", None)
    pending: list[Callable[[], None]] = []
    _local.pending = pending
    try:
        yield pending
    finally:
        _local.pending = outer


def collecting_here() -> bool:
    """Whether this thread runs a job whose :func:`after_report` calls are held (waiting here
    for them would wait for this thread)."""
    return getattr(_local, "pending", None) is not None


def after_report(fn: Callable[[], None]) -> None:
    """Run ``fn`` after the current job has reported, or now when no job is collecting."""
    pending = getattr(_local, "pending", None)
    if pending is None:
        fn()
    else:
        pending.append(fn)


def run_all(fns: list[Callable[[], None]]) -> None:
    """Run the collected calls in order; a failure is reported on stderr, never raised (the
    commit they follow has happened)."""
    for fn in fns:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the commit stands; say what did not follow
            print(f"stagesave: after a commit: {exc}", file=sys.stderr)
