"""pytest plugin: one JSON line per test phase report, into ``$STAGESAVE_UPSTREAM_RECORD``.

Loaded in every mode of ``scripts/upstream-tests.sh`` (plain included); it only observes.
``summarize.py`` turns the lines into per-test outcomes (node ids exactly as pytest names them,
setup/teardown errors included) and categorized failures.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_OUT = None


def pytest_configure(config: pytest.Config) -> None:
    global _OUT
    path = os.environ.get("STAGESAVE_UPSTREAM_RECORD")
    if path:
        _OUT = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed at unconfigure


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OUT is not None:
        _OUT.close()


def _message(report: Any) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    if isinstance(report.longrepr, tuple):  # skips: (file, line, reason)
        return str(report.longrepr[2])
    return str(report.longrepr or "")


def _write(row: dict[str, Any]) -> None:
    if _OUT is not None:
        _OUT.write(json.dumps(row) + "\n")
        _OUT.flush()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    row: dict[str, Any] = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration": round(report.duration, 3),
    }
    if hasattr(report, "wasxfail"):
        row["xfail"] = True
    if report.outcome != "passed":
        row["message"] = _message(report)[:2000]
        if report.outcome == "failed":
            row["text"] = report.longreprtext[-6000:]
    _write(row)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.outcome == "failed":
        _write({"nodeid": report.nodeid or "<collection>", "when": "collect", "outcome": "failed",
                "message": _message(report)[:2000], "text": report.longreprtext[-6000:]})
