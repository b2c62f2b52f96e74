"""A real Lightning checkpoint (loops, callbacks, optimizer and scheduler states, hyperparameters)
is laid out by stagesave's own planner, byte for byte as ``torch.save`` lays it out."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import StepBatches, TinyModel, make_trainer

from stagesave.saving import fastplan as _fastplan
from stagesave.saving.plan import plan_torch_file


def test_a_lightning_checkpoint_takes_the_fast_path_with_torch_saves_layout(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [], [ModelCheckpoint(dirpath=tmp_path / "c")], max_steps=3)
    trainer.fit(TinyModel(numpy_state=True), StepBatches())
    # what save_checkpoint hands the IO
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    assert _fastplan.fast_path_enabled()
    ours = _fastplan.plan_fast(checkpoint)
    assert ours is not None
    assert _fastplan.same_layout(ours, plan_torch_file(checkpoint))
