"""A tiered store over two local folders: what happens when its upload queue is already closed
when a save commits locally (a ``close()`` of the store racing a save of its Checkpointer)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import stagesave
from stagesave import TieredStore


def test_a_local_commit_after_the_upload_queue_closed_stands_and_says_so(
        tmp_path: Path, capfd) -> None:
    """Review finding: a file save failed with ClosedError although its local copy was
    committed (a folder's commit already reported it and stood). The queue is stopped the way
    ``close()`` stops it, between two saves (the race itself cannot be timed from outside)."""
    tel: list[stagesave.SaveTelemetry] = []
    store = TieredStore(str(tmp_path / "local"), str(tmp_path / "remote"))
    try:
        with stagesave.Checkpointer(store, writer="thread", telemetry_callback=tel.append) as ck:
            ck.save({"w": torch.ones(3)}, "a.ckpt").result(60)
            store.wait_uploads(timeout=60)
            store._uploads.stop()  # as close() does first
            done = ck.save({"w": torch.full((3,), 2.0)}, "b.ckpt").result(60)
            assert done.error is None
            assert torch.equal(ck.load("b.ckpt")["w"], torch.full((3,), 2.0))
    finally:
        store.close()
    assert "uploading" in capfd.readouterr().err
    failed = [t for t in tel if t.tier == "remote" and t.error]
    assert len(failed) == 1 and "was not queued" in failed[0].error
    assert "the local checkpoint is committed" in failed[0].error
    assert os.listdir(tmp_path / "remote") == ["a.ckpt"]
