"""Whether a ``save_state`` sits inside a training loop: the signal that makes it asynchronous.

An asynchronous save pays off only when there is training to overlap it with; a save made with
nothing to hide it behind (before the first step, after the loop, between two evaluations, in a
test) is followed by code that reads, copies, lists or uploads the folder, so it returns
committed. The signal: **an optimizer prepared by this Accelerator took a step since the previous
``save_state`` or ``load_state``**. It is observed through torch's global optimizer post-step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``), registered once per process, so
nothing of the Accelerator or the optimizers is replaced and the non-patching
``AcceleratorCheckpointer`` follows the same rule as ``enable()``. An optimizer step is what every
training loop has, whether it calls ``accelerator.backward(loss)`` or ``loss.backward()``; under
gradient accumulation Accelerate steps the real optimizer only on the synchronizing micro-step.
The hook costs one Python call per optimizer step.

Once every optimizer of the Accelerator has stepped, the run's state (the optimizers'
included) exists to be measured: the checkpointer makes its first save's staging buffer then
(``_ahead.py``).

Each :class:`TrainingSignal` holds its Accelerator (and its checkpointer) weakly: observing
never keeps one alive.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["TrainingSignal"]

_observers: weakref.WeakSet[TrainingSignal] = weakref.WeakSet()
_lock = threading.Lock()
_hook: Any = None


def _on_any_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    for signal in list(_observers):
        signal._on_step(optimizer)


class TrainingSignal:
    """Records optimizer steps of one Accelerator's prepared optimizers.

    Args:
        accelerator: The Accelerator whose ``_optimizers`` (``AcceleratedOptimizer`` wrappers)
            count; the torch optimizer inside each is what the hook reports.
        first_step: Called (no arguments, on the training thread, right after the step) once
            every prepared optimizer has state: when each stepped once, or one steps again
            (several optimizers); it must not raise.
    """

    def __init__(
        self, accelerator: Any, first_step: weakref.WeakMethod[Callable[[], None]] | None = None
    ) -> None:
        self._accelerator = weakref.ref(accelerator)
        self._stepped = False
        #: called (on the training thread) once every optimizer stepped, and again after
        #: :meth:`rearm`
        self._first_step = first_step
        self._armed = first_step is not None
        self._seen: set[int] = set()  # optimizers stepped since arming
        global _hook
        with _lock:
            if _hook is None:
                from torch.optim.optimizer import register_optimizer_step_post_hook

                _hook = register_optimizer_step_post_hook(_on_any_step)
            _observers.add(self)

    def _on_step(self, optimizer: Any) -> None:
        if self._stepped and not self._armed:
            return
        acc = self._accelerator()
        if acc is None:
            return
        prepared_all = getattr(acc, "_optimizers", ())
        for prepared in prepared_all:
            if prepared is optimizer or getattr(prepared, "optimizer", None) is optimizer:
                self._stepped = True
                if self._armed and self._every_one_stepped(id(optimizer), len(prepared_all)):
                    self._armed = False
                    call = self._first_step() if self._first_step is not None else None
                    if call is not None:
                        call()
                return

    def _every_one_stepped(self, key: int, count: int) -> bool:
        """Whether the state of every optimizer exists now: each prepared one stepped since
        arming, or one steps a second time (the others do not step every iteration)."""
        again = key in self._seen
        self._seen.add(key)
        return again or len(self._seen) >= count

    def rearm(self) -> None:
        """Call ``first_step`` again at the next step (a new run of the same Accelerator)."""
        self._armed = self._first_step is not None
        self._seen.clear()

    def consume(self) -> bool:
        """Whether a step happened since the last call (or since construction); resets it."""
        stepped, self._stepped = self._stepped, False
        return stepped

    def stop(self) -> None:
        """Stop observing; the process-wide hook goes when no signal observes any more."""
        global _hook
        with _lock:
            _observers.discard(self)
            if not _observers and _hook is not None:
                _hook.remove()
                _hook = None
