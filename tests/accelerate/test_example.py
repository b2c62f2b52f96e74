"""examples/accelerate_finetune.py: a real SIGKILL right after an asynchronous save_state()
returned, then an automatic resume. In one process the runs are forked by ``dist_worker.py``; with
2 CPU processes the example runs under ``accelerate launch``, through the no-code runner
``-m stagesave.accelerate`` and configured by environment, and ends through normal interpreter
shutdown (no ``os._exit``). Every run records the telemetry ``stagesave report`` reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dist_worker import EXAMPLE, EXAMPLE_ARGS

import stagesave
from stagesave.cli import main as stagesave_cli

#: ``accelerate launch`` with 2 CPU processes: ``--multi_gpu`` makes it start torchrun, and
#: without GPUs the script's Accelerator then runs MULTI_CPU over gloo.
LAUNCH_2 = [
    os.path.join(os.path.dirname(sys.executable), "accelerate"),
    "launch",
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
    "--main_process_port",
    "0",
    "-m",
    "stagesave.accelerate",
]


def _launch(out: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STAGESAVE_ACCELERATE_MAX_PENDING": "1"}
    return subprocess.run(
        [*LAUNCH_2, EXAMPLE, "--output", out, *EXAMPLE_ARGS, *extra],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _split(names: list[str]) -> tuple[list[str], list[str]]:
    """(checkpoint folders, stagesave temporaries) of a listing; anything else fails the test."""
    temporaries = [n for n in names if stagesave.is_temporary(n)]
    assert all(n.startswith(".checkpoint_") for n in temporaries), names
    return [n for n in names if n not in temporaries], temporaries


def _check_telemetry(out: str, saves: int) -> None:
    """``<output>/stagesave-telemetry.jsonl`` has a line per committed save, and `stagesave
    report` reads it."""
    with open(os.path.join(out, "stagesave-telemetry.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == saves and all(r["error"] is None and r["blocking_s"] > 0 for r in lines), (
        lines
    )
    assert [os.path.basename(r["path"]) for r in lines] == [f"checkpoint_{i}" for i in range(saves)]
    assert stagesave_cli(["report", out, "--no-png", "--json"]) == 0


def _check_kill_and_resume(
    left: list[str], out: str, resumed_stdout: str, resumed_code: int,
    every_returned_save: bool = False,
) -> None:
    # Saves of steps 4 and 8 were submitted; each is there only if it committed before the kill
    # (the background may lag on a busy machine), never half-written; an unfinished one left its
    # temporary beside it (a dot-name that stagesave's listing and load_state never take).
    # ``every_returned_save``: ``left`` was listed once the killed run's writer agents (the
    # default writer) exited, and they commit every save that returned before the kill.
    committed, _ = _split(left)
    assert committed in ([], ["checkpoint_0"], ["checkpoint_0", "checkpoint_1"]), left
    if every_returned_save:
        assert committed == ["checkpoint_0", "checkpoint_1"], left
    assert resumed_code == 0, resumed_stdout[-3000:]
    if committed:
        k = len(committed) - 1
        assert (
            f"resumed at step {4 * (k + 1)} (next checkpoint: checkpoint_{k + 1})" in resumed_stdout
        )
    else:
        assert "resumed at" not in resumed_stdout
    root = os.path.join(out, "checkpoints")
    final, _ = _split(sorted(os.listdir(root)))
    assert final == ["checkpoint_1", "checkpoint_2"]
    # nothing of stagesave's in the project folder but the telemetry it was asked for
    assert sorted(os.listdir(out)) == ["checkpoints", "result.json", "stagesave-telemetry.jsonl"]
    for name in final:
        assert stagesave.verify(os.path.join(root, name)).status == "verified"


def test_one_process_crash_and_resume_ends_with_the_uninterrupted_weights(worker_runs):
    # dist_worker.py ran the example three times in forked processes: uninterrupted, killed,
    # resumed.
    out, codes = worker_runs.out, worker_runs.exit
    logs = {
        n: (out / f"{n}.log").read_text(errors="replace")
        for n in ("example-reference", "example-crash", "example-resume")
    }
    assert codes["example-reference"] == 0, logs["example-reference"][-3000:]
    assert (
        codes["example-crash"] == -9
        and "simulated crash: SIGKILL after step 10" in logs["example-crash"]
    )
    _check_kill_and_resume(
        codes["example-crash-left"],
        str(out / "run1"),
        logs["example-resume"],
        codes["example-resume"],
        every_returned_save=True,
    )
    with open(out / "reference" / "result.json", encoding="utf-8") as f:
        expected = json.load(f)
    with open(out / "run1" / "result.json", encoding="utf-8") as f:
        assert json.load(f) == expected  # same step, loss and SHA-256 of every weight
    _check_telemetry(str(out / "reference"), saves=3)


def test_two_processes_crash_then_resume_under_accelerate_launch(worker_runs):
    # dist_worker.py ran the example on 2 forked ranks and both were killed after step 10.
    out, codes = worker_runs.out, worker_runs.exit
    assert codes["example2_crash"] == [-9, -9], worker_runs.logs("example2_crash")
    assert "simulated crash: SIGKILL after step 10" in worker_runs.logs("example2_crash")
    resumed = _launch(str(out / "run2"))
    _check_kill_and_resume(
        codes["example2_crash-left"],
        str(out / "run2"),
        resumed.stdout + resumed.stderr[-3000:],
        resumed.returncode,
    )
    with open(out / "run2" / "result.json", encoding="utf-8") as f:
        result = json.load(f)
    assert result["processes"] == 2 and result["step"] == 12
    assert "save_state -> " in resumed.stdout
    assert f"timeline of the saves: stagesave report {out / 'run2'}" in resumed.stdout
