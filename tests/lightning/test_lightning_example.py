"""The example script, as the demo runs it: SIGKILL mid-run, rerun, bitwise the same weights."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning_helpers import REPO, run_python

EXAMPLE = str(REPO / "examples" / "lightning_finetune.py")
SMALL = ["--max-steps", "8", "--every", "3", "--batch-size", "4", "--seq-len", "16",
         "--d-model", "16", "--layers", "1", "--sample", "0"]


def _result(stdout: str) -> dict[str, Any]:
    line = [ln for ln in stdout.splitlines() if ln.startswith("result: ")][-1]
    return json.loads(line[len("result: "):])  # type: ignore[no-any-return]


def test_example_crash_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with ThreadPoolExecutor(2) as pool:  # the uninterrupted reference runs alongside
        reference = pool.submit(
            run_python, [EXAMPLE, "--dir", str(tmp_path / "straight"), *SMALL], cwd=tmp_path
        )
        crashed = run_python(
            [EXAMPLE, "--dir", str(run), *SMALL, "--crash-after-step", "6"], cwd=tmp_path
        )
        straight = reference.result()
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout[-2000:] + crashed.stderr[-2000:]
    assert "simulated crash: SIGKILL after step 6" in crashed.stdout

    resumed = run_python([EXAMPLE, "--dir", str(run), *SMALL], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    r = _result(resumed.stdout)
    # Step 6's save was in flight at the kill: it resumed from step 6 if that commit made it,
    # else from step 3; either way from a committed checkpoint, never from scratch.
    assert r["start"] is not None and r["final_step"] == 8
    assert "starting at step 6" in resumed.stdout or "starting at step 3" in resumed.stdout

    assert straight.returncode == 0, straight.stderr[-3000:]
    assert _result(straight.stdout)["weights_sha256"] == r["weights_sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "straight"]  # nothing else written
