"""Sharded checkpoints (FSDP ``state_dict_type="sharded"``, ModelParallel) through stagesave:
two processes on the CPU (gloo), real Lightning strategies, real DCP folders.

What runs here: FSDP1 (the model wraps itself with ``device_id=cpu``; Lightning refuses FSDP
without a GPU otherwise) and FSDP2 under ``ModelParallelStrategy`` (data parallel 2, tensor
parallel 1). Lightning's automatic FSDP wrapping and tensor parallelism need GPUs: see the
``gpu`` test at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_helpers import HERE, run_python
from stagesave.lightning import (
    StagedCheckpointIO,
    StagedFSDPStrategy,
    StagedModelParallelStrategy,
    find_plugin,
)
from stagesave.lightning._sharded import ShardedCheckpoints

import stagesave
import stagesave.dcp

KINDS = {"fsdp": "model", "model_parallel": "state_dict"}  # strategy -> its model key in the folder


# ---------------------------------------------------------------- the strategies as objects
def test_the_strategies_bring_their_plugin_or_take_the_one_given(tmp_path: Path) -> None:
    assert isinstance(
        StagedFSDPStrategy(state_dict_type="sharded").checkpoint_io, StagedCheckpointIO
    )
    io = StagedCheckpointIO(max_pending=1)
    assert StagedModelParallelStrategy(checkpoint_io=io).checkpoint_io is io
    io2 = StagedCheckpointIO()
    trainer = Trainer(
        strategy=StagedModelParallelStrategy(),
        plugins=[io2],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    assert trainer.strategy.checkpoint_io is io2 and find_plugin(trainer) is io2


def test_staged_strategies_from_a_lightningcli_yaml(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI
    from lightning_helpers import TinyModel

    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"""
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  default_root_dir: {tmp_path}
  strategy:
    class_path: stagesave.lightning.StagedModelParallelStrategy
    init_args:
      data_parallel_size: 1
      tensor_parallel_size: 1
      checkpoint_io:
        class_path: stagesave.lightning.StagedCheckpointIO
        init_args: {{max_pending: 1}}
""")
    cli = LightningCLI(TinyModel, args=["--config", str(cfg)], run=False, save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, StagedModelParallelStrategy) and strategy._data_parallel_size == 1
    assert (
        isinstance(strategy.checkpoint_io, StagedCheckpointIO)
        and strategy.checkpoint_io.max_pending == 1
    )


def test_sharded_saves_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    state = {"state_dict": {}, "optimizer_states": []}
    with pytest.raises(TypeError, match=r"storage_options=...\) is not supported for sharded"):
        StagedFSDPStrategy(state_dict_type="sharded").save_checkpoint(
            dict(state), tmp_path / "a", {"x": 1}
        )
    with pytest.raises(ValueError, match="sharded checkpoints are local folders"):
        StagedFSDPStrategy(state_dict_type="sharded").save_checkpoint(dict(state), "s3://bucket/a.ckpt")
    other = StagedModelParallelStrategy(checkpoint_io=TorchCheckpointIO())
    with pytest.raises(TypeError, match="its checkpoint_io is a TorchCheckpointIO"):
        other.save_checkpoint(dict(state), tmp_path / "a.ckpt")


# ---------------------------------------------------------------- two ranks, real runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict[str, Any]]]]:
    """One pair of processes runs both strategies, one after the other (starting processes is
    most of the cost)."""
    base = tmp_path_factory.mktemp("sharded")
    proc = run_python([str(HERE / "_child_sharded.py"), str(base), *KINDS], timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {
        kind: (
            base / kind,
            [json.loads((base / kind / f"rank{r}.json").read_text()) for r in (0, 1)],
        )
        for kind in KINDS
    }


@pytest.mark.parametrize("kind", list(KINDS))
def test_sharded_saves_are_committed_folders_in_lightnings_layout(
    runs: dict[str, tuple[Path, list[dict[str, Any]]]], kind: str
) -> None:
    root, ranks = runs[kind]
    ckpt = root / "ckpt"
    folder = ckpt / "epoch=0-step=4.ckpt"
    info = stagesave.verify(str(folder))
    assert (
        (info.status, info.format) == ("verified", 2) and info.is_dir and info.manifest is not None
    )
    # Exactly Lightning's files (as in the folder Lightning's own strategy wrote in phase 3),
    # nothing beside them: the proof is inside the files.
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert sorted(os.listdir(folder)) == sorted(os.listdir(root / "plain" / "epoch=0-step=6.ckpt"))
    # .metadata carries the folder's proof: each rank file (with a proof of its own) and meta.pt
    # (loops, callbacks: Lightning's plain torch.save file) with its checksums.
    proof = info.manifest.folder
    assert proof is not None and proof.carrier == ".metadata"
    assert sorted(m.name for m in proof.members) == ["__0_0.distcp", "__1_0.distcp"]
    assert [e.name for e in proof.listed] == ["meta.pt"]
    assert {k: info.manifest.metadata[k] for k in ("framework", "epoch", "global_step")} == {
        "framework": "lightning", "epoch": 0, "global_step": 4}
    meta = folder / "meta.pt"
    assert torch.load(meta, weights_only=True)["global_step"] == 4
    # The whole checkpoint, gathered from both ranks' files, is the model and optimizer state.
    state = stagesave.dcp.to_state_dict(folder)
    assert set(state) == {KINDS[kind], "optimizer_0"}
    assert state[KINDS[kind]]["net.0.weight"].shape == (32, 8)
    # Top-1 removed step 2 after step 4 committed; nothing half-written is left behind.
    for r in ranks:
        assert r["files"] == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert not [p for p in ckpt.rglob("*") if stagesave.is_temporary(p.name)]
    last = ckpt / "last.ckpt"
    if kind == "fsdp":  # save_last="link": a link to the committed folder
        assert last.is_symlink() and last.resolve() == folder.resolve()
    else:  # save_last=True: a folder of its own
        assert stagesave.verify(str(last)).status == "verified"
    # latest() finds the newest committed folder (the step-4 folder, or last.ckpt, the same step).
    assert ranks[0]["latest"] == ranks[1]["latest"]
    assert Path(ranks[0]["latest"]).name in {"epoch=0-step=4.ckpt", "last.ckpt"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_fit_keeps_one_writer_and_queues_top_k_removals(
    runs: dict[str, tuple[Path, list[dict[str, Any]]]], kind: str
) -> None:
    _, ranks = runs[kind]
    # Saves at steps 2 and 4, each with last.ckpt (top-1: step 2's folder removed behind step
    # 4's save): one writer on the plugin's checkpointer for the whole fit on every rank;
    # FSDP2's DTensor state exchanges plan names from its second save on (FSDP1's
    # ShardedTensors never do).
    for r in ranks:
        kept, exchanged = r["run1_writer"]
        assert kept is True
        assert exchanged == (3 if kind == "model_parallel" else 0), (kind, exchanged)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_sharded_save_outside_fit_is_committed_when_it_returns(
    runs: dict[str, tuple[Path, list[dict[str, Any]]]], kind: str
) -> None:
    root, ranks = runs[kind]
    # trainer.save_checkpoint after fit: the folder is committed when the call returns, on
    # every rank, and nothing is left pending (as Lightning's own IO, and a single file)
    for r in ranks:
        assert r["a_on_return"] is True and r["b_on_return"] is True
        assert r["pending_after_b"] == 0 and r["b_status"] == "verified"
    assert stagesave.verify(str(root / "manual-a.ckpt")).status == "verified"


@pytest.mark.parametrize("kind", list(KINDS))
def test_ckpt_path_last_resumes_bitwise_and_folders_interoperate_with_lightning(
    runs: dict[str, tuple[Path, list[dict[str, Any]]]], kind: str
) -> None:
    _, ranks = runs[kind]
    for r in ranks:  # fingerprints are per rank: each rank's shards of model and optimizer state
        step4, step6 = r["run1_end"], r["run3_end"]
        assert step4[0] == 4 and step6[0] == 6
        # ckpt_path="last" through the staged strategy: every shard back, bit for bit.
        assert r["run2_start"] == step4
        # Lightning's own strategy reads the staged folder...
        assert r["run3_start"] == step4
        # ...and both resumed runs reach the same state at step 6.
        assert r["run2_end"] == step6
        # The staged strategy reads a plain Lightning folder (no proof) too.
        assert r["run4_start"] == step6
    assert ranks[0]["run1_end"] != ranks[1]["run1_end"]  # the ranks really hold different shards


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_changed_meta_pt_or_an_extra_file_makes_the_folder_corrupt(
    runs: dict[str, tuple[Path, list[dict[str, Any]]]], kind: str, tmp_path: Path
) -> None:
    root, _ = runs[kind]
    readers: list[Any] = []
    io = StagedCheckpointIO()

    # the strategy's load up to DCP (no process group here)
    def load(folder: Path) -> dict[str, Any]:
        return ShardedCheckpoints().load(io, str(folder), None, readers.append)

    # Intact: meta.pt loads, and the shards are read verified (the folder carries a proof)...
    assert load(root / "ckpt" / "epoch=0-step=4.ckpt")["global_step"] == 4
    assert readers[-1].verify is True
    # ...also through a link from another directory (the folder it names is checked)...
    (tmp_path / "elsewhere.ckpt").symlink_to(root / "ckpt" / "epoch=0-step=4.ckpt")
    assert load(tmp_path / "elsewhere.ckpt")["global_step"] == 4
    assert readers[-1].verify is True
    # ...a plain Lightning folder loads unverified (no proof to check against).
    assert load(root / "plain" / "epoch=0-step=6.ckpt")["global_step"] == 6
    assert readers[-1].verify is False

    changed = tmp_path / "changed"
    shutil.copytree(root / "ckpt" / "epoch=0-step=4.ckpt", changed)
    data = bytearray((changed / "meta.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksums the folder's proof lists tell
    (changed / "meta.pt").write_bytes(bytes(data))
    info = stagesave.verify(str(changed))
    assert info.status == "corrupt" and any("meta.pt" in p for p in info.problems), info.problems
    with pytest.raises(stagesave.IntegrityError, match=r"meta\.pt.*checksum mismatch"):
        load(changed)

    assert len(readers) == 3  # the corrupt folder never reached DCP

    extra = tmp_path / "extra"  # a file added beside: the user's, kept, not part of it
    shutil.copytree(root / "ckpt" / "epoch=0-step=4.ckpt", extra)
    (extra / "notes.txt").write_text("not part of the checkpoint")
    info = stagesave.verify(str(extra))
    assert (info.status, info.beside) == ("verified", ["notes.txt"]), info.problems
    assert load(extra)["global_step"] == 4
    assert readers[-1].verify is True
    io.teardown()


def test_model_parallel_full_checkpoints_are_single_files_through_the_plugin(
    runs: dict[str, tuple[Path, list[dict[str, Any]]]]
) -> None:
    root, ranks = runs["model_parallel"]
    path = root / "full" / "epoch=0-step=2.ckpt"
    assert path.is_file() and stagesave.verify(str(path)).status == "verified"
    assert torch.load(path, weights_only=True)["global_step"] == 2
    for r in ranks:
        assert r["full2_start"] == r["full1_end"] and r["full1_end"][0] == 2


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_failed_sharded_save_or_a_corrupt_folder_fails_on_every_rank(
    runs: dict[str, tuple[Path, list[dict[str, Any]]]], kind: str
) -> None:
    root, ranks = runs[kind]
    for r in ranks:
        # meta.pt could not be written: the save raised on both ranks, nothing was staged...
        assert r["c_error"][0] == "UnsupportedObjectError"
        assert "cannot save the value at hook (function)" in r["c_error"][1]
        # ...and a flipped byte in a committed folder stops the load on both ranks.
        assert r["corrupt_error"][0] == "IntegrityError"
        assert (
            "__1_0.distcp" in r["corrupt_error"][1] and "checksum mismatch" in r["corrupt_error"][1]
        )
    assert not (root / "manual-c.ckpt").exists()
    assert not [p for p in root.iterdir() if stagesave.is_temporary(p.name)]
    assert stagesave.verify(str(root / "manual-b.ckpt")).status == "corrupt"


@pytest.mark.gpu
def test_fsdp_auto_wrap_on_gpu_saves_and_resumes_sharded(tmp_path: Path) -> None:
    proc = run_python([str(HERE / "_child_sharded.py"), str(tmp_path), "fsdp-cuda"], timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads((tmp_path / "fsdp-cuda" / "rank0.json").read_text())
    assert r["run2_start"] == r["run1_end"] and r["run3_start"] == r["run1_end"]
    assert r["run2_end"] == r["run3_end"] and r["run4_start"] == r["run3_end"]
    assert r["c_error"][0] == "UnsupportedObjectError" and r["corrupt_error"][0] == "IntegrityError"
    assert (
        stagesave.verify(str(tmp_path / "fsdp-cuda" / "ckpt" / "epoch=0-step=4.ckpt")).status
        == "verified"
    )
