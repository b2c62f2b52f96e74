"""SIGTERM in a Fabric loop: with ``stagesave.flush_on_sigterm`` pending saves commit first."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import torch
from lightning_helpers import HERE, run_python

import stagesave


def test_fabric_sigterm_commits_pending_saves_then_terminates(tmp_path: Path) -> None:
    proc = run_python([str(HERE / "_child_fabric_sigterm.py"), str(tmp_path)])
    out = proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGTERM, out[-3000:]  # it still dies of the signal
    pending = int(re.search(r"pending at SIGTERM: (\d+)", out).group(1))  # type: ignore[union-attr]
    assert pending >= 2  # the slow writes were still queued when the signal came
    names = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert names == [f"step={s}.ckpt" for s in range(5)]
    for name in names:
        assert stagesave.verify(str(tmp_path / name)).status == "verified"
    assert torch.load(tmp_path / "step=4.ckpt", weights_only=True)["step"] == 4
    assert not [p for p in tmp_path.iterdir() if stagesave.is_temporary(p.name)]
