"""Counts of fault-injection trials and invariant violations, printed at the end of the run.

Each test reports what it actually ran (``record``); the summary in ``conftest.py`` prints the
totals per fault class, which is where the numbers in RELIABILITY.md come from.
"""

from __future__ import annotations

import threading
from collections import defaultdict

__all__ = ["record", "totals"]

_lock = threading.Lock()
_trials: dict[str, int] = defaultdict(int)
_violations: dict[str, int] = defaultdict(int)


def record(fault_class: str, trials: int, violations: int = 0) -> None:
    """Add ``trials`` trials (and the violations they found) to ``fault_class``."""
    with _lock:
        _trials[fault_class] += trials
        _violations[fault_class] += violations


def totals() -> list[tuple[str, int, int]]:
    """``(fault class, trials, violations)`` for every class recorded so far, sorted."""
    with _lock:
        return sorted((k, _trials[k], _violations[k]) for k in _trials)
