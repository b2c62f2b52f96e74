"""Fixtures of the Accelerate adapter tests: a fresh Accelerate state per test, and the forked
multi-process and crash scenarios of ``dist_worker.py`` (run once per session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def fresh_accelerate_state(monkeypatch):
    """Accelerate keeps process-wide singletons; start and end each test without them."""
    from accelerate.state import AcceleratorState, GradientState

    for var in list(os.environ):
        if var.startswith(("STAGESAVE_ACCELERATE", "STAGESAVE_CRASH_AT")):
            monkeypatch.delenv(var)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@dataclass
class WorkerRuns:
    """What ``dist_worker.py`` left: per-rank reports by phase, exit codes, logs, the folder."""

    out: Path
    exit: dict[str, Any]

    def rank(self, phase: str, rank: int) -> dict[str, Any]:
        path = self.out / f"{phase}-rank{rank}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def logs(self, phase: str) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in sorted(self.out.glob(f"{phase}-rank*.log")))

    def ok(self, phase: str, *keys: str, ranks: tuple[int, ...] = (0, 1)) -> None:
        for r in ranks:
            rep = self.rank(phase, r)
            for key in keys:
                assert rep.get(key) == "ok", (
                    f"{phase} rank {r} {key}: {rep.get(key)}\n{rep.get('error', '')}\n"
                    f"{self.logs(phase)}"
                )


@pytest.fixture(scope="session")
def worker_runs(tmp_path_factory: pytest.TempPathFactory) -> WorkerRuns:
    """Every scenario of ``dist_worker.py``, run once: one interpreter that forks its processes."""
    out = tmp_path_factory.mktemp("dist")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STAGESAVE_ACCELERATE", "STAGESAVE_CRASH_AT"))
    }
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "dist_worker.py"), str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return WorkerRuns(out, json.loads((out / "exit.json").read_text()))
