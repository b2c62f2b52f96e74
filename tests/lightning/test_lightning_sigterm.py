"""SIGTERM (a preemption notice) while saves are pending: they are committed before exit."""

from __future__ import annotations

from pathlib import Path

from lightning_helpers import HERE, run_python

import stagesave


def test_sigterm_flushes_pending_saves_before_exit(tmp_path: Path) -> None:
    proc = run_python([str(HERE / "_child_sigterm.py"), str(tmp_path)])
    out = proc.stdout + proc.stderr
    assert "sending SIGTERM" in out, out[-3000:]
    assert "fit returned" not in out  # Lightning ended training with SIGTERMException
    assert "stagesave: waiting for" in out  # the flush said what it was doing
    d = tmp_path / "ckpt"
    names = sorted(p.name for p in d.glob("*.ckpt"))
    # The signal came before step 5; Lightning finished that batch (saving it) and stopped.
    # Every submitted checkpoint, most still queued behind slow writes, is committed and intact.
    assert names == [f"epoch=0-step={s}.ckpt" for s in (1, 2, 3, 4, 5)]
    for n in names:
        assert stagesave.verify(str(d / n)).status == "verified"
    assert not [p for p in d.iterdir() if stagesave.is_temporary(p.name)]
