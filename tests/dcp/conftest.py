"""Fixtures of the sharded-checkpoint tests: real multi-process runs (gloo on CPU)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


from dcp_run import Run  # noqa: E402, RUF100 - after the sys.path insertion above

Launcher = Callable[..., Run]


@pytest.fixture(scope="session")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """``launcher(scenario, world, out, **env)``: run ``dcp_worker.py`` scenarios.

    One launcher process per session imports torch once and forks the ranks of every scenario.
    """
    log = open(tmp_path_factory.mktemp("launcher") / "launcher.log", "w")  # noqa: SIM115 - lives for the session
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "dcp_worker.py"), "serve"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdin is not None and proc.stdout is not None

    def run(scenario: str, world: int, out: Path, **env: str) -> Run:
        out.mkdir(parents=True, exist_ok=True)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(
            json.dumps({"scenario": scenario, "world": world, "out": str(out), "env": env}) + "\n"
        )
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready, f"{scenario}: the launcher did not answer within 300 s"
        answer = json.loads(proc.stdout.readline() or '{"error": "the launcher exited"}')
        assert "error" not in answer, answer["error"]
        ranks = []
        for r in range(world):
            p = out / f"{scenario}-rank{r}.json"
            ranks.append(json.loads(p.read_text()) if p.exists() else None)
        return Run(out, ranks, answer["exit_codes"], scenario)

    yield run
    proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture(scope="session")
def fsdp_saved(launcher: Launcher, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """FSDP2 model + Adam trained and saved sharded by 4 ranks; replicated state saved twice."""
    run = launcher("fsdp_save", 4, tmp_path_factory.mktemp("fsdp4"))
    run.ok()
    return run


@pytest.fixture
def writers(tmp_path: Path) -> Iterator[list[Any]]:
    """Two sharded writers in their own folders (a steady one and a fresh one to compare)."""
    import stagesave.dcp as sdcp  # noqa: PLC0415, RUF100 - after the sys.path insertion

    made = [sdcp.StagedStorageWriter(root=tmp_path / f"w{i}", commit_timeout=60) for i in range(2)]
    yield made
    for w in made:
        w.close()
