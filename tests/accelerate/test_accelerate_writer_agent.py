"""``writer="process"`` under a real ``Accelerator`` SIGKILLed right after ``save_state``
returned (issue 21).

The child (``_child_accel_agent.py``) trains with automatic checkpoint naming and kills itself
the moment its N-th ``save_state`` returns, while the agent is still writing the folder. Every
folder whose save returned (and that ``total_limit`` keeps) must be committed and verify, hold
what the child had, ``latest()`` must be the newest, the agent must exit on its own and leave
nothing in shared memory (folder checkpoints keep no snapshot), and a fresh Accelerator must
resume from the newest folder bitwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import stagesave.accelerate as sa
import torch
from _child_accel_agent import MARKER, Marker
from accel_helpers import assert_same, build, snapshot, visible
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from agentwatch import assert_only_snapshot_of, exited

import stagesave

HERE = Path(__file__).resolve().parent
CHILD = HERE / "_child_accel_agent.py"


def _run_child(project: Path, shm: Path, kill_after: int, choice: str,
               total_limit: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STAGESAVE_ACCELERATE", "STAGESAVE_CRASH_AT", "STAGESAVE_AGENT"))}
    env.update(STAGESAVE_SHM_DIR=str(shm), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]))
    if choice == "environment":
        env["STAGESAVE_ACCELERATE_WRITER"] = "process"
    return subprocess.run(
        [sys.executable, str(CHILD), str(project), str(kill_after), choice, str(total_limit)],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )


@pytest.mark.parametrize(
    ("kill_after", "choice", "total_limit"),
    [(1, "argument", 0), (3, "environment", 0), (4, "argument", 2)],
)
def test_accelerator_sigkilled_after_save_state_returned_every_returned_save_is_committed(
    tmp_path: Path, shm: Path, kill_after: int, choice: str, total_limit: int
) -> None:
    project = tmp_path / "project"
    proc = _run_child(project, shm, kill_after, choice, total_limit)
    out = proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    saved = [line.split(" ", 3) for line in proc.stdout.splitlines() if line.startswith("SAVED ")]
    assert [int(s[1]) for s in saved] == list(range(kill_after)), out[-3000:]
    agents = {s[2] for s in saved}
    assert len(agents) == 1 and agents != {"None"}, agents  # one agent served the whole run
    agent = int(agents.pop())
    root = project / "checkpoints"
    folders = [s[3] for s in saved]
    assert folders == [str(root / f"checkpoint_{i}") for i in range(kill_after)]

    assert exited(agent), f"the writer agent {agent} did not exit after its trainer died"
    assert_only_snapshot_of(shm, None)  # folders keep no snapshot; every segment is removed

    # every returned save that total_limit keeps, and nothing else (no temporary either)
    kept = folders[-total_limit:] if total_limit else folders
    assert sorted(os.listdir(root)) == sorted(Path(f).name for f in kept)
    with stagesave.Checkpointer() as ck:
        for folder in kept:
            info = ck.verify(folder)
            assert info.status == "verified", (folder, info.status, info.problems)
            index = int(folder.rpartition("_")[2])
            mark = torch.load(Path(folder) / "custom_checkpoint_2.pkl", weights_only=True)
            assert mark["index"] == index
            assert torch.equal(mark["fill"], torch.full((MARKER,), float(index)))
        best = ck.latest(root)
        assert best is not None and best.path == folders[-1]

    # a fresh Accelerator resumes from the newest folder: everything the child had, bitwise
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True,
        total_limit=total_limit or None))
    run = build(acc, width=512, seed=123)
    marker = Marker()
    acc.register_for_checkpointing(marker)
    sa.enable(acc)
    acc.load_state()
    last = kill_after - 1
    want = torch.load(project / "expected" / f"checkpoint_{last}.pt", weights_only=False)
    assert_same(want, snapshot(acc, run))
    assert marker.index == last and torch.equal(marker.fill, torch.full((MARKER,), float(last)))
    assert acc.project_configuration.iteration == kill_after
    sa.disable(acc)
    assert visible(str(root)) == sorted(Path(f).name for f in kept)
