"""The folder stagesave writes is the folder Accelerate's own save_state writes, file for file."""

from __future__ import annotations

import json
import os

import pytest
import stagesave.accelerate as sa
import torch
from accel_helpers import MANIFEST, assert_same, build, load_file_content, train
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

    theirs = sorted(os.listdir(plain))
    ours = sorted(os.listdir(staged))
    assert ours == sorted([*theirs, MANIFEST])
    model_files = ["model.safetensors", "model_1.safetensors"] if safe else ["pytorch_model.bin", "pytorch_model_1.bin"]
    assert theirs == sorted([
        *model_files, "optimizer.bin", "optimizer_1.bin", "scheduler.bin", "scheduler_1.bin",
        "scaler.pt", "random_states_0.pkl", "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl",
    ])
    for name in theirs:
        assert_same(load_file_content(os.path.join(plain, name)), load_file_content(os.path.join(staged, name)), name)
    info = stagesave.verify(staged)
    assert info.status == "verified" and info.is_dir
    assert sorted(f.name for f in info.manifest.files) == theirs


def test_same_folder_through_device_staging(tmp_path, monkeypatch):
    """``device_staging=True``: the same files, staged through the device path (host memory
    standing in for the GPU, which this machine does not have) and written by its writer."""
    import stagesave.checkpointer as checkpointer_mod
    from stagesave._local import LocalStore

    monkeypatch.setattr(checkpointer_mod, "device_of",
                        lambda images, store: torch.device("cpu") if isinstance(store, LocalStore) else None)
    monkeypatch.setattr(checkpointer_mod, "gpudirect_kvikio", lambda: None)
    assert _device_staged_like_accelerate(tmp_path, Accelerator(cpu=True)).staged_on == "cpu"


def _device_staged_like_accelerate(tmp_path, acc):
    """Train a little, save with Accelerate and with device staging: the same files; the telemetry."""
    run = build(acc)
    train(acc, run, 2)
    plain = str(tmp_path / "plain")
    Accelerator.save_state(acc, plain)
    ckpt = sa.AcceleratorCheckpointer(acc, device_staging=True)
    tel = ckpt.save_state(str(tmp_path / "staged")).result()
    ckpt.close()
    theirs = sorted(os.listdir(plain))
    assert sorted(os.listdir(tmp_path / "staged")) == sorted([*theirs, MANIFEST])
    for name in theirs:
        assert_same(load_file_content(os.path.join(plain, name)),
                    load_file_content(str(tmp_path / "staged" / name)), name)
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
    assert ours["metadata"] == {"format": "pt"}


def test_manifest_records_iteration_and_step(tmp_path):
    acc = Accelerator(cpu=True)
    build(acc)
    ckpt = sa.AcceleratorCheckpointer(acc)
    ckpt.save_state(str(tmp_path / "a")).result()
    ckpt.save_state(str(tmp_path / "b")).result()
    ckpt.close()
    with open(tmp_path / "b" / MANIFEST) as f:
        meta = json.load(f)["metadata"]["accelerate"]
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
        save_file({"w": weights[0]["head.weight"].clone()}, os.path.join(output_dir, "extra", "head.safetensors"),
                  metadata={"kind": "head"})
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
    info = stagesave.verify(staged)
    assert info.status == "verified"
    assert sorted(f.name for f in info.manifest.files if "/" in f.name or f.name == "config.json") == hook_files


@pytest.mark.gpu
def test_same_folder_through_device_staging_on_a_gpu(tmp_path):
    assert _device_staged_like_accelerate(tmp_path, Accelerator()).staged_on.startswith("cuda")
