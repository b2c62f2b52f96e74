"""The plugin as a citizen of a Trainer: construction, the CheckpointIO contract, barriers,
teardown, pickling, and no side effects on the process."""

from __future__ import annotations

import os
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_helpers import StepBatches, TinyModel, WriterGate, make_trainer
from stagesave.lightning import StagedCheckpointIO, find_plugin, wait

import stagesave


@pytest.fixture(autouse=True)
def _threads_before() -> Any:
    """Threads alive when the test starts (other tests' checkpointers may still be closing)."""
    global _BEFORE
    _BEFORE = set(threading.enumerate())
    yield


_BEFORE: set[threading.Thread] = set()


def _stagesave_threads() -> list[str]:
    """stagesave threads started since this test began and still alive."""
    return [
        t.name for t in threading.enumerate() if t.name.startswith("stagesave") and t not in _BEFORE
    ]


def _metadata(path: Path) -> dict[str, Any]:
    """The metadata recorded in the proof inside ``path`` (checked byte for byte first)."""
    info = stagesave.verify(path)
    assert info.status == "verified" and info.format == 2 and info.manifest is not None
    return info.manifest.metadata


def test_constructible_without_arguments_and_used_by_the_trainer(tmp_path: Path) -> None:
    io = StagedCheckpointIO()
    trainer = make_trainer(tmp_path, [io])
    assert trainer.strategy.checkpoint_io is io
    assert find_plugin(trainer) is io
    assert _stagesave_threads() == []  # nothing started before the first save


def test_invalid_arguments_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="max_pending must be >= 1, got 0"):
        StagedCheckpointIO(max_pending=0)
    with pytest.raises(ValueError, match="checksum_in must be 'auto', 'background' or 'staging'"):
        StagedCheckpointIO(checksum_in="later")
    with pytest.raises(ValueError, match="teardown_timeout must be >= 0"):
        StagedCheckpointIO(teardown_timeout=-1)
    with pytest.raises(ValueError, match=r"'no.such.Class' does not name an importable class"):
        StagedCheckpointIO(safe_globals=["no.such.Class"])
    with pytest.raises(TypeError, match="device_staging must be True or False, got 'gpu'"):
        StagedCheckpointIO(device_staging="gpu")  # type: ignore[arg-type]


def test_device_staging_reaches_the_checkpointer(tmp_path: Path) -> None:
    io = StagedCheckpointIO(device_staging=True)
    state = {"w": torch.arange(10.0), "global_step": 1}
    io.save_checkpoint(state, tmp_path / "a.ckpt")  # host tensors: staged on the host as usual
    io.wait()
    assert io.checkpointer.device_staging is True
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["w"], state["w"])
    io.teardown()


def test_save_checkpoint_positional_and_keyword_with_metadata(tmp_path: Path) -> None:
    io = StagedCheckpointIO()
    state = {"w": torch.arange(10.0), "global_step": 5, "epoch": 1}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    io.save_checkpoint(
        checkpoint=state, path=str(tmp_path / "b.ckpt"), storage_options={"metadata": {"run": "x"}}
    )
    io.wait()
    assert _metadata(tmp_path / "a.ckpt") == {
        "framework": "lightning",
        "epoch": 1,
        "global_step": 5,
    }
    assert _metadata(tmp_path / "b.ckpt") == {
        "framework": "lightning",
        "epoch": 1,
        "global_step": 5,
        "run": "x",
    }
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt"]  # the proof is inside each file
    with pytest.raises(TypeError, match=r"accepts storage_options=\{'metadata'"):
        io.save_checkpoint(state, tmp_path / "c.ckpt", storage_options={"compress": True})
    io.teardown()


def test_wait_is_the_barrier_inside_the_fit_loop(tmp_path: Path, gate: WriterGate) -> None:
    # Inside fit a save is asynchronous: code that reads the file behind the plugin's back
    # first calls wait(trainer) (== trainer.strategy.checkpoint_io.wait()).
    seen: dict[str, Any] = {}

    class ReadsTheFile(Callback):
        def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
            trainer.save_checkpoint(tmp_path / "first.ckpt")
            assert gate.entered.wait(30)  # the writer is held after committing first.ckpt
            trainer.save_checkpoint(tmp_path / "manual.ckpt")
            seen["pending"] = not (tmp_path / "manual.ckpt").exists()
            threading.Timer(0.2, gate.open).start()
            wait(trainer)
            seen["step"] = torch.load(tmp_path / "manual.ckpt", weights_only=True)["global_step"]

    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=8)
    trainer = make_trainer(
        tmp_path, [io], [ReadsTheFile()], max_steps=2, enable_checkpointing=False
    )
    trainer.fit(TinyModel(), StepBatches())
    assert seen == {"pending": True, "step": 2}


def test_saves_outside_fit_return_committed_and_leave_no_threads(tmp_path: Path) -> None:
    io = StagedCheckpointIO()
    trainer = make_trainer(tmp_path, [io], max_steps=2, enable_checkpointing=False)
    model = TinyModel()
    trainer.fit(model, StepBatches())
    assert _stagesave_threads() == []  # teardown ended them
    trainer.save_checkpoint(tmp_path / "final.ckpt")  # after fit: nothing to overlap
    assert torch.load(tmp_path / "final.ckpt", weights_only=True)["global_step"] == 2
    assert stagesave.verify(str(tmp_path / "final.ckpt")).status == "verified"
    assert _stagesave_threads() == []  # and nothing kept for it


def test_teardown_joins_threads_and_the_plugin_is_reusable(tmp_path: Path) -> None:
    io = StagedCheckpointIO()
    mc = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, save_last="link"
    )
    trainer = make_trainer(tmp_path, [io], [mc], max_steps=3)
    trainer.fit(TinyModel(), StepBatches())
    assert _stagesave_threads() == []
    trainer.validate(TinyModel(), StepBatches(n=2), verbose=False)
    io.save_checkpoint({"x": torch.ones(1)}, tmp_path / "again.ckpt")  # no trainer: asynchronous
    assert _stagesave_threads() != []
    io.teardown()
    assert _stagesave_threads() == []
    assert torch.load(tmp_path / "again.ckpt")["x"].item() == 1.0


_GATE = WriterGate()


# picklable: a module-level function
def _held_by_module_gate(tel: stagesave.SaveTelemetry) -> None:
    _GATE(tel)


def test_picklable_while_idle_and_while_busy(tmp_path: Path) -> None:
    gate = _GATE
    gate.close()
    io = StagedCheckpointIO(
        max_pending=3, checksum="blake3", telemetry_callback=_held_by_module_gate
    )
    copy = pickle.loads(pickle.dumps(io))
    assert (copy.max_pending, copy.checksum) == (3, "blake3")
    io.save_checkpoint({"x": torch.ones(1)}, tmp_path / "a.ckpt")
    io.save_checkpoint({"x": torch.ones(1)}, tmp_path / "b.ckpt")
    assert io.pending() >= 1
    busy_copy = pickle.loads(pickle.dumps(io))  # configuration only; the saves stay with `io`
    assert busy_copy.pending() == 0 and busy_copy.max_pending == 3
    gate.open()
    io.teardown()
    trainer = make_trainer(tmp_path, [StagedCheckpointIO()], max_steps=1)
    trainer.fit(TinyModel(), StepBatches())
    restored = pickle.loads(pickle.dumps(trainer.strategy.checkpoint_io))
    assert isinstance(restored, StagedCheckpointIO)


def test_no_side_effects_on_cwd_or_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    env_before = dict(os.environ)
    io = StagedCheckpointIO()
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last="link")
    make_trainer(tmp_path / "root", [io], [mc], max_steps=2).fit(TinyModel(), StepBatches())
    io.load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    io.teardown()
    assert list(work.iterdir()) == []
    assert dict(os.environ) == env_before


def test_a_pending_failure_surfaces_at_wait_exactly_once(tmp_path: Path, gate: WriterGate) -> None:
    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=8)
    io.save_checkpoint({"x": torch.ones(1)}, tmp_path / "a.ckpt")
    assert gate.entered.wait(30)
    vol = tmp_path / "vol"
    io.save_checkpoint({"x": torch.ones(1)}, vol / "b.ckpt")
    vol.rmdir()
    vol.write_bytes(b"")
    gate.open()
    with pytest.raises(stagesave.CheckpointError, match=r"vol/b\.ckpt"):
        io.wait()
    io.wait()
    io.teardown()


def test_teardown_timeout_is_bounded_and_explains(tmp_path: Path, gate: WriterGate) -> None:
    io = StagedCheckpointIO(telemetry_callback=gate, teardown_timeout=0.2, max_pending=8)
    io.save_checkpoint({"x": torch.ones(1)}, tmp_path / "a.ckpt")
    assert gate.entered.wait(30)
    io.save_checkpoint({"x": torch.ones(1)}, tmp_path / "b.ckpt")
    with pytest.raises(TimeoutError, match=r"teardown_timeout=0.2 s; raise it"):
        io.teardown()
    gate.open()


def test_safe_globals_by_dotted_name_load_user_classes(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    torch.save({"cfg": AsyncCheckpointIO()}, path)
    with pytest.raises(stagesave.UnsafeCheckpointError):
        StagedCheckpointIO().load_checkpoint(path)
    io = StagedCheckpointIO(
        safe_globals=["lightning.pytorch.plugins.io.async_plugin.AsyncCheckpointIO"]
    )
    assert isinstance(io.load_checkpoint(path)["cfg"], AsyncCheckpointIO)


def test_paths_and_namespaces_in_hyperparameters_load_safely(tmp_path: Path) -> None:
    import argparse

    path = tmp_path / "x.ckpt"
    torch.save(
        {"hyper_parameters": {"data_dir": Path("/data"), "args": argparse.Namespace(lr=0.1)}}, path
    )
    hp = StagedCheckpointIO().load_checkpoint(path)["hyper_parameters"]
    assert hp["data_dir"] == Path("/data") and hp["args"].lr == 0.1


def test_loading_a_missing_checkpoint_is_file_not_found(tmp_path: Path) -> None:
    # Lightning's TorchCheckpointIO words, which Lightning's own callers and tests match
    with pytest.raises(
        FileNotFoundError, match=f"^Checkpoint file not found: {tmp_path / 'nope.ckpt'}$"
    ):
        StagedCheckpointIO().load_checkpoint(tmp_path / "nope.ckpt")


def test_slurm_requeue_checkpoint_is_committed_before_save_returns(tmp_path: Path) -> None:
    io = StagedCheckpointIO()
    trainer = make_trainer(tmp_path, [io], max_steps=1, enable_checkpointing=False)
    trainer.fit(TinyModel(), StepBatches())
    path = tmp_path / "hpc_ckpt_1.ckpt"  # what Lightning's SIGUSR1 handler saves before requeueing
    trainer.save_checkpoint(path)
    assert io.pending() == 0
    assert stagesave.verify(str(path)).status == "verified"
    io.teardown()
