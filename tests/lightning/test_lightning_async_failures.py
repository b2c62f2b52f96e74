"""Each known failure of Lightning's AsyncCheckpointIO, shown with it and shown absent with
StagedCheckpointIO, in the same scenario on a real Trainer.

The pending window is made the same way for both: AsyncCheckpointIO wraps Lightning's own
TorchCheckpointIO held on an event; the plugin's writer thread is held by a slow telemetry
consumer (``WriterGate``) after its first commit.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning_helpers import HeldCheckpointIO, StepBatches, TinyModel, WriterGate, make_trainer
from stagesave.lightning import StagedCheckpointIO

import stagesave


def _ckpt_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("*.ckpt"))


def _valid_on_disk(d: Path) -> list[str]:
    # What another process would see now: stagesave's own listing would wait for the pending saves.
    from stagesave.restore.discovery import scan
    from stagesave.stores.local import LocalStore

    return sorted(Path(c.path).name for c in scan(LocalStore(str(d))) if c.valid)


class Probe(Callback):
    """Records which checkpoints are valid on disk before each batch; releases the hold at the
    end."""

    def __init__(self, d: Path, release: Any, first_written: Any = None) -> None:
        self.d = d
        self.release = release
        self.first_written = first_written
        self.valid: list[list[str]] = []

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == 1 and self.first_written is not None:
            # The step-1 save has finished writing before step 2 saves and removes: otherwise
            # AsyncCheckpointIO's removal of step 1 may find nothing to remove yet (a slow write
            # under load), and the run shows the other of its two failures instead.
            assert self.first_written()
        if trainer.global_step >= 2:
            self.valid.append(_valid_on_disk(self.d))

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.release()


# ---------------------------------------------------------- top-k removal while saves are queued
def _topk_run(tmp_path: Path, io: Any, release: Any, first_written: Any) -> tuple[Probe, Path]:
    d = tmp_path / "ckpt"
    probe = Probe(d, release, first_written)
    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=1, save_top_k=1)
    make_trainer(tmp_path, [io], [mc, probe], max_steps=4).fit(TinyModel(), StepBatches())
    return probe, d


def test_topk_removal_with_async_checkpointio_loses_or_leaks_checkpoints(tmp_path: Path) -> None:
    held = HeldCheckpointIO(hold_after=1)
    def written() -> bool:
        _wait_until(lambda: "epoch=0-step=1.ckpt" in held.written)
        return True

    probe, d = _topk_run(tmp_path, AsyncCheckpointIO(held), held.release.set, written)
    # The removal of step 1 ran at once while step 2 was still queued: no checkpoint at all...
    assert [] in probe.valid
    # ...and removals of checkpoints not written yet did nothing, so top-1 keeps three files.
    assert _ckpt_files(d) == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt"]


def test_topk_removal_with_plugin_is_ordered_after_queued_saves(
    tmp_path: Path, gate: WriterGate
) -> None:
    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=8)
    probe, d = _topk_run(tmp_path, io, gate.open, lambda: gate.entered.wait(30))
    # While later saves were held, step 1 (the only committed checkpoint) was never removed.
    assert probe.valid and all(v == ["epoch=0-step=1.ckpt"] for v in probe.valid)
    assert _ckpt_files(d) == ["epoch=0-step=4.ckpt"]
    assert stagesave.verify(str(d / "epoch=0-step=4.ckpt")).status == "verified"


def test_plugin_keeps_the_checkpoint_whose_successor_failed(
    tmp_path: Path, gate: WriterGate, caplog: pytest.LogCaptureFixture
) -> None:
    # ModelCheckpoint's order: save the new best, then remove the previous one.
    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=8)
    good = tmp_path / "ckpt" / "step=1.ckpt"
    io.save_checkpoint({"w": torch.ones(8)}, good)
    assert gate.entered.wait(30)
    bad = tmp_path / "volume"
    io.save_checkpoint({"w": torch.zeros(8)}, bad / "step=2.ckpt")  # fails in the background
    io.remove_checkpoint(good)
    _break_directory(bad)
    with caplog.at_level(logging.WARNING, logger="stagesave.lightning"):
        gate.open()
        with pytest.raises(stagesave.CheckpointError, match=r"volume/step=2\.ckpt"):
            io.wait()
    assert stagesave.verify(str(good)).status == "verified"  # still the newest valid checkpoint
    assert any("kept" in r.getMessage() and "step=1.ckpt" in r.getMessage() for r in caplog.records)
    # Once a later save commits, removals go ahead again.
    io.save_checkpoint({"w": torch.full((8,), 3.0)}, tmp_path / "ckpt" / "step=3.ckpt")
    io.remove_checkpoint(good)
    io.wait()
    assert not good.exists()
    io.teardown()


# ---------------------------------------------------------------- mutable non-tensor leaves
def _numpy_run(tmp_path: Path, io: Any, release: Any) -> Path:
    d = tmp_path / "ckpt"
    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=1, save_top_k=-1)
    probe = Probe(d, release)
    make_trainer(tmp_path, [io], [mc, probe], max_steps=4).fit(
        TinyModel(numpy_state=True), StepBatches()
    )
    return d


def test_async_checkpointio_does_not_snapshot_numpy_leaves(tmp_path: Path) -> None:
    held = HeldCheckpointIO(hold_after=1)
    d = _numpy_run(tmp_path, AsyncCheckpointIO(held), held.release.set)
    ckpt = torch.load(d / "epoch=0-step=2.ckpt", weights_only=False)
    # Weights are from step 2, the numpy counter from step 4: one file mixes two steps.
    assert ckpt["global_step"] == 2
    assert ckpt["seen"].tolist() == [4, 4, 4, 4]


def test_plugin_snapshots_numpy_leaves_at_save_time(tmp_path: Path, gate: WriterGate) -> None:
    d = _numpy_run(tmp_path, StagedCheckpointIO(telemetry_callback=gate, max_pending=8), gate.open)
    for step in (1, 2, 3, 4):
        ckpt = torch.load(d / f"epoch=0-step={step}.ckpt", weights_only=False)
        assert ckpt["global_step"] == step
        assert ckpt["seen"].tolist() == [step] * 4


# ---------------------------------------------------------------- background failures
def _state(v: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((64,), v), "global_step": int(v)}


def _wait_until(cond: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_async_checkpointio_background_error_is_never_cleared(tmp_path: Path) -> None:
    held = HeldCheckpointIO(hold_after=0, fail_at=1)
    io = AsyncCheckpointIO(held)
    io.save_checkpoint(_state(1), tmp_path / "a.ckpt")
    held.release.set()
    _wait_until(lambda: io._error is not None)
    with pytest.raises(OSError, match="No space left") as first:
        io.save_checkpoint(_state(2), tmp_path / "b.ckpt")
    # Storage recovered, yet every later save and the teardown raise the same stale error.
    with pytest.raises(OSError) as again:
        io.save_checkpoint(_state(3), tmp_path / "c.ckpt")
    assert again.value is first.value
    with pytest.raises(OSError) as at_teardown:
        io.teardown()
    assert at_teardown.value is first.value


def _break_directory(d: Path) -> None:
    """The directory disappears and a file takes its name (e.g. an unmounted volume)."""
    shutil.rmtree(d)
    d.write_bytes(b"not a directory")


def test_plugin_background_error_is_raised_once_then_cleared(
    tmp_path: Path, gate: WriterGate
) -> None:
    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=8)
    # commits, then the gate holds the writer
    io.save_checkpoint(_state(0), tmp_path / "first.ckpt")
    assert gate.entered.wait(30)
    bad = tmp_path / "volume"
    io.save_checkpoint(_state(1), bad / "a.ckpt")  # staged; its write is held
    _break_directory(bad)
    gate.open()
    _wait_until(lambda: io.pending() == 0)
    with pytest.raises(
        stagesave.CheckpointError, match=r"saving checkpoint .*volume/a\.ckpt failed"
    ):
        io.save_checkpoint(_state(2), tmp_path / "b.ckpt")
    io.save_checkpoint(_state(3), tmp_path / "c.ckpt")  # the error was delivered: not raised again
    io.teardown()
    assert torch.equal(torch.load(tmp_path / "c.ckpt")["w"], torch.full((64,), 3.0))
    assert not (tmp_path / "b.ckpt").exists()  # the save that raised was not submitted


class FailsAt(TinyModel):
    """Raises the user's own error at ``fail_step``; before that, ``on_step`` may break things."""

    def __init__(self, fail_step: int) -> None:
        super().__init__()
        self.fail_step = fail_step
        self.on_step: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_step:
            if self.on_step is not None:
                self.on_step()
            raise ValueError("boom in training_step")
        return super().training_step(batch, batch_idx)


def _fails_at(step: int, on_step: Any) -> FailsAt:
    model = FailsAt(step)
    model.on_step = on_step  # set after construction: hyper-parameters must stay picklable
    return model


def test_async_checkpointio_teardown_masks_the_users_exception(tmp_path: Path) -> None:
    held = HeldCheckpointIO(hold_after=0, fail_at=1)
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)
    trainer = make_trainer(tmp_path, [AsyncCheckpointIO(held)], [mc], max_steps=5)
    with pytest.raises(OSError, match="No space left") as info:
        trainer.fit(_fails_at(1, held.release.set), StepBatches())
    assert isinstance(info.value.__context__, ValueError)  # the user's error, buried


def test_plugin_teardown_never_masks_the_users_exception(
    tmp_path: Path, gate: WriterGate, caplog: pytest.LogCaptureFixture
) -> None:
    d = tmp_path / "ckpt"
    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=8)

    class Warm(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            if trainer.global_step == 1:  # runs before ModelCheckpoint's save at step 1
                trainer.save_checkpoint(tmp_path / "warm.ckpt")

    def break_and_release() -> None:
        _break_directory(d)
        gate.open()

    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=1)
    trainer = make_trainer(tmp_path, [io], [Warm(), mc], max_steps=5)
    with caplog.at_level(logging.ERROR, logger="stagesave.lightning"), \
            pytest.raises(ValueError, match="boom in training_step"):
        trainer.fit(_fails_at(1, break_and_release), StepBatches())
    # The failed save is reported, not lost, and nothing is left pending or raised later.
    assert any(
        "epoch=0-step=1.ckpt" in r.getMessage() and "failed" in r.getMessage()
        for r in caplog.records
    )
    assert io.pending() == 0
    io.teardown()


# ---------------------------------------------------------------- load/remove of a pending path
def test_async_checkpointio_load_and_remove_ignore_pending_saves(tmp_path: Path) -> None:
    held = HeldCheckpointIO(hold_after=1)
    io = AsyncCheckpointIO(held)
    path = tmp_path / "x.ckpt"
    io.save_checkpoint(_state(1), path)
    # Fully written (Lightning's fsspec transaction closed), not merely visible: the transaction
    # is process-wide, and this thread's load and removal must not run inside it.
    _wait_until(lambda: held.written == ["x.ckpt"] and path.exists())
    io.save_checkpoint(_state(2), path)  # pending
    assert io.load_checkpoint(path)["global_step"] == 1  # stale: the save just made is ignored
    io.remove_checkpoint(path)  # removes the old file now...
    held.release.set()
    io.teardown()
    assert path.exists()  # ...and the pending save brings it back after the removal


def test_plugin_load_and_remove_wait_for_pending_saves(tmp_path: Path, gate: WriterGate) -> None:
    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=8)
    path = tmp_path / "x.ckpt"
    io.save_checkpoint(_state(1), path)
    assert gate.entered.wait(30)
    io.save_checkpoint(_state(2), path)  # pending behind the gate
    got: dict[str, Any] = {}
    loader = threading.Thread(target=lambda: got.update(io.load_checkpoint(path)))
    loader.start()
    loader.join(0.3)
    assert loader.is_alive()  # the load waits for the pending save of the same path
    gate.open()
    loader.join(30)
    assert got["global_step"] == 2
    gate.close()
    io.save_checkpoint(_state(3), path)
    io.remove_checkpoint(path)  # ordered after the save just submitted
    gate.open()
    io.wait()
    assert not path.exists()
    assert os.listdir(tmp_path) == []  # no proof, temporary or debris left behind
    io.teardown()


# ---------------------------------------------------------------- Lightning's default weights_only
def test_torch_checkpointio_cannot_resume_a_checkpoint_with_numpy(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    make_trainer(tmp_path, [], [ModelCheckpoint(dirpath=d)], max_steps=2).fit(
        TinyModel(numpy_state=True), StepBatches()
    )
    trainer = make_trainer(tmp_path, [], max_steps=3)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        trainer.fit(TinyModel(numpy_state=True), StepBatches(), ckpt_path=d / "epoch=0-step=2.ckpt")


@pytest.mark.parametrize("writer", ["torch", "staged"])
def test_plugin_resumes_a_checkpoint_with_numpy_under_default_weights_only(
    tmp_path: Path, writer: str
) -> None:
    d = tmp_path / "ckpt"
    io = [] if writer == "torch" else [StagedCheckpointIO()]
    make_trainer(tmp_path, io, [ModelCheckpoint(dirpath=d)], max_steps=2).fit(
        TinyModel(numpy_state=True), StepBatches()
    )
    model = TinyModel(numpy_state=True)
    trainer = make_trainer(tmp_path, [StagedCheckpointIO()], max_steps=3)
    trainer.fit(model, StepBatches(), ckpt_path=d / "epoch=0-step=2.ckpt")
    assert trainer.global_step == 3
    assert model.seen.tolist() == [3] * 4  # 2 restored from the file + 1 step


def test_plugin_refuses_unlisted_classes_unless_weights_only_false(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    torch.save({"obj": TorchCheckpointIO()}, path)  # a class no allow-list should accept
    io = StagedCheckpointIO()
    with pytest.raises(stagesave.UnsafeCheckpointError, match="TorchCheckpointIO"):
        io.load_checkpoint(path)
    assert isinstance(io.load_checkpoint(path, weights_only=False)["obj"], TorchCheckpointIO)
    io.teardown()


# ---------------------------------------------------------------- device memory
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["async", "staged"])
def test_device_memory_during_save(tmp_path: Path, kind: str) -> None:
    state = {"w": torch.randn(64, 1024, 1024, device="cuda")}  # 256 MiB on the device
    held = HeldCheckpointIO(hold_after=0)
    io: Any = AsyncCheckpointIO(held) if kind == "async" else StagedCheckpointIO()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    io.save_checkpoint(state, tmp_path / "x.ckpt")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    held.release.set()
    io.teardown()
    if kind == "async":
        assert extra >= 256 * 2**20  # a full clone on the device
    else:
        assert extra < 16 * 2**20  # staged into host memory
    assert torch.equal(torch.load(tmp_path / "x.ckpt")["w"], state["w"].cpu())
    os.remove(tmp_path / "x.ckpt")


@pytest.mark.gpu
def test_device_staging_keeps_the_checkpoint_in_device_memory(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 1024, 1024, device="cuda"), "global_step": 3}  # 256 MiB
    expected = state["w"].cpu()
    seen: list[Any] = []
    io = StagedCheckpointIO(device_staging=True, telemetry_callback=seen.append)
    io.save_checkpoint(state, tmp_path / "d.ckpt")
    state["w"].zero_()  # the next optimizer step: must not reach the checkpoint
    io.wait()
    io.teardown()
    assert seen and seen[0].staged_on.startswith("cuda") and seen[0].error is None
    assert torch.equal(torch.load(tmp_path / "d.ckpt")["w"], expected)
