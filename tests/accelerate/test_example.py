"""examples/accelerate_finetune.py under ``accelerate launch`` (1 and 2 CPU processes): a real
SIGKILL right after an asynchronous save_state() returned, then an automatic resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_multiprocess import launch_args

import stagesave

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "accelerate_finetune.py")
ARGS = ["--steps", "12", "--save-every", "4", "--total-limit", "2"]


def _run(cmd: list[str], out: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*cmd, EXAMPLE, "--output", out, *ARGS, *extra], env=env, check=False,
                          capture_output=True, text=True, timeout=300)


def _crash_then_resume(tmp_path, n: int) -> tuple[dict, str]:
    out = str(tmp_path / f"run{n}")
    crashed = _run(launch_args(n), out, "--crash-after-step", "10")
    assert crashed.returncode != 0 and "simulated crash: SIGKILL after step 10" in crashed.stdout, crashed.stderr[-3000:]
    root = os.path.join(out, "checkpoints")
    # Saves of steps 4 and 8 were submitted; each is there only if it committed before the kill
    # (the background may lag on a busy machine), never half-written, and nothing else is there
    # (unfinished saves are assembled in <output>/.stagesave-staging).
    committed = sorted(os.listdir(root))
    assert committed in ([], ["checkpoint_0"], ["checkpoint_0", "checkpoint_1"]), committed
    resumed = _run(launch_args(n), out)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    if committed:
        k = len(committed) - 1
        assert f"resumed at step {4 * (k + 1)} (next checkpoint: checkpoint_{k + 1})" in resumed.stdout
    else:
        assert "resumed at" not in resumed.stdout
    final = sorted(os.listdir(root))
    assert final == ["checkpoint_1", "checkpoint_2"]
    for name in final:
        assert stagesave.verify(os.path.join(root, name)).status == "verified"
    with open(os.path.join(out, "result.json"), encoding="utf-8") as f:
        return json.load(f), resumed.stdout


def test_one_process_crash_and_resume_ends_with_the_uninterrupted_weights(tmp_path):
    reference = _run([sys.executable], str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    with open(tmp_path / "reference" / "result.json", encoding="utf-8") as f:
        expected = json.load(f)
    result, _ = _crash_then_resume(tmp_path, 1)
    assert result == expected  # same step, loss and SHA-256 of every weight


def test_two_processes_crash_and_resume(tmp_path):
    result, stdout = _crash_then_resume(tmp_path, 2)
    assert result["processes"] == 2 and result["step"] == 12
    assert "save_state -> " in stdout
