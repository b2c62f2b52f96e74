"""A Lightning fit whose checkpoint holds thousands of small tensors, with the writer thread:
its first save is held (planned behind the fit), the checkpoint is the state when saved, and a
new fit resumes from it."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from stagesave.lightning import StagedCheckpointIO


class _Many(L.LightningModule):
    """1,100 small layers: 2,200 parameters (and the Adam state of the 4 layers used)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(1_100))

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        x = batch[0]
        for layer in self.layers[:4]:
            x = layer(x)
        return x.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4,
                                                                                  generator=g)),
                                       batch_size=4)


def _trainer(root: Any, io: StagedCheckpointIO, steps: int) -> L.Trainer:
    return L.Trainer(max_steps=steps, plugins=[io], default_root_dir=root, logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0)


def test_a_fit_of_many_small_tensors_is_held_and_resumes(tmp_path: Any) -> None:
    seen: list[Any] = []
    torch.manual_seed(0)
    model = _Many()
    trainer = _trainer(tmp_path, StagedCheckpointIO(writer="thread",
                                                    telemetry_callback=seen.append), 2)
    trainer.fit(model, _loader())
    assert [t.plan_behind_s > 0 for t in seen] == [True]
    (path,) = (tmp_path / "checkpoints").iterdir()
    saved = torch.load(path, weights_only=False)  # the file as torch reads it
    assert saved["global_step"] == 2
    assert torch.equal(saved["state_dict"]["layers.7.weight"], model.layers[7].weight.detach())
    assert len(saved["optimizer_states"][0]["state"]) == 8  # the 4 layers used
    resumed = _Many()
    again = _trainer(tmp_path / "again", StagedCheckpointIO(writer="thread"), 3)
    again.fit(resumed, _loader(), ckpt_path=str(path))
    assert again.global_step == 3
