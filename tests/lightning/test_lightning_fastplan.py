"""A real Lightning checkpoint (loops, callbacks, optimizer and scheduler states, hyperparameters)
is laid out by stagesave's own planner, byte for byte as ``torch.save`` lays it out, and a
Trainer's later saves reuse the plan (the planners are internal: the tests are about what they
produce and reuse)."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import StepBatches, TinyModel, make_trainer
from stagesave.lightning import StagedCheckpointIO

from stagesave.saving import fastplan as _fastplan  # internal: the test is about its output
from stagesave.saving import steady
from stagesave.saving.first_pickle import first_pickle
from stagesave.saving.plan import plan_torch_file
from stagesave.saving.splice import cut, marked
from stagesave.saving.torch_pickler import TorchPickler
from stagesave.saving.walk import walk


def test_a_lightning_checkpoint_takes_the_fast_path_with_torch_saves_layout(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [], [ModelCheckpoint(dirpath=tmp_path / "c")], max_steps=3)
    trainer.fit(TinyModel(numpy_state=True), StepBatches())
    # what save_checkpoint hands the IO
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    assert _fastplan.fast_path_enabled()
    ours = _fastplan.plan_fast(checkpoint)
    assert ours is not None
    assert _fastplan.same_layout(ours, plan_torch_file(checkpoint))


def test_a_trainers_saves_reuse_their_plan_and_load_as_torch_save_wrote_them(
        tmp_path: Path) -> None:
    """Through a real ``Trainer`` (a top-k callback that monitors the loss, a ``last.ckpt``
    callback), the plugin's later saves reuse the plan of the earlier ones — their structure is
    the same but for paths, scores and counters, which are spliced in — and each file loads as
    the checkpoint Lightning handed over."""
    reused = []
    plain_matches = steady.Template.matches

    def matches(self: steady.Template, walked: object) -> bool:
        hit = plain_matches(self, walked)  # type: ignore[arg-type]
        reused.append(hit)
        return hit

    io = StagedCheckpointIO()
    top = ModelCheckpoint(dirpath=tmp_path / "top", every_n_train_steps=2, save_top_k=2,
                          monitor="train_loss")
    steady.Template.matches = matches  # type: ignore[method-assign]
    try:
        trainer = make_trainer(tmp_path, [io], [
            top, ModelCheckpoint(dirpath=tmp_path / "last", every_n_train_steps=2,
                                 save_last=True)], max_steps=12)
        trainer.fit(TinyModel(), StepBatches())
    finally:
        steady.Template.matches = plain_matches  # type: ignore[method-assign]
    assert reused.count(True) >= 6, reused
    last = torch.load(tmp_path / "last" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 12
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(last["state_dict"][key], value)
    # the spliced strings: the paths the callbacks held at the last save
    states = [v for k, v in last["callbacks"].items() if "train_loss" in k]
    assert states and states[0]["best_model_path"] == top.best_model_path


def test_a_lightning_checkpoints_first_pickle_is_written_from_its_walk(tmp_path: Path) -> None:
    """Lightning's checkpoint dict (an ``OrderedDict`` state dict with ``_metadata``, loops,
    callbacks, optimizer and scheduler states, hyperparameters as a plain dict) is written by
    the one-pass writer with the pickler's bytes, cut at the same leaves; with numpy objects in
    it, the pickler writes it (the writer declines)."""
    for numpy_state in (False, True):
        trainer = make_trainer(tmp_path / str(numpy_state), [],
                               [ModelCheckpoint(dirpath=tmp_path / "c")], max_steps=3)
        trainer.fit(TinyModel(numpy_state=numpy_state), StepBatches())
        checkpoint = trainer._checkpoint_connector.dump_checkpoint()
        walked = walk(checkpoint)
        written = first_pickle(checkpoint, walked)
        if numpy_state:
            assert written is None
            continue
        assert written is not None
        buf = io.BytesIO()
        pickler = TorchPickler(buf)
        pickler.dump(marked(checkpoint))
        assert (written[0], written[1]) == cut(buf.getvalue(), len(walked.leaves))
        assert [s._cdata for s in written[2].storages] == [s._cdata for s in pickler.storages]
