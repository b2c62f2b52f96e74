"""What a ``StagedCheckpointIO`` holds while it runs, created on first use, dropped at teardown.

The checkpointer (threads, staging buffers), the links and the removals they hold back, the
pending save of each path, the telemetry waiting for the logging callback, and whether saves on
this thread are asynchronous. The plugin keeps only its options; pickling it drops this object
and a copy starts a fresh one.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from stagesave import Checkpointer, SaveHandle, SaveTelemetry
from stagesave.saving.expected import path_key
from stagesave.saving.holdback import RemovalGuard
from stagesave.saving.links import LinkKeeper

__all__ = ["TELEMETRY_BACKLOG", "Runtime", "flush_and_close", "left"]

log = logging.getLogger("stagesave.lightning")

#: How many finished saves' telemetry the plugin keeps for the logging callback.
TELEMETRY_BACKLOG = 1024


class Runtime:
    """The plugin's threads, buffers and pending work.

    Args:
        new_checkpointer: Makes the checkpointer on first use (the plugin's options).
        forward: Called on the writer thread with each save's telemetry (the user's callback).
    """

    def __init__(
        self,
        new_checkpointer: Callable[[], Checkpointer],
        forward: Callable[[SaveTelemetry], None],
    ) -> None:
        self._new_checkpointer = new_checkpointer
        self._forward = forward
        self._lock = threading.RLock()
        self._ckpt: Checkpointer | None = None
        self._links = LinkKeeper(log)
        self._guard = RemovalGuard(log)
        self._handles: dict[str, SaveHandle] = {}
        self._telemetry: collections.deque[SaveTelemetry] = collections.deque(
            maxlen=TELEMETRY_BACKLOG
        )
        self._mode = threading.local()  # per thread: is the save being made inside the fit loop?
        self._async_active = False  # an asynchronous save was made since the last teardown
        #: the staging buffer of this fit's first save was asked for (or will not be)
        self.sized_for_fit = False
        self.warned_replaced_save = False

    # ------------------------------------------------------------------ the core, on demand
    @property
    def checkpointer(self) -> Checkpointer:
        """The checkpointer (created on first use)."""
        with self._lock:
            if self._ckpt is None:
                self._ckpt = self._new_checkpointer()
            return self._ckpt

    def on_telemetry(self, tel: SaveTelemetry) -> None:
        """Runs on the writer thread: record, report a failure at once, pass on."""
        self._telemetry.append(tel)
        self._guard.note(tel)
        if tel.error:
            log.error(
                "stagesave: saving %s failed in the background: %s. The checkpoint was not "
                "committed; the error is raised at the next save, wait() or teardown.",
                tel.path,
                tel.error,
            )
        self._forward(tel)

    def pop_telemetry(self) -> list[SaveTelemetry]:
        """Telemetry of the saves finished since the last call (oldest first)."""
        out = []
        while True:
            try:
                out.append(self._telemetry.popleft())
            except IndexError:
                return out

    # ------------------------------------------------------------------ when a save is asynchronous
    @contextmanager
    def saving(self, *, asynchronous: bool) -> Iterator[None]:
        """Saves made on this thread inside the block are (not) asynchronous."""
        previous = getattr(self._mode, "asynchronous", None)
        self._mode.asynchronous = asynchronous
        try:
            yield
        finally:
            self._mode.asynchronous = previous

    def asynchronous(self) -> bool:
        """Whether a save made now on this thread returns once staged."""
        return getattr(self._mode, "asynchronous", None) is not False

    def mark_asynchronous(self) -> None:
        """An asynchronous save was made: keep the threads until teardown."""
        with self._lock:
            self._async_active = True

    def keep_until_teardown(self) -> None:
        """A fit's first save has its buffer made ahead: keep the checkpointer and its buffers
        until teardown, as after an asynchronous save."""
        self.mark_asynchronous()

    # ------------------------------------------------------------------ pending saves and links
    def track(self, path: str, handle: SaveHandle) -> None:
        """Record ``handle`` as the pending save of ``path``."""
        with self._lock:
            self._handles = {k: h for k, h in self._handles.items() if not h.done()}
            self._handles[path_key(path)] = handle

    def link(self, target: str, link: str) -> None:
        """Point ``link`` at ``target`` once ``target``'s pending save (if any) committed."""
        with self._lock:
            handle = self._handles.get(path_key(target))
        self._links.link(self.checkpointer, target, link, handle)

    def settle_link(self, path: str) -> None:
        """Wait for the queued update of ``path``, if it is a link with one."""
        self._links.settle(path)

    def remove(self, target: str) -> None:
        """Remove ``target``: now outside a run, otherwise behind the saves submitted before
        (kept if the last of those failed, or while a link points at it)."""
        ckpt = self.checkpointer
        with self._lock:
            queued = self._async_active
        if not queued or getattr(self._mode, "asynchronous", None) is False:
            # no asynchronous save to stay behind (outside a run): remove it now
            try:
                ckpt.remove(target).result()
            finally:
                self.release_if_idle()
            return
        if "://" not in target and self._links.remove(ckpt, target):
            return
        self._guard.remove_after_saves(ckpt, target)

    # ------------------------------------------------------------------ barriers and the end
    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted save, removal and link update has finished."""
        ckpt = self._ckpt
        if ckpt is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        ckpt.wait(timeout)
        # The link updates just finished may free checkpoints whose removal was held.
        self._links.release(ckpt)
        ckpt.wait(left(deadline))

    def pending(self) -> int:
        """Saves, removals and link updates not finished yet."""
        return self._ckpt.pending() if self._ckpt is not None else 0

    def release_if_idle(self) -> None:
        """Outside a run (no asynchronous save since the last teardown): end the threads and
        free the staging buffers now, as ``teardown`` does, so that saves and loads between or
        after runs leave nothing behind. Errors are raised unless one is already propagating."""
        with self._lock:
            if self._async_active or self._ckpt is None:
                return
            ckpt, self._ckpt = self._ckpt, None
            links, self._links = self._links, LinkKeeper(log)
        errors = flush_and_close(ckpt, links, None)
        links.kept()
        if not errors:
            return
        if sys.exc_info()[1] is not None:
            for exc in errors:
                log.error("stagesave: while another error was propagating: %s", exc)
            return
        raise errors[0]

    def close(self, deadline: float | None) -> list[BaseException]:
        """Flush and close (bounded by ``deadline``); the next use starts afresh. Returns the
        errors (the caller raises or reports them)."""
        with self._lock:
            ckpt, self._ckpt = self._ckpt, None
            links, self._links = self._links, LinkKeeper(log)
            self._async_active = False
            self.sized_for_fit = False
        errors = flush_and_close(ckpt, links, deadline)
        links.kept()
        return errors


def left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value; ``None``: no limit)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def flush_and_close(
    ckpt: Checkpointer | None, links: LinkKeeper, deadline: float | None
) -> list[BaseException]:
    """Wait for every operation, submit the removals the last link updates freed, close.

    Returns the errors instead of raising them (the caller decides whether they may be raised).
    """
    if ckpt is None:
        return []
    errors: list[BaseException] = []
    try:
        ckpt.wait(left(deadline))
        links.release(ckpt)
    except TimeoutError as exc:
        errors.append(exc)
    except BaseException as exc:  # noqa: BLE001, RUF100 - the caller raises or reports it
        errors.append(exc)
        links.release(ckpt)
    try:
        ckpt.close(0.0 if errors and isinstance(errors[0], TimeoutError) else left(deadline))
    except TimeoutError as exc:
        if not errors:
            errors.append(exc)
    except BaseException as exc:  # noqa: BLE001, RUF100
        errors.append(exc)
    return errors
