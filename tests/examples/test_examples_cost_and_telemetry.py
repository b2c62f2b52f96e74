"""What the demo shows besides crash and resume: each save's telemetry, read back by the real
``stagesave report``, and the checkpoint-cost comparison, in a tiny configuration.

The comparison's figures are timings on a shared machine: these tests check that the table is
there, parses and holds positive times for both IOs, never how fast either IO is. Both tests are
mostly process start-ups (Lightning's import), so the comparison starts in the background when
the module's tests start and runs alongside the example's.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
PYTHON = sys.executable
TINY_LM = [
    "--max-steps",
    "6",
    "--every",
    "2",
    "--batch-size",
    "4",
    "--seq-len",
    "16",
    "--d-model",
    "16",
    "--layers",
    "1",
    "--sample",
    "0",
]
TINY_COST = [
    "--rounds",
    "1",
    "--state-gib",
    "0.002",
    "--layers",
    "2",
    "--saves",
    "2",
    "--every",
    "2",
    "--batch-size",
    "2",
]
ROWS = {
    "torch": "TorchCheckpointIO (Lightning's default)",
    "stagesave": "StagedCheckpointIO (stagesave)",
}
SECONDS = r"(-?\d+\.\d+) s"


@pytest.fixture(scope="module", autouse=True)
def cost_comparison(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """The tiny comparison, started before the first test of this module and reaped after."""
    out = tmp_path_factory.mktemp("cost") / "ckpt"
    proc = subprocess.Popen(
        [PYTHON, str(EXAMPLES / "compare_checkpoint_cost.py"), "--dir", str(out), *TINY_COST],
        cwd=out.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, *args], cwd=cwd, capture_output=True, text=True, timeout=180, check=False
    )


def _fail(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout[-3000:] + proc.stderr[-3000:]


def test_example_telemetry_spans_the_crash_and_stagesave_report_reads_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    example = str(EXAMPLES / "lightning_finetune.py")
    longer = [*TINY_LM, "--max-steps", "8"]  # the last value of an option counts
    crashed = _run([example, "--dir", str(run), *longer, "--crash-after-step", "6"], tmp_path)
    assert crashed.returncode == -signal.SIGKILL, _fail(crashed)
    telemetry = run / "stagesave-telemetry.jsonl"
    before = len(telemetry.read_text().splitlines())
    # Step 2's checkpoint and its last.ckpt had four training steps to commit before the kill
    # (with the crash at step 4 they had two, which a loaded machine did not always give them).
    assert before >= 2

    resumed = _run([example, "--dir", str(run), *longer], tmp_path)
    assert resumed.returncode == 0, _fail(resumed)
    assert f"stagesave report {run}" in resumed.stdout
    lines = [json.loads(line) for line in telemetry.read_text().splitlines()]
    assert len(lines) > before  # the resumed run appended its own saves
    assert all(d["committed_at"] and not d["error"] and d["blocking_s"] > 0 for d in lines)

    png = tmp_path / "timeline.png"
    report = subprocess.run(
        [PYTHON, "-m", "stagesave", "report", str(run), "--json", "--png", str(png)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert report.returncode == 0, _fail(report)
    summary = json.loads(report.stdout)
    assert summary["saves"] == len(lines) and summary["failed"] == 0
    assert summary["source"] == str(telemetry)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(stdout: str, label: str) -> list[float]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith(label))
    return [float(x) for x in re.findall(SECONDS, line)] + [
        float(re.findall(r"(\d+\.\d+) GiB$", line)[0])
    ]


def test_cost_comparison_prints_a_table_of_both_ios(
    cost_comparison: tuple[subprocess.Popen[str], Path],
) -> None:
    popen, out = cost_comparison
    stdout, stderr = popen.communicate(timeout=180)
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
    assert proc.returncode == 0, _fail(proc)
    assert not out.exists()  # the checkpoints are removed at the end

    header = next(ln for ln in proc.stdout.splitlines() if ln.startswith("checkpointing"))
    assert header.split()[1:] == [
        "blocked/save",
        "lost/save",
        "total",
        "lost",
        "fit",
        "peak",
        "RSS",
    ]
    fit, rss = _row(proc.stdout, "no checkpoints")
    assert fit > 0 and rss > 0
    for kind, label in ROWS.items():
        blocked, per_save, total, fit, rss = _row(proc.stdout, label)
        assert blocked > 0 and fit > 0 and rss > 0, kind
        # lost = fit - baseline: a difference of timings, which noise may push below zero
        assert abs(per_save * 2 - total) < 0.02, kind
    assert re.search(r"^ratio: ", proc.stdout, re.MULTILINE)
    assert "same final weights in every run: yes" in proc.stdout

    result: dict[str, Any] = json.loads(proc.stdout.split("result: ", 1)[1])
    assert result["saves"] == 2 and len(result["baseline_fit_s"]) == 2
    for kind in ROWS:
        row = result["rows"][kind]
        assert row["saves"] == 2 and row["blocking_per_save_s"] > 0
