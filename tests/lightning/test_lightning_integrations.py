"""The plugin with the rest of Lightning: loggers (telemetry callback), Fabric, LightningCLI."""

from __future__ import annotations

import csv
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning_helpers import StepBatches, TinyModel, assert_bitwise_equal, make_trainer, weights
from stagesave.lightning import CheckpointTelemetryLogger, StagedCheckpointIO, wait

import stagesave


def test_telemetry_reaches_the_trainers_loggers(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="run", version=0)
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(
        tmp_path,
        [StagedCheckpointIO()],
        [mc, CheckpointTelemetryLogger()],
        max_steps=6,
        logger=logger,
    )
    trainer.fit(TinyModel(), StepBatches())
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("checkpoint/blocking_s")]
    assert len(rows) == 3  # one per save: steps 2, 4, 6 (the last logged after the final flush)
    size = (tmp_path / "ckpt" / "epoch=0-step=2.ckpt").stat().st_size  # the proof inside included
    assert float(rows[0]["checkpoint/bytes"]) == size
    for r in rows:
        assert float(r["checkpoint/failed"]) == 0.0
        assert 0 < float(r["checkpoint/blocking_s"]) <= float(r["checkpoint/time_to_commit_s"])
        assert float(r["checkpoint/throughput_MBps"]) > 0


def test_telemetry_logger_without_the_plugin_warns(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [], [CheckpointTelemetryLogger()], max_steps=1)
    with pytest.warns(UserWarning, match="no StagedCheckpointIO plugin"):
        trainer.fit(TinyModel(), StepBatches())


def _fabric_parts(fabric: Fabric) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    for x, y in StepBatches(n=3):
        opt.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
    return model, opt


def test_fabric_save_wait_load(tmp_path: Path) -> None:
    before = set(threading.enumerate())  # other tests' checkpointers may still be closing
    io = StagedCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, opt = _fabric_parts(fabric)
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 3, "rng": np.random.get_state()})
    wait(fabric)  # Fabric never calls teardown: the explicit flush
    assert torch.load(path, weights_only=False)["step"] == 3  # a plain torch file
    assert stagesave.verify(str(path)).status == "verified"

    io2 = StagedCheckpointIO()
    fabric2 = Fabric(accelerator="cpu", devices=1, plugins=[io2])
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    model2, opt2 = fabric2.setup(model2, opt2)
    rest = fabric2.load(path, {"model": model2, "optimizer": opt2})
    assert rest["step"] == 3 and rest["rng"][0] == "MT19937"
    assert_bitwise_equal(weights(model2), weights(model))
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    io.teardown()
    io2.teardown()
    assert not [
        t for t in threading.enumerate() if t.name.startswith("stagesave") and t not in before
    ]


def test_fabric_load_waits_for_its_own_pending_save(tmp_path: Path) -> None:
    io = StagedCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, _ = _fabric_parts(fabric)
    path = tmp_path / "fabric.ckpt"
    for step in range(5):  # overwrite the same path; the load must see the last save
        fabric.save(path, {"model": model, "step": step})
    assert fabric.load(path)["step"] == 4
    io.teardown()


class CLIModel(TinyModel):
    def train_dataloader(self) -> Any:
        return StepBatches()


CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 4
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  plugins:
    - class_path: stagesave.lightning.StagedCheckpointIO
      init_args:
        max_pending: 1
        checksum: sha256
        teardown_timeout: 30
        safe_globals: [argparse.Namespace]
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {root}/ckpt
        every_n_train_steps: 2
        save_last: link
    - class_path: stagesave.lightning.CheckpointTelemetryLogger
model:
  hidden: 16
"""


def test_lightning_cli_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(root=tmp_path))
    cli = LightningCLI(CLIModel, args=["--config", str(cfg)], run=False, save_config_callback=None)
    io = cli.trainer.strategy.checkpoint_io
    assert isinstance(io, StagedCheckpointIO)
    assert (io.max_pending, io.checksum, io.teardown_timeout) == (1, "sha256", 30)
    cli.trainer.fit(cli.model)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_symlink()
    info = stagesave.verify(str(last))  # a link inside the root verifies as its target
    assert info.status == "verified" and info.manifest is not None
    assert info.manifest.files[0].algorithm == "sha256"
    assert torch.load(last, weights_only=True)["hyper_parameters"]["hidden"] == 16
