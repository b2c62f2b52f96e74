"""`export` and `adopt` on real checkpoints: stagesave files and folders (format 2 and 1), plain
torch files, a real Accelerate `save_state` folder, a real torch.distributed.checkpoint folder."""

from __future__ import annotations

import collections
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from clitools import small_state, write_checkpoints, write_dir_checkpoint, write_format1
from proofkit import flip_byte
from safetensors.torch import load_file, save_file

import stagesave


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def test_export_stagesave_file_is_a_verified_byte_copy(cli, tmp_path):
    (tmp_path / "ck").mkdir()
    src = write_checkpoints(tmp_path / "ck", steps=(4,))[0]
    out = tmp_path / "out.ckpt"
    r = cli("export", src, out)
    assert r.code == 0, r.err
    assert "torch file" in r.out
    assert out.read_bytes() == Path(src).read_bytes()
    loaded = torch.load(out, weights_only=False)
    assert _same(loaded, small_state(4))
    assert sorted(os.listdir(tmp_path)) == ["ck", "out.ckpt"]  # no manifest, no temporary
    copy = stagesave.verify(out)  # the copy proves itself
    assert copy.status == "verified" and copy.format == 2 and copy.manifest.metadata == {"step": 4}
    assert zipfile.ZipFile(out).testzip() is None


def test_export_format1_and_plain_files_are_byte_copies(cli, tmp_path):
    src, _ = write_format1(tmp_path, "old.ckpt", small_state(2))
    r = cli("export", src, tmp_path / "old-out.ckpt")
    assert r.code == 0, r.err
    assert (tmp_path / "old-out.ckpt").read_bytes() == Path(src).read_bytes()
    torch.save(small_state(3), tmp_path / "plain.pt")
    assert cli("export", tmp_path / "plain.pt", tmp_path / "plain-out.pt").code == 0
    assert (tmp_path / "plain-out.pt").read_bytes() == (tmp_path / "plain.pt").read_bytes()
    assert not any(".stagesave-tmp" in n for n in os.listdir(tmp_path))
    flip_byte(src, 500)  # checked against its sidecar on the way
    r = cli("export", src, tmp_path / "bad.ckpt")
    assert r.code == 1 and "checksum mismatch" in r.err and "nothing was exported" in r.err
    assert not (tmp_path / "bad.ckpt").exists()


def test_export_refuses_a_corrupt_file_and_writes_nothing(cli, tmp_path):
    (tmp_path / "ck").mkdir()
    src = write_checkpoints(tmp_path / "ck", steps=(4,), chunk_bytes=64 * 1024)[0]
    flip_byte(src, 100_000)
    r = cli("export", src, tmp_path / "out.ckpt")
    assert r.code == 1
    assert r.err == (
        f"stagesave: error: {src} is corrupt: checksum mismatch in bytes [65536, 131072) "
        "(chunk 1); nothing was exported\n"
    )
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_export_output_rules(cli, tmp_path):
    src = write_checkpoints(tmp_path, steps=(1,))[0]
    out = tmp_path / "out.ckpt"
    out.write_bytes(b"keep me")
    r = cli("export", src, out)
    assert r.code == 1 and "exists; pass --force" in r.err and out.read_bytes() == b"keep me"
    assert (
        cli("export", src, out, "--force").code == 0 and out.read_bytes() == Path(src).read_bytes()
    )
    r = cli("export", src, tmp_path / "no" / "out.ckpt")
    assert r.code == 1 and "does not exist" in r.err
    r = cli("export", tmp_path / "missing.ckpt", tmp_path / "x.ckpt")
    assert r.code == 1 and "no such file or folder" in r.err


def test_export_stagesave_folder(cli, tmp_path):
    d = write_dir_checkpoint(tmp_path)
    out = tmp_path / "merged.ckpt"
    assert cli("export", d, out).code == 0
    merged = torch.load(out, weights_only=False)
    state = small_state(3)
    assert set(merged) == {"model", "optimizer", "random_states_0"}
    on_disk = load_file(os.path.join(d, "model.safetensors"))
    assert set(merged["model"]) == set(on_disk) == set(state["model"])
    assert all(torch.equal(merged["model"][k], v) for k, v in state["model"].items())
    assert _same(merged["optimizer"], state["optimizer"])
    assert merged["random_states_0"]["step"] == 3
    info = stagesave.verify(
        out
    )  # a fresh file that carries its own proof, with the folder's metadata
    assert info.status == "verified" and info.format == 2 and info.manifest.metadata == {"step": 3}
    assert zipfile.ZipFile(out).testzip() is None
    flip_byte(os.path.join(d, "optimizer.bin"), 50)
    r = cli("export", d, tmp_path / "again.ckpt")
    assert r.code == 1 and "checksum mismatch" in r.err and not (tmp_path / "again.ckpt").exists()


def test_export_of_a_folder_leaves_out_the_files_beside_the_checkpoint(cli, tmp_path):
    d = write_dir_checkpoint(tmp_path)
    torch.save({"w": torch.full((4,), 666.0)}, os.path.join(d, "pytorch_model.bin"))  # the user's
    r = cli("export", d, tmp_path / "merged.ckpt")
    assert r.code == 0, r.err
    assert "not exported (beside the checkpoint, not part of it): pytorch_model.bin" in r.err
    merged = torch.load(tmp_path / "merged.ckpt", weights_only=False)
    assert set(merged) == {"model", "optimizer", "random_states_0"}
    state = small_state(3)
    assert all(torch.equal(merged["model"][k], v) for k, v in state["model"].items())


def test_export_one_file_of_a_folder_checkpoint(cli, tmp_path):
    """A file of a folder names its folder in its proof: exported, it becomes a checkpoint of its
    own."""
    d = write_dir_checkpoint(tmp_path)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "optimizer.ckpt"
    r = cli("export", os.path.join(d, "optimizer.bin"), out)
    assert r.code == 0, r.err
    assert _same(torch.load(out, weights_only=False), small_state(3)["optimizer"])
    info = stagesave.verify(out)
    assert info.status == "verified" and info.format == 2 and info.manifest.folder is None
    assert [(r["name"], r["status"]) for r in cli("ls", tmp_path / "out", "--json").json()] == [
        ("optimizer.ckpt", "committed")]


def test_export_real_accelerate_save_state(cli, tmp_path):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.backward(model(torch.randn(4, 16)).sum())
    opt.step()
    sched.step()
    acc.save_state(str(tmp_path / "acc"))
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin"} <= set(
        os.listdir(tmp_path / "acc")
    )
    out = tmp_path / "acc.ckpt"
    r = cli("export", tmp_path / "acc", out)
    assert r.code == 0, r.err
    assert "Accelerate folder" in r.out
    merged = torch.load(out, weights_only=False)
    assert {"model", "optimizer", "scheduler", "random_states_0"} <= set(merged)
    assert set(merged["model"]) == set(model.state_dict())
    assert all(torch.equal(merged["model"][k], v) for k, v in model.state_dict().items())
    assert _same(merged["optimizer"], opt.state_dict())
    assert merged["scheduler"]["last_epoch"] == sched.state_dict()["last_epoch"]


def test_export_safetensors_file(cli, tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    assert cli("export", tmp_path / "w.safetensors", tmp_path / "w.ckpt").code == 0
    assert _same(torch.load(tmp_path / "w.ckpt"), dict(sorted(tensors.items())))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_export_dcp_folder_needs_trust(cli, tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(4, 4)}, "step": 3}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    r = cli("export", tmp_path / "dcp", tmp_path / "dcp.ckpt")
    assert r.code == 1 and "pass --trusted" in r.err and not (tmp_path / "dcp.ckpt").exists()
    assert cli("export", tmp_path / "dcp", tmp_path / "dcp.ckpt", "--trusted").code == 0
    assert _same(torch.load(tmp_path / "dcp.ckpt", weights_only=False), state)


def test_export_unknown_layout(cli, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("hello")
    r = cli("export", tmp_path / "junk", tmp_path / "x.ckpt")
    assert r.code == 1 and "not a checkpoint layout export knows" in r.err


def test_adopt_plain_file_then_verify_catches_corruption(cli, tmp_path):
    path = tmp_path / "plain.ckpt"
    state = small_state(9)
    torch.save(state, path)
    before = path.read_bytes()
    r = cli("adopt", path, "--chunk-bytes", 16384)
    assert r.code == 0, r.err
    assert "committed" in r.out
    assert path.read_bytes() == before  # the data file is not touched
    info = stagesave.verify(path)
    assert info.status == "verified"
    entry = info.manifest.files[0]
    assert entry.chunk_bytes == 16384 and len(entry.chunks) == -(-len(before) // 16384)
    reader = torch._C.PyTorchFileReader(str(path))
    assert entry.serialization_id == reader.serialization_id()
    assert _same(stagesave.load(path), state)
    assert {t["name"] for t in info.manifest.tensors} >= {
        "model.0.weight",
        "optimizer.state.0.exp_avg",
    }
    r = cli("adopt", path)
    assert r.code == 0 and "already has a matching manifest" in r.out
    flip_byte(str(path), len(before) // 2)
    r = cli("verify", path)
    assert r.code == 1 and "checksum mismatch" in r.err


def test_adopt_legacy_and_safetensors_files(cli, tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(10)}, legacy, _use_new_zipfile_serialization=False)
    assert cli("adopt", legacy).code == 0
    info = stagesave.verify(legacy)
    assert info.status == "verified" and info.manifest.files[0].serialization_id is None
    st = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(8, 8)}, str(st))
    assert cli("adopt", st, "--checksum", "sha256").code == 0
    info = stagesave.verify(st)
    assert info.status == "verified" and info.manifest.files[0].kind == "safetensors"
    assert info.manifest.files[0].algorithm == "sha256"
    assert info.manifest.tensors == [{"name": "w", "dtype": "float32", "shape": [8, 8]}]


def test_adopt_refuses_what_it_cannot_certify(cli, tmp_path):
    (tmp_path / "notes.bin").write_bytes(b"hello world, not a checkpoint at all")
    r = cli("adopt", tmp_path / "notes.bin")
    assert r.code == 1 and "neither a torch file nor a safetensors file" in r.err
    assert not any(n.endswith(".stagesave.json") for n in os.listdir(tmp_path))
    r = cli("adopt", tmp_path)
    assert r.code == 1 and "is a folder" in r.err


def test_adopt_over_a_mismatching_manifest_needs_force(cli, tmp_path):
    path, _ = write_format1(tmp_path, "old.ckpt", small_state(1))
    torch.save(
        small_state(2), path
    )  # replaced behind stagesave's back: the manifest no longer matches
    r = cli("adopt", path)
    assert r.code == 1 and "pass --force" in r.err
    assert cli("adopt", path, "--force").code == 0
    manifests = [n for n in os.listdir(tmp_path) if n.endswith(".stagesave.json")]
    assert len(manifests) == 1
    assert stagesave.verify(path).status == "verified"


def test_adopt_refuses_a_file_that_carries_its_own_proof(cli, tmp_path):
    path = write_checkpoints(tmp_path, steps=(1,))[0]
    before = sorted(os.listdir(tmp_path))
    r = cli("adopt", path)
    assert r.code == 1
    assert r.err == (
        f"stagesave: error: {path} already carries its own stagesave proof (format 2, seq 1): "
        "adopt is for files stagesave did not write; `stagesave verify` checks this one\n"
    )
    flip_byte(path, stagesave.verify(path).manifest.files[0].end + 200)  # damage its proof records
    r = cli("adopt", path, "--force")
    assert (
        r.code == 1
        and "carries a stagesave proof of its own (format 2) that does not check out" in r.err
    )
    assert sorted(os.listdir(tmp_path)) == before  # no sidecar written


def test_adopt_refuses_a_file_inside_a_proven_folder(cli, tmp_path):
    d = write_dir_checkpoint(tmp_path)
    torch.save(
        {"w": torch.ones(2)}, os.path.join(d, "extra.pt")
    )  # makes the folder invalid already
    r = cli("adopt", os.path.join(d, "extra.pt"))
    assert r.code == 1 and "is a file of a folder checkpoint proven by" in r.err
    assert not any(n.endswith(".stagesave.json") for n in os.listdir(d))


class Hyper(collections.namedtuple("Hyper", "lr")):
    """A class off the safe allow-list, as a Lightning checkpoint's hyper-parameters may be."""


def test_adopt_file_needing_unsafe_globals_skips_only_the_index(cli, tmp_path):
    path = tmp_path / "lightning.ckpt"
    torch.save({"state_dict": {"w": torch.ones(3)}, "hyper": Hyper(0.1)}, path)
    r = cli("adopt", path)
    assert r.code == 0 and "tensor index is left out" in r.err
    info = stagesave.verify(path)
    assert info.status == "verified" and info.manifest.tensors == []


def test_adopt_trusted_indexes_unsafe_files(cli, tmp_path):
    path = tmp_path / "lightning.ckpt"
    torch.save({"state_dict": {"w": torch.ones(3)}, "hyper": Hyper(0.1)}, path)
    assert cli("adopt", path, "--trusted").code == 0
    assert stagesave.verify(path).manifest.tensors == [
        {"name": "state_dict.w", "dtype": "float32", "shape": [3]}
    ]


def test_export_stagesave_sharded_folder_is_verified_and_needs_no_trust(cli, tmp_path):
    import stagesave.dcp

    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}
    handle = stagesave.dcp.save(state, tmp_path / "sharded")
    handle.result(timeout=120)
    r = cli("export", tmp_path / "sharded", tmp_path / "one.ckpt")
    assert r.code == 0, r.err
    out = torch.load(tmp_path / "one.ckpt", weights_only=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
