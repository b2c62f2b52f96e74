"""Fixtures of the Accelerate adapter tests: a fresh Accelerate state per test."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def fresh_accelerate_state(monkeypatch):
    """Accelerate keeps process-wide singletons; start and end each test without them."""
    import os

    from accelerate.state import AcceleratorState, GradientState

    for var in list(os.environ):
        if var.startswith(("STAGESAVE_ACCELERATE", "STAGESAVE_CRASH_AT")):
            monkeypatch.delenv(var)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
