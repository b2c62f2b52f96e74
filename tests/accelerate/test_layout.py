"""The folder stagesave writes is the folder Accelerate's own save_state writes, file for file:
the same names (nothing beside them: every file carries its own proof), the same contents, and
only the ``stagesave.proof`` key added to ``model.safetensors``'s metadata."""

from __future__ import annotations

import json
import os

import pytest
import stagesave.accelerate as sa
import torch
from accel_helpers import (
    PROOF_KEY,
    assert_real_zips,
    assert_same,
    build,
    load_file_content,
    safetensors_metadata,
    train,
    tree,
)
from accelerate import Accelerator

import stagesave


def _accelerate_and_stagesave(tmp_path, accelerator, safe):
    """Save the same moment twice: Accelerate's own method, then stagesave's."""
    plain = str(tmp_path / "plain")
    staged = str(tmp_path / "staged")
    Accelerator.save_state(accelerator, plain, safe_serialization=safe)
    ckpt = sa.AcceleratorCheckpointer(accelerator)
    handle = ckpt.save_state(staged, safe_serialization=safe)
    handle.result()
    ckpt.close()
    return plain, staged


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "torch-bin"])
def test_same_files_and_contents_as_accelerate(tmp_path, safe):
    acc = Accelerator(cpu=True)
    run = build(acc, n_models=2)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    train(acc, run, 3)
    plain, staged = _accelerate_and_stagesave(tmp_path, acc, safe)

    theirs = tree(plain)
    assert tree(staged) == theirs  # exactly Accelerate's files: no manifest beside them
    model_files = (
        ["model.safetensors", "model_1.safetensors"]
        if safe
        else ["pytorch_model.bin", "pytorch_model_1.bin"]
    )
    assert theirs == sorted([
        *model_files, "optimizer.bin", "optimizer_1.bin", "scheduler.bin", "scheduler_1.bin",
        "scaler.pt", "random_states_0.pkl", "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl",
    ])
    for name in theirs:
        assert_same(
            load_file_content(os.path.join(plain, name)),
            load_file_content(os.path.join(staged, name)),
            name,
        )
    if safe:  # Accelerate's metadata kept; the proof is the one key added
        for name in model_files:
            assert safetensors_metadata(os.path.join(plain, name)) == {"format": "pt"}
            ours = safetensors_metadata(os.path.join(staged, name))
            assert sorted(ours) == ["format", PROOF_KEY] and ours["format"] == "pt"
    # every torch file is a real zip (each record's CRC-32 right), proof records included
    assert assert_real_zips(staged) == sorted(n for n in theirs if not n.endswith(".safetensors"))
    info = stagesave.verify(staged)
    assert info.status == "verified" and info.is_dir and info.format == 2
    folder = info.manifest.folder
    assert sorted(folder.names()) == theirs  # the carrier's proof names every file of the folder
    assert folder.carrier.endswith((".bin", ".pt", ".pkl"))  # a torch file carries it


def test_same_folder_through_device_staging(tmp_path, monkeypatch):
    """``device_staging=True``: the same files, staged through the device path (host memory
    standing in for the GPU, which this machine does not have) and written by its writer."""
    import stagesave.saving.stage_device as device_mod  # device staging without a GPU
    import stagesave.saving.staging as staging_mod
    from stagesave.stores.local import LocalStore

    monkeypatch.setattr(
        staging_mod,
        "device_of",
        lambda images, store: torch.device("cpu") if isinstance(store, LocalStore) else None,
    )
    monkeypatch.setattr(device_mod, "gpudirect_kvikio", lambda: None)
    assert _device_staged_like_accelerate(tmp_path, Accelerator(cpu=True)).staged_on == "cpu"


def _device_staged_like_accelerate(tmp_path, acc):
    """Train a little, save with Accelerate and with device staging: the same files; the
    telemetry."""
    run = build(acc)
    train(acc, run, 2)
    plain = str(tmp_path / "plain")
    Accelerator.save_state(acc, plain)
    ckpt = sa.AcceleratorCheckpointer(acc, device_staging=True)
    tel = ckpt.save_state(str(tmp_path / "staged")).result()
    ckpt.close()
    theirs = tree(plain)
    assert tree(str(tmp_path / "staged")) == theirs
    for name in theirs:
        assert_same(load_file_content(os.path.join(plain, name)),
                    load_file_content(str(tmp_path / "staged" / name)), name)
    assert assert_real_zips(str(tmp_path / "staged")) == sorted(
        n for n in theirs if not n.endswith(".safetensors")
    )
    assert stagesave.verify(tmp_path / "staged").status == "verified"
    return tel


def test_tied_weights_are_saved_once_as_accelerate_does(tmp_path):
    acc = Accelerator(cpu=True)
    run = build(acc)
    train(acc, run, 1)
    plain, staged = _accelerate_and_stagesave(tmp_path, acc, True)
    ours = load_file_content(os.path.join(staged, "model.safetensors"))
    theirs = load_file_content(os.path.join(plain, "model.safetensors"))
    assert sorted(ours["tensors"]) == sorted(theirs["tensors"])
    assert "out.weight" not in ours["tensors"] and "inp.weight" in ours["tensors"]
    assert ours["metadata"] == theirs["metadata"] == {"format": "pt"}
    raw = safetensors_metadata(os.path.join(staged, "model.safetensors"))
    assert sorted(raw) == ["format", PROOF_KEY]


def test_accelerate_and_safetensors_read_stagesave_files_unchanged(tmp_path):
    """safetensors' own loader and Accelerate's own load_state read what stagesave wrote."""
    from safetensors.torch import load_file

    acc = Accelerator(cpu=True)
    run = build(acc)
    train(acc, run, 2)
    plain, staged = _accelerate_and_stagesave(tmp_path, acc, True)
    ours, theirs = (
        load_file(os.path.join(staged, "model.safetensors")),
        load_file(os.path.join(plain, "model.safetensors")),
    )
    assert_same(dict(sorted(theirs.items())), dict(sorted(ours.items())), "model.safetensors")
    for name in ("optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl"):
        assert_same(torch.load(os.path.join(plain, name), weights_only=True),
                    torch.load(os.path.join(staged, name), weights_only=True), name)
    expected = {k: v.clone() for k, v in run["models"][0].state_dict().items()}
    train(acc, run, 2)
    Accelerator.load_state(acc, staged)  # Accelerate's own method, stagesave not involved
    assert_same(expected, dict(run["models"][0].state_dict()), "model")


def test_proof_records_iteration_and_step(tmp_path):
    acc = Accelerator(cpu=True)
    build(acc)
    ckpt = sa.AcceleratorCheckpointer(acc)
    ckpt.save_state(str(tmp_path / "a")).result()
    ckpt.save_state(str(tmp_path / "b")).result()
    ckpt.close()
    info = stagesave.verify(tmp_path / "b")
    assert info.status == "verified"
    # recorded by the carrier's proof
    assert info.manifest.folder.carrier in os.listdir(tmp_path / "b")
    meta = info.manifest.metadata["accelerate"]
    assert meta == {"iteration": 1, "step": 0, "num_processes": 1, "safe_serialization": True,
                    "automatic_checkpoint_naming": False}
    assert acc.project_configuration.iteration == 2


def test_save_pre_hook_files_are_carried_verbatim_and_weights_it_took_are_not_saved(tmp_path):
    acc = Accelerator(cpu=True)
    run = build(acc)
    train(acc, run, 1)
    seen = []

    def hook(models, weights, output_dir):
        # What a save_pretrained-style hook does: config, tokenizer files, the weights it took.
        seen.append((os.path.basename(output_dir), os.path.isdir(output_dir)))
        from safetensors.torch import save_file

        os.makedirs(os.path.join(output_dir, "extra", "tokenizer"), exist_ok=True)
        save_file(
            {"w": weights[0]["head.weight"].clone()},
            os.path.join(output_dir, "extra", "head.safetensors"),
            metadata={"kind": "head"},
        )
        with open(os.path.join(output_dir, "config.json"), "w") as f:
            json.dump({"hidden": 16, "tied": True}, f)
        with open(os.path.join(output_dir, "extra", "tokenizer", "vocab.txt"), "wb") as f:
            f.write(bytes(range(256)) * 3)  # arbitrary bytes, not text
        weights.pop(0)  # the hook saved the model itself, as Accelerate allows

    acc.register_save_state_pre_hook(hook)
    plain, staged = _accelerate_and_stagesave(tmp_path, acc, True)
    assert seen == [("plain", True), ("staged", True)]  # a scratch folder of the same name
    hook_files = ["config.json", "extra/head.safetensors", "extra/tokenizer/vocab.txt"]
    for rel in hook_files:  # byte for byte what the hook wrote under Accelerate's own save_state
        with open(os.path.join(plain, rel), "rb") as a, open(os.path.join(staged, rel), "rb") as b:
            assert a.read() == b.read(), rel
    assert "model.safetensors" not in os.listdir(staged)
    assert tree(staged) == tree(plain)
    info = stagesave.verify(staged)
    assert info.status == "verified"
    # listed by the folder's proof as raw files, with their sizes and chunk checksums
    listed = {e.name: e for e in info.manifest.folder.listed}
    assert sorted(listed) == hook_files
    for rel in hook_files:
        assert listed[rel].kind == "raw" and listed[rel].size == os.path.getsize(
            os.path.join(staged, rel)
        )
    # a hook file that changes afterwards is caught
    with open(os.path.join(staged, "extra", "tokenizer", "vocab.txt"), "r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    bad = stagesave.verify(staged)
    assert bad.status == "corrupt" and any("vocab.txt" in p for p in bad.problems), bad.problems


@pytest.mark.gpu
def test_same_folder_through_device_staging_on_a_gpu(tmp_path):
    assert _device_staged_like_accelerate(tmp_path, Accelerator()).staged_on.startswith("cuda")


def _automatic_run(project, *, stagesave_on: bool, hook: bool, saves: int = 5) -> None:
    """A run with automatic naming and ``total_limit=2`` saving ``saves`` times (seeded: the
    same states with and without stagesave)."""
    import random

    import numpy as np
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    random.seed(0)
    np.random.seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=2))
    run = build(acc, n_models=2, seed=0)
    if hook:
        def save_pretrained_like(models, weights, output_dir):
            # a hook writing into a sub-folder, as save_pretrained of a sub-model does
            os.makedirs(os.path.join(output_dir, "tokenizer"), exist_ok=True)
            with open(os.path.join(output_dir, "tokenizer", "vocab.json"), "w") as f:
                json.dump({"a": 0, "b": 1}, f)
            with open(os.path.join(output_dir, "config.json"), "w") as f:
                json.dump({"hidden": 16}, f)

        acc.register_save_state_pre_hook(save_pretrained_like)
    ckpt = sa.enable(acc) if stagesave_on else None
    for _ in range(saves):
        train(acc, run, 1)
        acc.save_state()
    if ckpt is not None:
        sa.disable(acc)  # waits for every commit


@pytest.mark.parametrize(
    "hook", [False, True], ids=["accelerate-files", "with-a-save-hook-writing-a-sub-folder"]
)
def test_automatic_naming_with_total_limit_lists_exactly_what_plain_accelerate_lists(
    tmp_path, hook
):
    """Issue 16, must show: the checkpoints directory of a run with automatic naming and
    ``total_limit`` holds exactly what plain Accelerate's holds (every file and folder,
    recursively), and every torch file there is a zip that ``testzip()`` passes."""
    _automatic_run(tmp_path / "plain", stagesave_on=False, hook=hook)
    _automatic_run(tmp_path / "staged", stagesave_on=True, hook=hook)
    theirs, ours = tmp_path / "plain" / "checkpoints", tmp_path / "staged" / "checkpoints"
    assert tree(str(ours)) == tree(str(theirs))
    assert sorted(os.listdir(theirs)) == ["checkpoint_3", "checkpoint_4"]
    # nothing of stagesave's beside checkpoints/ either (folders are assembled beside their target)
    assert (
        sorted(os.listdir(tmp_path / "staged"))
        == sorted(os.listdir(tmp_path / "plain"))
        == ["checkpoints"]
    )
    per_folder = [
        "custom_checkpoint_0.pkl",
        "custom_checkpoint_1.pkl",
        "optimizer.bin",
        "optimizer_1.bin",
        "random_states_0.pkl",
        "scheduler.bin",
        "scheduler_1.bin",
    ]
    assert assert_real_zips(str(ours)) == [
        f"{c}/{n}" for c in ("checkpoint_3", "checkpoint_4") for n in per_folder
    ]
    for rel in tree(str(theirs)):  # the same states, file by file
        if not rel.endswith("/"):
            if rel.endswith(".json"):
                assert (theirs / rel).read_bytes() == (ours / rel).read_bytes(), rel
            else:
                assert_same(
                    load_file_content(str(theirs / rel)), load_file_content(str(ours / rel)), rel
                )
    for name in ("checkpoint_3", "checkpoint_4"):
        assert stagesave.verify(ours / name).status == "verified"
