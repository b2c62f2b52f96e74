"""The process-wide view of pending work: every save and removal not finished yet, by path.

Each ``Checkpointer`` registers the operations it submits here, keyed by the target's
description (an absolute local path or a URL). Any entry point of the process that reads,
lists, checks or removes a path first waits for the operations pending on it (or, for a
listing, on anything inside the listed directory), whichever instance submitted them: a
checkpoint saved through one plugin instance is there for a fresh ``Trainer``, for
``stagesave.load`` and for a second ``Checkpointer``.

Waiting never raises the operation's error: that belongs to whoever submitted it. On a
writer thread (an action queued with ``Checkpointer.run_after``) nothing is waited for: the
job would wait for itself and for the jobs queued behind it, and jobs of two instances waiting
for each other would never end. There, as in another process, a path shows its last commit.
"""

from __future__ import annotations

import os
import threading
import time

from ..handle import SaveHandle
from .pipeline import current_queue

__all__ = ["forget", "pending", "register", "wait_path", "wait_under"]

_lock = threading.Lock()
_by_key: dict[str, list[SaveHandle]] = {}


def _forget_in_child() -> None:
    """A forked child: the operations pending are its parent's, whose threads complete them;
    the child would never see them complete (nor a lock its parent's threads held released)."""
    global _lock
    _lock = threading.Lock()
    _by_key.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def register(key: str, handle: SaveHandle) -> None:
    """Record ``handle`` as pending on ``key`` until :func:`forget`."""
    with _lock:
        _by_key.setdefault(key, []).append(handle)


def forget(key: str, handle: SaveHandle) -> None:
    """Drop ``handle`` from ``key``'s pending operations (it finished, or never started)."""
    with _lock:
        handles = _by_key.get(key)
        if handles is None:
            return
        if handle in handles:
            handles.remove(handle)
        if not handles:
            del _by_key[key]


def pending(key: str, kind: str | None = None) -> list[SaveHandle]:
    """The operations pending on ``key`` (of ``kind`` only, when given), oldest first."""
    with _lock:
        return [h for h in _by_key.get(key, ()) if kind is None or h.kind == kind]


def _within(key: str, outer: str) -> bool:
    """Whether ``key`` is ``outer`` or lies inside it."""
    outer = outer.rstrip("/")
    return key.rstrip("/") == outer or key.startswith(outer + "/")


def _wait(handles: list[SaveHandle], timeout: float | None) -> bool:
    if current_queue() is not None:
        return True  # a writer thread's job (see the module's docstring)
    deadline = None if timeout is None else time.monotonic() + timeout
    for h in handles:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            h.exception(left)
        except TimeoutError:
            return False
    return True


def wait_path(key: str, timeout: float | None = None) -> bool:
    """Wait for every operation pending, when called, on ``key`` or on a folder holding it (a
    file inside a folder checkpoint is there once the folder is). Returns whether all finished.
    """
    with _lock:
        handles = [h for k, hs in _by_key.items() if _within(key, k) for h in hs]
    return _wait(handles, timeout)


def wait_under(root: str, timeout: float | None = None) -> bool:
    """Wait for every operation pending on ``root``, on anything inside it, or on a folder
    holding it (what a listing of ``root`` shows). Returns whether all finished.
    """
    with _lock:
        handles = [
            h for k, hs in _by_key.items() if _within(k, root) or _within(root, k) for h in hs
        ]
    return _wait(handles, timeout)
