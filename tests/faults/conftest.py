"""Fault-injection suite: prints how many trials of each fault class ran, and violations found."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import faultstats
import pytest


def pytest_configure(config):  # type: ignore[no-untyped-def]
    config.addinivalue_line(
        "markers",
        "fault_class(name): count this test as one trial of that fault class in the summary",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    """A test marked ``fault_class`` is one trial; it found a violation if its body failed."""
    outcome = yield
    marker = item.get_closest_marker("fault_class")
    if marker is None or call.when != "call":
        return
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        return  # skipped inside the test: no trial ran
    known_bug = item.get_closest_marker("xfail") is not None
    faultstats.record(marker.args[0], 1, int(call.excinfo is not None), known_bug=known_bug)


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
