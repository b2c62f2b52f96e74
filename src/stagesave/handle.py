"""The future a save returns."""

from __future__ import annotations

import threading

from .telemetry import SaveTelemetry

__all__ = ["SaveHandle"]


class SaveHandle:
    """Tracks one save (or removal) after ``save()`` returned.

    ``result()`` waits for the commit and raises the background error if the save failed; a
    failure that ``result()`` has raised is not raised again by the checkpointer's next call.
    """

    def __init__(self, path: str, telemetry: SaveTelemetry, kind: str = "save") -> None:
        self.path = path
        self.kind = kind
        self.telemetry = telemetry
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._delivered = False
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether the save has committed or failed."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> SaveTelemetry:
        """Wait until committed and return the telemetry.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointError: the background write failed (the checkpoint was not committed).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.kind} of {self.path} still running after {timeout} s")
        err = self._claim_error(force=True)
        if err is not None:
            raise err
        return self.telemetry

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The background error (without raising it), once done."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.kind} of {self.path} still running after {timeout} s")
        return self._error

    def _claim_error(self, force: bool = False) -> BaseException | None:
        """The error, marked delivered; ``None`` if none or already delivered (unless forced)."""
        with self._lock:
            if self._error is None or (self._delivered and not force):
                return None
            self._delivered = True
            return self._error

    def _mark_delivered(self) -> None:
        """The caller already got this save's failure another way (the call that made the save
        raised): a background error is not raised again by the checkpointer's next call
        (``result()`` still raises it)."""
        with self._lock:
            self._delivered = True

    def _set_done(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "committed")
        return f"<SaveHandle {self.kind} {self.path} {state}>"
