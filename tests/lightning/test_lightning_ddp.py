"""DDP with two processes on the CPU (gloo): only rank 0 writes, every rank loads."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_helpers import HERE, run_python

import stagesave


def test_ddp_two_processes_save_on_rank_zero_and_resume_on_both(tmp_path: Path) -> None:
    proc = run_python([str(HERE / "_child_ddp.py"), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    # Lightning asks only global rank 0 to write: saves at steps 2, 4, 6, each also as last.ckpt.
    assert len(r0["saves"]) == 6 and r1["saves"] == []
    for path in {p for p in r0["saves"] if Path(p).exists()}:
        assert stagesave.verify(path).status == "verified"
    # Both ranks found the same newest checkpoint (rank 0's flush and a barrier came first, so
    # rank 1 could not see an older one) and restored the same weights from it.
    assert r0["resume"] == r1["resume"] and Path(r0["resume"]).parent == tmp_path / "ckpt"
    assert r0["start_step"] == r1["start_step"] == 6
    assert r0["end_step"] == r1["end_step"] == 8
    assert r0["fingerprint"] == r1["fingerprint"]
    # Top-1 plus last: rank 0's removals of older checkpoints ran after its saves.
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")) == [
        "epoch=0-step=8.ckpt",
        "last.ckpt",
    ]
