"""Checkpoints on S3 (a real SeaweedFS on loopback): save, top-k removal, and the one-call
resume that Lightning's own ``ckpt_path="last"`` cannot do for ``s3://`` directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import StepBatches, TinyModel, make_trainer
from stagesave.lightning import StagedCheckpointIO, latest

import stagesave

pytestmark = pytest.mark.s3


@pytest.fixture
def lightning_s3_env(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelCheckpoint lists and checks its s3:// dirpath with plain fsspec (no options), so
    it finds the server through the standard AWS variables; the plugin gets its options."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def test_s3_dirpath_save_remove_and_resume_with_latest(
    tmp_path: Path, s3_url: str, s3_options: dict[str, Any], lightning_s3_env: None
) -> None:
    mc = ModelCheckpoint(dirpath=s3_url, every_n_train_steps=2, save_top_k=1, save_last=True)
    io = StagedCheckpointIO(storage_options=s3_options)
    make_trainer(tmp_path, [io], [mc], max_steps=4).fit(TinyModel(), StepBatches())
    names = sorted(c.name for c in stagesave.list_checkpoints(s3_url, storage_options=s3_options))
    assert names == ["epoch=0-step=4.ckpt", "last.ckpt"]  # step 2 removed after step 4 committed

    resume = latest(s3_url, storage_options=s3_options)
    assert resume is not None and resume.startswith("s3://")
    trainer = make_trainer(tmp_path, [StagedCheckpointIO(storage_options=s3_options)], max_steps=6)
    trainer.fit(TinyModel(), StepBatches(), ckpt_path=resume)
    assert trainer.global_step == 6


def test_s3_latest_skips_a_torn_object(
    s3_url: str, s3_options: dict[str, Any], s3_server: Any
) -> None:
    io = StagedCheckpointIO(storage_options=s3_options)
    for step in (1, 2):
        io.save_checkpoint({"global_step": step, "pad": b"x" * 4096}, f"{s3_url}/step={step}.ckpt")
        io.wait()
    io.teardown()
    bucket, _, prefix = s3_url[len("s3://"):].partition("/")
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/step=2.ckpt", Body=b"torn")
    with pytest.warns(UserWarning, match=r"step=2\.ckpt"):
        assert latest(s3_url, storage_options=s3_options) == f"{s3_url}/step=1.ckpt"
