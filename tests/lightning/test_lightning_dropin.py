"""The framework cannot tell the difference: a checkpoint is there whenever Lightning or the user
reads it outside the fit loop, any stagesave entry point of the process sees any instance's
pending saves, and a finished run leaves no thread or buffer behind.

Real Trainers, real files; the only slowing-down is the writer gate (a slow telemetry consumer).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import HERE, StepBatches, TinyModel, WriterGate, make_trainer
from stagesave.lightning import StagedCheckpointIO

import stagesave


def _stagesave_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("stagesave")]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- saves outside the fit loop
def test_a_save_after_fit_is_there_for_every_reader(tmp_path: Path) -> None:
    trainer = make_trainer(
        tmp_path, [StagedCheckpointIO()], max_steps=3, enable_checkpointing=False
    )
    model = TinyModel()
    trainer.fit(model, StepBatches())
    final = tmp_path / "final.ckpt"
    trainer.save_checkpoint(final)
    # Read at once, behind the plugin's back, by torch, by Lightning and by a fresh plugin.
    raw = torch.load(final, weights_only=True)
    assert raw["global_step"] == 3
    assert _same(raw["state_dict"], model.state_dict())
    assert _same(TinyModel.load_from_checkpoint(final).state_dict(), model.state_dict())
    validated = make_trainer(tmp_path, [StagedCheckpointIO()])
    assert validated.validate(TinyModel(), StepBatches(n=2), ckpt_path=final, verbose=False)
    resumed = make_trainer(
        tmp_path, [StagedCheckpointIO()], max_steps=5, enable_checkpointing=False
    )
    resumed.fit(TinyModel(), StepBatches(), ckpt_path=final)
    assert resumed.global_step == 5
    assert stagesave.verify(str(final)).status == "verified"
    assert _stagesave_threads() == []


def test_saves_from_validate_and_test_return_committed(tmp_path: Path) -> None:
    seen: dict[str, bool] = {}

    class SavesInEveryStage(Callback):
        def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
            if trainer.state.fn == "validate":
                path = tmp_path / "validate.ckpt"
                trainer.save_checkpoint(path)
                seen["validate"] = path.exists()

        def on_test_end(self, trainer: Trainer, pl_module: Any) -> None:
            path = tmp_path / "test.ckpt"
            trainer.save_checkpoint(path)
            seen["test"] = path.exists()

    class Tested(TinyModel):
        def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
            self.validation_step(batch, batch_idx)

    trainer = make_trainer(
        tmp_path, [StagedCheckpointIO()], [SavesInEveryStage()], enable_checkpointing=False
    )
    model = Tested()
    trainer.validate(model, StepBatches(n=2), verbose=False)
    trainer.test(model, StepBatches(n=2), verbose=False)
    assert seen == {"validate": True, "test": True}
    assert _stagesave_threads() == []


def test_saves_inside_fit_stay_asynchronous(tmp_path: Path, gate: WriterGate) -> None:
    seen: dict[str, bool] = {}

    class Probe(Callback):
        def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
            trainer.save_checkpoint(tmp_path / "a.ckpt")
            assert gate.entered.wait(30)  # the writer is held after committing a.ckpt
            trainer.save_checkpoint(tmp_path / "b.ckpt")  # returns with b.ckpt still pending
            seen["b pending"] = not (tmp_path / "b.ckpt").exists()
            gate.open()

    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=4)
    make_trainer(tmp_path, [io], [Probe()], max_steps=2, enable_checkpointing=False).fit(
        TinyModel(), StepBatches()
    )
    assert seen == {"b pending": True}
    # teardown flushed it
    assert torch.load(tmp_path / "b.ckpt", weights_only=True)["global_step"] == 2


# ---------------------------------------------------------------- the process-wide view
def test_another_instance_waits_for_a_pending_save(tmp_path: Path, gate: WriterGate) -> None:
    seen: dict[str, Any] = {}

    class ReadsThroughOthers(Callback):
        def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
            trainer.save_checkpoint(tmp_path / "a.ckpt")
            assert gate.entered.wait(30)
            trainer.save_checkpoint(tmp_path / "b.ckpt")
            assert not (tmp_path / "b.ckpt").exists()
            threading.Timer(0.3, gate.open).start()
            # Neither of these instances made the save; both wait for it.
            other = StagedCheckpointIO().load_checkpoint(tmp_path / "b.ckpt")
            seen["other plugin"] = other["global_step"]
            gate.close()
            trainer.save_checkpoint(tmp_path / "c.ckpt")
            threading.Timer(0.3, gate.open).start()
            latest = stagesave.latest(str(tmp_path))
            seen["latest"] = None if latest is None else Path(latest.path).name
            seen["load"] = stagesave.load(str(tmp_path / "c.ckpt"))["global_step"]

    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=4)
    make_trainer(
        tmp_path, [io], [ReadsThroughOthers()], max_steps=2, enable_checkpointing=False
    ).fit(TinyModel(), StepBatches())
    assert seen == {"other plugin": 2, "latest": "c.ckpt", "load": 2}


def test_model_checkpoint_versions_names_of_pending_saves(tmp_path: Path, gate: WriterGate) -> None:
    # ModelCheckpoint asks whether "test.ckpt" exists to choose "test-v1.ckpt": a pending save
    # counts.
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="test", monitor="epoch", save_top_k=-1)
    gate.hold_after = 1
    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=8)

    class OpenAtEnd(Callback):
        def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
            gate.open()

    trainer = make_trainer(tmp_path, [io], [mc, OpenAtEnd()], max_epochs=3, limit_train_batches=1)
    trainer.fit(TinyModel(), StepBatches())
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["test-v1.ckpt", "test-v2.ckpt", "test.ckpt"]
    assert [torch.load(tmp_path / "ckpt" / n, weights_only=True)["epoch"]
            for n in ("test.ckpt", "test-v1.ckpt", "test-v2.ckpt")] == [0, 1, 2]


# ---------------------------------------------------------------- a replaced torch.save
def test_a_replaced_torch_save_is_honoured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []
    genuine = torch.serialization.save

    def counting_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(type(obj).__name__)
        genuine(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counting_save)
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    with caplog.at_level(logging.WARNING, logger="stagesave.lightning"):
        make_trainer(tmp_path, [StagedCheckpointIO()], [mc], max_steps=3).fit(
            TinyModel(), StepBatches()
        )
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
    assert calls == ["dict"] * 3  # every checkpoint went through the replacement, once
    steps = [torch.load(tmp_path / "ckpt" / n, weights_only=True)["global_step"] for n in names]
    assert steps == [1, 2, 3]
    assert "torch.save is replaced" in caplog.text


# ---------------------------------------------------------------- resources follow the run
def test_a_hundred_trainers_leave_no_threads_and_flat_memory(tmp_path: Path) -> None:
    # In a child process of its own (RSS of this one holds every earlier test), with a fixed
    # malloc mmap threshold so that freed buffers leave RSS (many_trainers.py).
    out = subprocess.run(
        [sys.executable, str(HERE / "many_trainers.py"), "--runs", "100", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["threads"] == [0] * 100  # live stagesave threads after each trainer
    grown = max(got["rss"]) - got["rss"][0]
    # Before each trainer kept two staging buffers (2 x 48 MiB): several GiB over 100 trainers.
    assert grown <= got["state_bytes"], (
        f"RSS grew {grown / 2**20:.0f} MiB over 100 trainers: {[r // 2**20 for r in got['rss']]}")
    assert torch.load(tmp_path / "run1" / "final.ckpt", weights_only=True)["global_step"] == 2
