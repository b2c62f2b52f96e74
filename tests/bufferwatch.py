"""Which staging buffers a test's saves make, and on which thread (a buffer made ahead is made
on ``stagesave-buffer``; one made by the save itself on the caller's thread)."""

from __future__ import annotations

import threading

import pytest

from stagesave.saving.buffers import GROWTH_STEP, HostBuffer


def watch_staging_buffers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """From now on until the test ends, every staging buffer allocated, as (capacity, thread
    name), in order. Staging buffers grow in :data:`GROWTH_STEP` steps; other host buffers
    (e.g. a load's) are left out."""
    made: list[tuple[int, str]] = []
    real_allocate = HostBuffer.allocate.__func__  # type: ignore[attr-defined]

    def allocate(cls: type, capacity: int, pinned: bool, shared: bool = False) -> HostBuffer:
        if capacity % GROWTH_STEP == 0:
            made.append((capacity, threading.current_thread().name))
        return real_allocate(cls, capacity, pinned, shared)  # type: ignore[no-any-return]

    monkeypatch.setattr(HostBuffer, "allocate", classmethod(allocate))
    return made
