"""The process's Checkpointers, and what happens to their pending saves at exit or SIGTERM.

Saves still in the background when the interpreter exits are committed first (every live
Checkpointer is closed by a hook that runs before ``concurrent.futures`` refuses new work);
:func:`flush_on_sigterm` does the same when a scheduler sends SIGTERM before a kill.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Protocol

from .ziplayout import forget_layouts

__all__ = [
    "close_all_at_exit", "flush_all", "flush_on_sigterm", "live", "register", "release_closed",
    "release_unclosed", "unregister",
]


class _Flushable(Protocol):
    @property
    def pipeline(self) -> Any: ...

    def close(self, timeout: float | None = None) -> None: ...


_live: weakref.WeakSet[Any] = weakref.WeakSet()


def register(ckpt: _Flushable, parts: tuple[Any, Any, Any, Any]) -> None:
    """Count ``ckpt`` among the live Checkpointers (until :func:`unregister` or collection).

    Dropped without ``close()``, its ``parts`` (pipeline, stager, staging memory, writer) are
    released by a finalizer (not at exit, where every live Checkpointer is closed, its pending saves
    committed first).
    """
    weakref.finalize(ckpt, release_unclosed, *parts).atexit = False
    _live.add(ckpt)


def unregister(ckpt: _Flushable) -> bool:
    """Drop ``ckpt``; returns whether it was the last live one."""
    _live.discard(ckpt)
    return not _live


def release_unclosed(pipeline: Any, stager: Any, memory: Any, writer: Any) -> None:
    """Free the threads and buffers of a Checkpointer dropped without ``close()`` (its
    finalizer: these hold nothing that refers back to the Checkpointer, and one with jobs still
    queued is referenced by them, so it is collected idle only)."""
    pipeline.release()
    writer.close()
    stager.close(wait=False)
    memory.close()


def release_closed(ckpt: Any, parts: tuple[Any, Any, Any, Any], timeout: float | None) -> None:
    """After ``close()`` stopped the pipeline: stop the writer agent (``timeout``), free
    buffers, stores and copy threads, and unregister ``ckpt`` (the last one: nothing planned
    stays behind)."""
    writer, stager, memory, targets = parts
    writer.close(timeout)
    memory.close()
    targets.close()
    stager.close()
    if unregister(ckpt):
        forget_layouts()


def live() -> list[Any]:
    return list(_live)


def flush_all(timeout: float | None = None) -> bool:
    """Wait (at most ``timeout`` seconds in all) for the pending saves of every Checkpointer.

    Failures are printed, not raised (this runs on the way out). Returns whether all finished.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    ok = True
    for ckpt in list(_live):
        pipeline = ckpt.pipeline
        if pipeline.queue is None:
            continue
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not pipeline.drain(left):
            ok = False
            print(
                f"stagesave: {pipeline.pending()} checkpoint operations still running after "
                f"{timeout} s; they are not committed",
                file=sys.stderr,
            )
        pipeline.report_failures()
    return ok


def flush_on_sigterm(timeout: float = 60.0) -> None:
    """On SIGTERM, let pending saves commit (for at most ``timeout`` s), then terminate as before.

    For loops outside a framework that handles SIGTERM itself (schedulers send it before a
    kill). The previous handler runs afterwards; with the default one the process then dies of
    SIGTERM as it would have; its Checkpointers are closed first (the saves are committed), so
    their writer agents exit and keep no snapshot in memory. Call it from the main thread.
    """
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        flush_all(timeout)
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            close_all_at_exit()  # committed above: only the agents and buffers are left
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)


def close_all_at_exit() -> None:
    """Close every live Checkpointer (their pending saves commit first); failures are printed."""
    for ckpt in list(_live):
        try:
            ckpt.close()
        except BaseException as exc:  # noqa: BLE001 - report, never hang the exit
            print(f"stagesave: a checkpoint save failed before exit: {exc}", file=sys.stderr)


def _forget_inherited() -> None:
    """In a forked child (a DataLoader worker, a fork-started process): the Checkpointers it
    inherited are the parent's; its exit must not close them (that would stop the parent's
    writer agent and remove its buffers' segments)."""
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited)


# Flush before concurrent.futures refuses new work at interpreter shutdown: threading's exit
# hooks run in reverse order of registration, before atexit handlers and before
# concurrent.futures (imported above, so registered earlier) shuts its pools.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(close_all_at_exit)
else:  # pragma: no cover - other Python implementations
    atexit.register(close_all_at_exit)
