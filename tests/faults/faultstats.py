"""Counts of fault-injection trials and invariant violations, printed at the end of the run.

Each test reports what it actually ran (``record``, or the ``fault_class`` marker for a test that
is one trial, counted by the hook in ``conftest.py``); the summary there
prints the totals per fault class, which is where the numbers in RELIABILITY.md
come from. Trials of a test marked xfail for a known bug are counted in a row of their own.
"""

from __future__ import annotations

import threading
from collections import defaultdict

__all__ = ["KNOWN_BUG", "record", "totals"]

#: Suffix of the rows that count trials of a known bug (tests marked xfail until it is fixed).
KNOWN_BUG = " [known bug, xfail]"

_lock = threading.Lock()
_trials: dict[str, int] = defaultdict(int)
_violations: dict[str, int] = defaultdict(int)


def record(fault_class: str, trials: int, violations: int = 0, *, known_bug: bool = False) -> None:
    """Add ``trials`` trials (and the violations they found) to ``fault_class``."""
    key = fault_class + (KNOWN_BUG if known_bug else "")
    with _lock:
        _trials[key] += trials
        _violations[key] += violations


def totals() -> list[tuple[str, int, int]]:
    """``(fault class, trials, violations)`` for every class recorded so far, sorted."""
    with _lock:
        return sorted((k, _trials[k], _violations[k]) for k in _trials)
