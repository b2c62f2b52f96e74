"""The staging buffer of a run's first ``save_state`` is made before that save (issue 20: the
first save of a run), through a real Accelerator: at its first optimizer step (the optimizers'
state exists then), sized by the models' and optimizers' tensors, on a thread; the first save
leases it; ``end_training()`` gives it back and a later run makes it again; nothing when the
option says no (the default on a CPU-only run) or the save would not come through stagesave."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import stagesave.accelerate as sa
import torch
from accel_helpers import build, train
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from bufferwatch import watch_staging_buffers
from stagesave.accelerate import Options
from stagesave.accelerate._config import resolve_options

import stagesave
from stagesave.saving.buffers import GROWTH_STEP


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Staging buffers made (capacity, thread) and ``prepare_buffer`` calls (bytes, whether the
    first optimizer had state then) while a test's Accelerator trains."""
    seen: dict[str, list] = {"made": watch_staging_buffers(monkeypatch), "prepared": [], "acc": []}
    real_prepare = stagesave.Checkpointer.prepare_buffer

    def prepare(self: stagesave.Checkpointer, nbytes: int) -> None:
        acc = seen["acc"][-1]
        seen["prepared"].append((nbytes, bool(acc._optimizers[0].optimizer.state)))
        real_prepare(self, nbytes)

    monkeypatch.setattr(stagesave.Checkpointer, "prepare_buffer", prepare)
    return seen


def _accelerator(project: Path | None) -> Any:
    config = (ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
              if project is not None else None)
    return Accelerator(cpu=True, project_config=config)


def _stagesave_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("stagesave"))


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


@pytest.mark.parametrize("naming", ["automatic", "explicit"])
def test_the_first_save_leases_a_buffer_made_at_the_first_optimizer_step(
        tmp_path: Path, watched: dict[str, list], naming: str) -> None:
    acc = _accelerator(tmp_path if naming == "automatic" else None)
    watched["acc"].append(acc)
    run = build(acc, width=256)
    sa.enable(acc, prepare_buffer=True)
    assert watched["prepared"] == []  # nothing before training
    train(acc, run, 1)
    # once, right after the first step, with the optimizer's state there to be counted
    assert [p[1] for p in watched["prepared"]] == [True]
    train(acc, run, 2)
    assert len(watched["prepared"]) == 1
    made_before_save = list(watched["made"])
    first = tmp_path / "checkpoints" / "checkpoint_0" if naming == "automatic" else tmp_path / "a"
    acc.save_state(None if naming == "automatic" else str(first))
    # made ahead on the buffer thread; the save leased it and made none of its own
    assert made_before_save == [(GROWTH_STEP, "stagesave-buffer")]
    assert watched["made"] == made_before_save
    acc.end_training()
    assert watched["prepared"][0][0] >= _folder_bytes(first)  # the folder fits the buffer
    assert stagesave.verify(first).status == "verified"
    assert _stagesave_threads() == []
    # a later run of the same Accelerator makes its first save's buffer again
    train(acc, run, 1)
    assert len(watched["prepared"]) == 2
    acc.end_training()
    assert _stagesave_threads() == []
    sa.disable(acc)


def _ema(model: torch.nn.Module) -> torch.nn.Module:
    """A module registered for checkpointing that holds a copy of the weights (an EMA)."""
    return torch.optim.swa_utils.AveragedModel(model)


def test_several_optimizers_and_custom_objects_are_counted(
        tmp_path: Path, watched: dict[str, list]) -> None:
    """Review finding: sized at the first optimizer's step, the second optimizer had no state
    yet, and the modules registered for checkpointing were not counted: the first save made a
    larger buffer of its own. (Other registered objects are not asked: their state_dict may
    gather from every process, and only the writing one would ask.)"""
    acc = _accelerator(tmp_path)
    watched["acc"].append(acc)
    run = build(acc, width=1024, n_models=2)  # 4 MiB of weights each: more than the slack
    acc.register_for_checkpointing(_ema(run["models"][0]))
    sa.enable(acc, prepare_buffer=True)
    train(acc, run, 1)  # both optimizers step once: made after the second one's step
    assert len(watched["prepared"]) == 1
    assert [bool(o.optimizer.state) for o in acc._optimizers] == [True, True]
    made = len(watched["made"])
    acc.save_state()
    acc.end_training()
    first = tmp_path / "checkpoints" / "checkpoint_0"
    assert watched["prepared"][0][0] >= _folder_bytes(first)
    assert len(watched["made"]) == made == 1  # the save made none of its own
    sa.disable(acc)


def test_a_save_hook_that_may_change_what_is_saved_makes_no_buffer_ahead(
        tmp_path: Path, watched: dict[str, list]) -> None:
    """Adapters-only saves drop the base weights in a save hook: sized by the models, the
    buffer would hold far more memory than the save needs."""
    acc = _accelerator(tmp_path)
    watched["acc"].append(acc)
    run = build(acc, width=256)
    acc.register_save_state_pre_hook(lambda models, weights, output_dir: None)
    sa.enable(acc, prepare_buffer=True)
    train(acc, run, 2)
    assert watched["prepared"] == []
    acc.end_training()
    sa.disable(acc)


@pytest.mark.parametrize("choice", [None, False, "auto", "false"])
def test_a_cpu_run_makes_no_buffer_ahead_by_default_and_none_when_told_not_to(
        tmp_path: Path, watched: dict[str, list], choice: Any) -> None:
    """On a CPU-only run making the buffer would compete with training for the cores: the
    default makes it only where training runs on an accelerator."""
    acc = _accelerator(tmp_path)
    watched["acc"].append(acc)
    run = build(acc)
    sa.enable(acc, prepare_buffer=choice)
    train(acc, run, 2)
    assert watched["prepared"] == watched["made"] == []
    acc.save_state()  # makes its buffer while it plans, as before
    assert len(watched["made"]) == 1 and watched["prepared"] == []
    acc.end_training()
    sa.disable(acc)


def test_runs_whose_saves_do_not_come_through_stagesave_make_no_buffer(
        tmp_path: Path, watched: dict[str, list]) -> None:
    acc = _accelerator(tmp_path)
    watched["acc"].append(acc)
    run = build(acc)
    sa.enable(acc, prepare_buffer=True)
    sa.disable(acc)  # Accelerate's own save_state again
    train(acc, run, 2)
    assert watched["prepared"] == []


def test_a_state_that_cannot_be_measured_is_logged_and_training_goes_on(
        tmp_path: Path, watched: dict[str, list], caplog: pytest.LogCaptureFixture) -> None:
    acc = _accelerator(tmp_path)
    watched["acc"].append(acc)
    run = build(acc)
    # a sparse buffer has no storage to measure
    run["models"][0].register_buffer("mask", torch.eye(4).to_sparse())
    sa.enable(acc, prepare_buffer=True)
    with caplog.at_level(logging.WARNING, logger="stagesave.accelerate"):
        train(acc, run, 2)
    assert watched["prepared"] == []
    assert [r.getMessage() for r in caplog.records if "ahead" in r.getMessage()] == [
        ("stagesave: could not make the first save's staging buffer ahead (at the first "
        "optimizer step: NotImplementedError('Cannot access storage of SparseTensorImpl')); the "
        "first save makes it")
    ]
    acc.end_training()
    sa.disable(acc)


def test_prepare_buffer_from_code_environment_and_side_file(tmp_path: Path) -> None:
    assert Options().prepare_buffer is None
    assert resolve_options({}, {}).prepare_buffer is None
    for word, value in (("auto", None), ("", None), ("1", True), ("off", False)):
        got = resolve_options({}, {"STAGESAVE_ACCELERATE_PREPARE_BUFFER": word})
        assert got.prepare_buffer is value, word
    side = tmp_path / "s.yaml"
    side.write_text("prepare_buffer: true\n")
    assert resolve_options({}, {"STAGESAVE_ACCELERATE_CONFIG": str(side)}).prepare_buffer is True
    assert resolve_options({"prepare_buffer": False}, {}).prepare_buffer is False
    with pytest.raises(ValueError, match="STAGESAVE_ACCELERATE_PREPARE_BUFFER: prepare_buffer "
                                         "must be true or false, got 'sometimes'"):
        resolve_options({}, {"STAGESAVE_ACCELERATE_PREPARE_BUFFER": "sometimes"})
    assert os.environ.get("STAGESAVE_ACCELERATE_PREPARE_BUFFER") is None


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device; this machine has none (GPU path untested here)")
def test_a_run_on_a_cuda_device_makes_its_buffer_ahead_by_default(
        tmp_path: Path, watched: dict[str, list]) -> None:
    acc = Accelerator(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    assert acc.device.type == "cuda"
    watched["acc"].append(acc)
    run = build(acc, width=256)
    sa.enable(acc)
    train(acc, run, 1)
    assert [p[1] for p in watched["prepared"]] == [True]
    acc.save_state()
    acc.end_training()
    first = tmp_path / "checkpoints" / "checkpoint_0"
    assert watched["prepared"][0][0] >= _folder_bytes(first)
    assert _stagesave_threads() == []
    sa.disable(acc)
