"""No lock-in: stagesave files are plain torch files, and plain torch files load through
stagesave."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_same

import stagesave


def test_plain_torch_load_and_mmap_read_stagesave_files(ckpt_dir):
    emb = torch.randn(32, 8)
    state = {"model": {"emb": emb, "head": emb}, "step": 3}
    stagesave.save(state, ckpt_dir / "a.ckpt")
    for mmap in (False, True):
        out = torch.load(ckpt_dir / "a.ckpt", weights_only=True, mmap=mmap)
        assert_same(out, state)
        assert (
            out["model"]["emb"].untyped_storage().data_ptr()
            == out["model"]["head"].untyped_storage().data_ptr()
        )


def test_plain_torch_save_files_load_through_stagesave(ckpt_dir):
    state = {"w": torch.randn(3, 3), "arr": np.ones(2), "legacy": [1, 2]}
    torch.save(state, ckpt_dir / "zip.pt")
    assert_same(stagesave.load(ckpt_dir / "zip.pt"), state)
    torch.save(state, ckpt_dir / "legacy.pt", _use_new_zipfile_serialization=False)
    assert_same(stagesave.load(ckpt_dir / "legacy.pt"), state)


def test_lightning_load_from_checkpoint_reads_a_stagesave_file(ckpt_dir):
    L = pytest.importorskip("lightning.pytorch")

    class Net(L.LightningModule):
        def __init__(self, hidden: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(hidden, 2)

    net = Net(hidden=6)
    checkpoint = {
        "state_dict": net.state_dict(),
        "hyper_parameters": dict(net.hparams),
        "pytorch-lightning_version": L.__version__,
        "epoch": 0,
        "global_step": 0,
    }
    stagesave.save(checkpoint, ckpt_dir / "net.ckpt")
    loaded = Net.load_from_checkpoint(ckpt_dir / "net.ckpt")
    assert loaded.hparams.hidden == 6
    assert torch.equal(loaded.layer.weight, net.layer.weight)
