"""Every load of the Lightning adapter goes through the safe unpickler and the proof: a
``.ckpt`` (plain, or with a valid stagesave proof made by an attacker) and a sharded folder's
``meta.pt`` whose unpickling would run code are refused with a stagesave error and run nothing;
a file the folder's proof does not list is refused also without ``verify_on_load``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import StepBatches, TinyModel, make_trainer
from stagesave.lightning import StagedCheckpointIO
from stagesave.lightning._sharded import ShardedCheckpoints

import stagesave
from stagesave.formats import Raw


class Boom:
    """Unpickling it creates the folder ``marker`` (what an attacker's payload would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.marker,))


def _real_checkpoint(tmp_path: Path) -> dict[str, Any]:
    """The dict of a real Lightning checkpoint (3 steps of a real Trainer with the plugin)."""
    d = tmp_path / "ckpts"
    io = StagedCheckpointIO()
    make_trainer(
        tmp_path / "run", [io], [ModelCheckpoint(dirpath=d, save_top_k=-1)], max_steps=3
    ).fit(TinyModel(), StepBatches())
    io.wait()
    [path] = sorted(d.iterdir())
    return io.load_checkpoint(path)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("made_by", ["torch.save", "stagesave.save"])
def test_fit_ckpt_path_refuses_a_checkpoint_that_would_run_code(
    tmp_path: Path, made_by: str, verify: bool
) -> None:
    state = _real_checkpoint(tmp_path)
    marker = str(tmp_path / "PWNED")
    state["callbacks"] = {"evil": Boom(marker)}
    path = tmp_path / "evil.ckpt"
    if made_by == "torch.save":
        torch.save(state, path)
    else:  # a checkpoint whose proof holds up: anyone can make one with stagesave itself
        stagesave.save(state, path)
        assert stagesave.verify(path).status == "verified"
    trainer = make_trainer(
        tmp_path / "resume", [StagedCheckpointIO(verify_on_load=verify)], max_steps=6
    )
    with pytest.raises(stagesave.UnsafeCheckpointError, match=r"posix.mkdir"):
        trainer.fit(TinyModel(), StepBatches(), ckpt_path=str(path))
    assert not os.path.exists(marker)


def _sharded_folder(root: Path, meta: bytes, *, proven: bool) -> Path:
    """A sharded checkpoint folder holding ``meta`` as its ``meta.pt`` (DCP's ``.metadata``
    stands in as the carrier of the folder's proof)."""
    folder = root / "sharded.ckpt"
    if proven:
        with stagesave.Checkpointer(root) as ck:
            ck.save_dir(
                {".metadata": {"planner": torch.zeros(1)}, "meta.pt": Raw(meta)}, folder.name
            ).result()
        assert stagesave.verify(folder).status == "verified"
    else:
        folder.mkdir()
        (folder / "meta.pt").write_bytes(meta)
    return folder


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("proven", [True, False], ids=["proven", "plain"])
def test_a_sharded_meta_pt_that_would_run_code_is_refused(
    tmp_path: Path, proven: bool, verify: bool
) -> None:
    marker = str(tmp_path / "PWNED")
    evil = tmp_path / "evil.pt"
    torch.save({"global_step": 4, "loops": Boom(marker)}, evil)
    folder = _sharded_folder(tmp_path, evil.read_bytes(), proven=proven)
    io = StagedCheckpointIO(verify_on_load=verify)
    filled: list[Any] = []
    try:
        with pytest.raises(stagesave.UnsafeCheckpointError, match=r"posix.mkdir"):
            ShardedCheckpoints().load(io, str(folder), None, filled.append)
    finally:
        io.teardown()
    assert not os.path.exists(marker) and not filled


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_dcp_reads_no_file_the_sharded_proof_does_not_list_without_verify_on_load(
    tmp_path: Path, verify: bool
) -> None:
    """A file beside the checkpoint is the user's: the folder loads, and the reader DCP gets
    refuses an item stored in it (also without ``verify_on_load``: it knows the proof's list)."""
    ok = tmp_path / "ok.pt"
    torch.save({"global_step": 4}, ok)
    folder = _sharded_folder(tmp_path, ok.read_bytes(), proven=True)
    shutil.copy(folder / ".metadata", folder / "__0_0.distcp")  # not in the proof
    io = StagedCheckpointIO(verify_on_load=verify)
    filled: list[Any] = []
    try:
        assert ShardedCheckpoints().load(io, str(folder), None, filled.append) == {
            "global_step": 4}
    finally:
        io.teardown()
    [reader] = filled
    assert reader.verify is verify
    assert reader.verify or reader.listed == frozenset({".metadata", "meta.pt"})


def test_weights_only_false_is_the_trusted_opt_out(tmp_path: Path) -> None:
    marker = str(tmp_path / "PWNED")
    path = tmp_path / "x.ckpt"
    torch.save({"x": Boom(marker)}, path)
    io = StagedCheckpointIO()
    with pytest.raises(stagesave.UnsafeCheckpointError):
        io.load_checkpoint(path)
    with pytest.raises(stagesave.UnsafeCheckpointError):
        io.load_checkpoint(path, weights_only=True)
    assert not os.path.exists(marker)
    io.load_checkpoint(path, weights_only=False)  # the caller vouched for the file
    assert os.path.exists(marker)
