"""Fault-injection suite: prints how many trials of each fault class ran, and violations found."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import faultstats  # noqa: E402


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    rows = faultstats.totals()
    if not rows:
        return
    tr = terminalreporter
    tr.section("stagesave fault-injection trials")
    width = max(len(r[0]) for r in rows)
    tr.write_line(f"{'fault class':<{width}}  {'trials':>7}  violations")
    for name, trials, violations in rows:
        tr.write_line(f"{name:<{width}}  {trials:>7}  {violations}")


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """Exhaustive variants run only when asked for (``-m slow``); the default run keeps a subset."""
    import pytest

    if "slow" in (config.getoption("markexpr") or ""):
        return
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="exhaustive variant: run with -m slow")
    for item in items:
        if "slow" in item.keywords and str(item.fspath).startswith(here):
            item.add_marker(skip)
