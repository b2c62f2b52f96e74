"""The checkpoint directory holds exactly what Lightning's own ``TorchCheckpointIO`` leaves for
the same run (issue 16): no sidecar, no temporary, no debris; every file is a real zip that
``zipfile``, ``torch.load`` (``weights_only``, ``mmap``) and ``load_from_checkpoint`` read as it is,
and that carries its own proof."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_helpers import StepBatches, TinyModel, assert_bitwise_equal, make_trainer, weights
from stagesave.lightning import StagedCheckpointIO

import stagesave


def _fit(root: Path, io: Any, save_last: Any) -> tuple[Path, TinyModel]:
    """Train 12 steps, a checkpoint every 2 steps, the 3 lowest losses kept, plus ``last``."""
    seed_everything(3, workers=True)
    model = TinyModel()
    d = root / "ckpt"
    mc = ModelCheckpoint(dirpath=d, monitor="loss", mode="min", every_n_train_steps=2, save_top_k=3,
                         save_last=save_last)
    make_trainer(root, [io], [mc], max_steps=12, max_epochs=-1).fit(model, StepBatches(n=5))
    return d, model


def _assert_plain_and_proven(path: Path) -> dict[str, Any]:
    """``path`` is a genuine torch zip that plain tools read, and it verifies against its proof."""
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None, path  # every record carries its real CRC-32
    state = torch.load(path, weights_only=True)
    mapped = torch.load(path, weights_only=True, mmap=True)
    assert_bitwise_equal(mapped["state_dict"], state["state_dict"])
    info = stagesave.verify(path)
    assert (info.status, info.format) == ("verified", 2), (path, info.problems)
    assert (
        info.manifest is not None and info.manifest.metadata["global_step"] == state["global_step"]
    )
    return state  # type: ignore[no-any-return]


def test_save_top_k_and_save_last_list_exactly_what_torch_checkpointio_lists(
    tmp_path: Path,
) -> None:
    torch_dir, _ = _fit(tmp_path / "torch", TorchCheckpointIO(), save_last=True)
    staged_dir, model = _fit(tmp_path / "staged", StagedCheckpointIO(), save_last=True)

    listing = sorted(os.listdir(staged_dir))
    assert listing == sorted(os.listdir(torch_dir))
    # the three best and last: a real run of top-k
    assert len(listing) == 4 and "last.ckpt" in listing
    for name in listing:
        path = staged_dir / name
        assert path.is_file() and not path.is_symlink()
        state = _assert_plain_and_proven(path)
        reference = torch.load(torch_dir / name, weights_only=True)
        assert state["global_step"] == reference["global_step"]
        assert_bitwise_equal(state["state_dict"], reference["state_dict"])

    last = torch.load(staged_dir / "last.ckpt", weights_only=True)
    assert last["global_step"] == 12
    loaded = TinyModel.load_from_checkpoint(staged_dir / "last.ckpt")
    assert_bitwise_equal(weights(loaded), weights(model))
    assert loaded.hparams["hidden"] == 32


def test_save_last_link_lists_exactly_what_torch_checkpointio_lists(tmp_path: Path) -> None:
    torch_dir, _ = _fit(tmp_path / "torch", TorchCheckpointIO(), save_last="link")
    staged_dir, model = _fit(tmp_path / "staged", StagedCheckpointIO(), save_last="link")

    listing = sorted(os.listdir(staged_dir))
    assert listing == sorted(os.listdir(torch_dir))
    assert len(listing) == 4 and "last.ckpt" in listing  # the link plus the three best
    last = staged_dir / "last.ckpt"
    assert last.is_symlink() and (torch_dir / "last.ckpt").is_symlink()
    assert os.readlink(last) == os.readlink(torch_dir / "last.ckpt")  # relative, to the same name
    for name in listing:
        if name != "last.ckpt":
            assert not (staged_dir / name).is_symlink()
            _assert_plain_and_proven(staged_dir / name)
    assert torch.load(last, weights_only=True)["global_step"] == 12
    loaded = TinyModel.load_from_checkpoint(last)
    assert_bitwise_equal(weights(loaded), weights(model))


@pytest.mark.parametrize("save_last", [True, "link"])
def test_resume_from_last_after_the_listing_run(tmp_path: Path, save_last: Any) -> None:
    d, _ = _fit(tmp_path, StagedCheckpointIO(), save_last=save_last)
    mc = ModelCheckpoint(dirpath=d, monitor="loss", mode="min", every_n_train_steps=2, save_top_k=3,
                         save_last=save_last)
    trainer = make_trainer(tmp_path, [StagedCheckpointIO()], [mc], max_steps=14, max_epochs=-1)
    trainer.fit(TinyModel(), StepBatches(n=5), ckpt_path="last")
    assert trainer.global_step == 14
    assert len(os.listdir(d)) == 4  # still the three best and last, nothing beside them
