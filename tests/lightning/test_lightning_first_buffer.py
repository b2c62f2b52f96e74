"""The staging buffer of a fit's first save is made before that save (issue 20: the first save
of a run), through real Trainers: once an optimizer step has made the optimizers' state, sized by
the module's and the optimizers' tensors, on the rank that writes, only when a
``ModelCheckpoint`` saves whole checkpoints; the first save leases it; nothing is left after
teardown. (A resumed fit: ``test_lightning_resume.py``.)"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from bufferwatch import watch_staging_buffers
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_helpers import StepBatches, TinyModel, make_trainer
from stagesave.lightning import StagedCheckpointIO

import stagesave
from stagesave.saving.buffers import GROWTH_STEP


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Staging buffers made (capacity, thread) and ``prepare_buffer`` calls (bytes, the
    trainer's global step, whether its optimizer had state) while a test's trainer runs."""
    seen: dict[str, list] = {"made": watch_staging_buffers(monkeypatch), "prepared": [],
                             "trainer": []}
    real_prepare = stagesave.Checkpointer.prepare_buffer

    def prepare(self: stagesave.Checkpointer, nbytes: int) -> None:
        trainer = seen["trainer"][-1]
        state = trainer.optimizers[0].state if trainer.optimizers else {}
        seen["prepared"].append((nbytes, trainer.global_step, bool(state)))
        real_prepare(self, nbytes)

    monkeypatch.setattr(stagesave.Checkpointer, "prepare_buffer", prepare)
    return seen


class _SavesSee(Callback):
    """How many staging buffers existed when each save began."""

    def __init__(self, made: list) -> None:
        self.made, self.saw = made, []

    def on_save_checkpoint(self, *args: object) -> None:
        self.saw.append(len(self.made))


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_fresh_fit_makes_its_first_saves_buffer_after_its_first_optimizer_step(
        tmp_path: Path, watched: dict[str, list], accumulate: int) -> None:
    d = tmp_path / "ckpt"
    before = set(threading.enumerate())
    see = _SavesSee(watched["made"])
    trainer = make_trainer(
        tmp_path, [StagedCheckpointIO(prepare_buffer=True)],
        [ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=-1), see],
        max_steps=4, accumulate_grad_batches=accumulate)
    watched["trainer"].append(trainer)
    trainer.fit(TinyModel(), StepBatches(n=16))
    assert trainer.global_step == 4
    # once: after the first optimizer step (not at the first batch when gradients accumulate),
    # with the optimizer's state there to be counted
    assert [p[1:] for p in watched["prepared"]] == [(1, True)]
    first = d / "epoch=0-step=2.ckpt"
    assert watched["prepared"][0][0] >= first.stat().st_size  # the file fits the buffer
    # made ahead, then leased by the first save; the second save, the first one still being
    # written, may make a second (max_pending=2), on its own thread as before
    assert watched["made"][:1] == [(GROWTH_STEP, "stagesave-buffer")]
    assert watched["made"][1:] in ([], [(GROWTH_STEP, "MainThread")])
    assert see.saw[:1] == [1]  # already made when the first save began
    assert [t.name for t in threading.enumerate()
            if t.name.startswith("stagesave") and t not in before] == []
    got = torch.load(d / "epoch=0-step=4.ckpt", weights_only=False)
    assert got["global_step"] == 4


@pytest.mark.parametrize("callbacks", ["weights only", "none", "never saves"])
def test_a_fit_whose_saves_are_not_whole_checkpoints_makes_no_buffer_ahead(
        tmp_path: Path, watched: dict[str, list], callbacks: str) -> None:
    kw: dict[str, object] = {}
    if callbacks == "weights only":
        cbs = [ModelCheckpoint(dirpath=tmp_path / "w", every_n_train_steps=2,
                               save_weights_only=True)]
    elif callbacks == "none":
        cbs, kw = [], {"enable_checkpointing": False}
    else:
        cbs = [ModelCheckpoint(dirpath=tmp_path / "n", save_top_k=0)]
    trainer = make_trainer(tmp_path, [StagedCheckpointIO(prepare_buffer=True)], cbs, max_steps=4,
                           **kw)
    watched["trainer"].append(trainer)
    trainer.fit(TinyModel(), StepBatches(n=16))
    assert watched["prepared"] == []


@pytest.mark.parametrize("choice", [None, False])
def test_a_cpu_fit_makes_no_buffer_ahead_by_default_and_none_when_told_not_to(
        tmp_path: Path, watched: dict[str, list], choice: bool | None) -> None:
    """On a CPU-only fit, making the buffer competes with training for the cores (BENCHMARKS:
    the fit took longer): the default makes it only where training runs on an accelerator."""
    d = tmp_path / "ckpt"
    for resume in (None, d / "epoch=0-step=2.ckpt"):
        trainer = make_trainer(
            tmp_path, [StagedCheckpointIO(prepare_buffer=choice)],
            [ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=-1)],
            max_steps=4 if resume else 2)
        watched["trainer"].append(trainer)
        trainer.fit(TinyModel(), StepBatches(n=16), ckpt_path=resume)
        assert trainer.global_step == (4 if resume else 2)
    assert watched["prepared"] == []


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device; this machine has none (GPU path untested here)")
def test_a_gpu_fit_makes_its_first_saves_buffer_ahead_by_default(
        tmp_path: Path, watched: dict[str, list]) -> None:
    d = tmp_path / "ckpt"
    trainer = make_trainer(
        tmp_path, [StagedCheckpointIO()],
        [ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=-1)],
        max_steps=2, accelerator="cuda", devices=1, deterministic=False)
    watched["trainer"].append(trainer)
    trainer.fit(TinyModel(), StepBatches(n=16))
    assert [p[1:] for p in watched["prepared"]] == [(1, True)]
    assert watched["prepared"][0][0] >= (d / "epoch=0-step=2.ckpt").stat().st_size


def test_prepare_buffer_must_be_a_bool_or_none() -> None:
    with pytest.raises(TypeError, match="prepare_buffer must be True, False or None, got 'yes'"):
        StagedCheckpointIO(prepare_buffer="yes")  # type: ignore[arg-type]


def test_a_trainer_without_the_plugin_is_untouched(
        tmp_path: Path, watched: dict[str, list]) -> None:
    trainer = make_trainer(
        tmp_path, [], [ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=2)],
        max_steps=2)
    watched["trainer"].append(trainer)
    trainer.fit(TinyModel(), StepBatches(n=16))
    assert watched["prepared"] == [] and watched["made"] == []
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["epoch=0-step=2.ckpt"]


def test_the_connectors_resume_called_by_hand_outside_fit_makes_nothing(
        tmp_path: Path, watched: dict[str, list]) -> None:
    """Lightning's own tests drive ``resume_start``/``resume_end`` and a callback's
    ``on_train_batch_end`` by hand, outside ``fit``: no teardown follows, so nothing may be made
    (a buffer and its thread would outlive the test)."""
    from lightning.pytorch.trainer.states import TrainerFn

    d = tmp_path / "ckpt"
    first = make_trainer(tmp_path, [StagedCheckpointIO(prepare_buffer=True)],
                         [ModelCheckpoint(dirpath=d, every_n_train_steps=2)], max_steps=2)
    watched["trainer"].append(first)
    first.fit(TinyModel(), StepBatches(n=16))
    watched["prepared"].clear()
    watched["made"].clear()
    before = set(threading.enumerate())
    callback = ModelCheckpoint(dirpath=d, every_n_train_steps=2)
    trainer = make_trainer(tmp_path, [StagedCheckpointIO(prepare_buffer=True)], [callback],
                           max_steps=4)
    watched["trainer"].append(trainer)
    connector = trainer._checkpoint_connector
    connector.resume_start(str(d / "epoch=0-step=2.ckpt"))
    trainer.state.fn = TrainerFn.FITTING
    connector.resume_end()
    trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total \
        .completed = 3  # a step taken, not one at which the callback saves
    assert trainer.global_step == 3
    callback.on_train_batch_end(trainer, TinyModel(), None, None, 0)
    assert watched["prepared"] == [] and watched["made"] == []
    assert [t.name for t in threading.enumerate()
            if t.name.startswith("stagesave") and t not in before] == []


def test_a_state_the_estimate_cannot_size_trains_on_and_saves(
        tmp_path: Path, watched: dict[str, list], caplog: pytest.LogCaptureFixture) -> None:
    """A module holding a sparse tensor (no storage to measure): the buffer is not made ahead,
    with a warning; training goes on and the first save makes its own buffer."""

    class Sparse(TinyModel):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("counts", torch.sparse_coo_tensor(
                torch.tensor([[0, 3]]), torch.tensor([1.0, 2.0]), (5,)))

    d = tmp_path / "ckpt"
    trainer = make_trainer(tmp_path, [StagedCheckpointIO(prepare_buffer=True)],
                           [ModelCheckpoint(dirpath=d, every_n_train_steps=2)], max_steps=2)
    watched["trainer"].append(trainer)
    with caplog.at_level("WARNING", logger="stagesave.lightning"):
        trainer.fit(Sparse(), StepBatches(n=16))
    assert trainer.global_step == 2 and watched["prepared"] == []
    assert "the first save's staging buffer is not made ahead: NotImplementedError" in caplog.text
    got = torch.load(d / "epoch=0-step=2.ckpt", weights_only=False)
    assert torch.equal(got["state_dict"]["counts"].to_dense(), torch.tensor([1.0, 0, 0, 2.0, 0]))
