"""The last few plans of a writer, most recent first.

One writer often alternates between a few structures: Accelerate saves each model and each
optimizer as its own DCP folder through one writer, so a cache of only the last plan would never
hit. Finding an entry compares it with the save at hand, most recent first; a comparison with
another structure fails at its first element (another key), so a miss costs little.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["MAX_KEPT", "Recent"]

T = TypeVar("T")

#: Structures kept per writer (each entry holds its plan: ~1 KiB per item).
MAX_KEPT = 4


class Recent(Generic[T]):
    """Up to ``size`` entries, most recently found or added first."""

    def __init__(self, size: int = MAX_KEPT) -> None:
        self.size = size
        self.entries: list[T] = []

    def find(self, same: Callable[[T], bool]) -> T | None:
        for i, entry in enumerate(self.entries):
            if same(entry):
                if i:
                    self.entries.insert(0, self.entries.pop(i))
                return entry
        return None

    def add(self, entry: T) -> None:
        self.entries.insert(0, entry)
        del self.entries[self.size :]

    def drop(self, entry: T) -> None:
        self.entries = [e for e in self.entries if e is not entry]
