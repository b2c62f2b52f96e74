"""One file of a folder checkpoint, or a sub-folder of one, named to the CLI on its own; and a
folder checkpoint given to ``ls`` as a root."""

from __future__ import annotations

import os
import shutil
import warnings

import torch
from clitools import write_checkpoints, write_format1_dir

import stagesave
from stagesave.formats import Safetensors


def _folder(tmp_path) -> str:
    with stagesave.Checkpointer(tmp_path) as ck:
        ck.save_dir(
            {
                "model.safetensors": Safetensors({"w": torch.arange(6.0).reshape(2, 3)}),
                "optimizer.bin": {"exp_avg": torch.zeros(5), "step": 3},
                "sub/rng.pth": {"seed": torch.tensor([7, 8])},
            },
            "ckpt",
            metadata={"step": 3},
        ).result()
    return os.path.join(str(tmp_path), "ckpt")


def test_inspect_each_file_of_a_folder_checkpoint(cli, tmp_path):
    d = _folder(tmp_path)
    expected = {
        "optimizer.bin": ("carrier", {"exp_avg": ([5], "float32")}),
        "model.safetensors": ("member", {"w": ([2, 3], "float32")}),
        "sub/rng.pth": ("member", {"seed": ([2], "int64")}),
    }
    for name, (role, tensors) in expected.items():
        r = cli("inspect", os.path.join(d, name), "--json")
        assert r.code == 0, r.err
        doc = r.json()
        assert doc["status"] == "committed" and doc["problems"] == [], name
        assert doc["part_of"] == d and doc["carrier"] == "optimizer.bin"
        assert [f["role"] for f in doc["files"]] == [role]
        assert [f["name"] for f in doc["files"]] == [os.path.basename(name)]
        assert {t["name"]: (t["shape"], t["dtype"]) for t in doc["tensors"]} == tensors
    r = cli("inspect", os.path.join(d, "sub", "rng.pth"))
    assert r.code == 0
    text = " ".join(r.out.split())
    assert f"part of the folder checkpoint {d}/, as a member (carrier optimizer.bin)" in text


def test_inspect_a_member_whose_folder_lost_its_carrier(cli, tmp_path):
    d = _folder(tmp_path)
    os.remove(os.path.join(d, "optimizer.bin"))
    r = cli("inspect", os.path.join(d, "model.safetensors"))
    assert r.code == 0
    text = " ".join(r.out.split())
    assert "part of a folder checkpoint (its carrier optimizer.bin was not found above it)" in text
    r = cli("inspect", d)
    assert r.code == 1
    assert "its carrier optimizer.bin is missing or damaged" in r.err


def test_a_sub_folder_of_a_folder_checkpoint_is_not_a_corrupt_checkpoint(cli, tmp_path):
    d = _folder(tmp_path)
    doc = cli("inspect", os.path.join(d, "sub"), "--json").json()
    assert doc["status"] == "unverified"
    assert doc["problems"] == [
        f"not a checkpoint of its own: its files belong to the folder checkpoint {d}/"
    ]
    # the core's listing of the folder as a root: no corrupt checkpoint, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with stagesave.Checkpointer(d) as ck:
            assert ck.list() == []
            assert ck.latest() is None


def test_ls_of_a_folder_checkpoint_lists_it(cli, tmp_path):
    d = _folder(tmp_path)
    rows = cli("ls", d, "--json").json()
    assert [(r["name"], r["status"], r["folder"], r["seq"], r["step"]) for r in rows] == [
        (d, "committed", True, 1, 3)
    ]
    r = cli("ls", d)
    assert r.code == 0 and f"{d}/" in r.out and "corrupt" not in r.out
    # its parent lists it as before
    rows = cli("ls", str(tmp_path), "--json").json()
    assert [(r["name"], r["status"]) for r in rows] == [("ckpt", "committed")]


def test_ls_of_a_format1_folder_checkpoint_lists_it(cli, tmp_path):
    d = write_format1_dir(tmp_path)
    rows = cli("ls", d, "--json").json()
    assert [(r["name"], r["status"], r["folder"], r["format"]) for r in rows] == [
        (d, "committed", True, 1)
    ]


def test_ls_of_a_root_of_checkpoints_is_unchanged(cli, tmp_path):
    write_checkpoints(tmp_path, steps=(1, 2))
    _folder(tmp_path)
    rows = cli("ls", str(tmp_path), "--json").json()
    assert [(r["name"], r["status"]) for r in rows] == [
        ("ckpt", "committed"), ("step=2.ckpt", "committed"), ("step=1.ckpt", "committed")
    ]


def test_ls_and_verify_of_a_sub_folder_name_the_checkpoint_it_belongs_to(cli, tmp_path):
    d = _folder(tmp_path)
    sub = os.path.join(d, "sub")
    r = cli("ls", sub)
    assert r.code == 0 and "corrupt" not in r.out
    assert " ".join(r.out.split()) == (
        f"{sub} is not a checkpoint of its own: its files belong to the folder checkpoint {d}/ "
        f"(`stagesave inspect {d}` shows it)"
    )
    assert cli("ls", sub, "--json").json() == []
    r = cli("verify", sub)
    assert r.code != 0 and "CORRUPT" not in r.out
    assert f"is not a checkpoint of its own: its files belong to the folder checkpoint {d}/" in (
        r.err)
    # a folder that lost its carrier is corrupt, as before
    os.remove(os.path.join(d, "optimizer.bin"))
    r = cli("verify", d)
    assert r.code == 1 and "its carrier optimizer.bin is missing or damaged" in r.out


def test_a_stray_copy_at_the_top_of_a_root_hides_no_checkpoint(cli, tmp_path):
    """A member or a carrier copied by hand to the top of a root: every checkpoint of the root is
    still listed, and the root is a corrupt folder checkpoint of its own (its files name a
    folder that is not whole there)."""
    root = tmp_path / "run"
    with stagesave.Checkpointer(root) as ck:
        for step in (1, 2):
            ck.save_dir({"model.safetensors": Safetensors({"w": torch.ones(2) * step}),
                         "optimizer.bin": {"step": step}}, f"step_{step}").result()
        ck.save({"a": torch.ones(2)}, "x.ckpt").result()
    expected = [("x.ckpt", "committed"), ("step_2", "committed"), ("step_1", "committed")]
    shutil.copy(root / "step_2" / "model.safetensors", root / "model.safetensors")
    rows = cli("ls", root, "--json").json()
    assert [(r["name"], r["status"]) for r in rows if r["name"] != str(root)] == expected
    [whole] = [r for r in rows if r["name"] == str(root)]
    assert whole["status"] == "corrupt"
    assert whole["problems"] == [f"{root}/: its carrier optimizer.bin is missing or damaged"]
    shutil.copy(root / "step_2" / "optimizer.bin", root / "optimizer.bin")
    os.remove(root / "model.safetensors")
    rows = cli("ls", root, "--json").json()
    assert [(r["name"], r["status"]) for r in rows if r["name"] != str(root)] == expected
    [whole] = [r for r in rows if r["name"] == str(root)]
    assert whole["status"] == "corrupt"
    assert whole["problems"] == [f"{root}/model.safetensors is missing"]
    r = cli("verify", root)
    assert r.code == 1 and r.out.count("\nOK ") + r.out.startswith("OK ") == 3


def test_a_run_folder_holding_a_final_model_and_checkpoints_lists_and_verifies_both(cli, tmp_path):
    """The layout of a trainer that saves its final model at the top of its output folder,
    beside its checkpoints: the folder is a checkpoint, and so is each one beside its files."""
    root = tmp_path / "out"
    with stagesave.Checkpointer(tmp_path) as ck:
        ck.save_dir({"model.safetensors": Safetensors({"w": torch.ones(2)}),
                     "optimizer.bin": {"step": 500}}, "out/checkpoint-500").result()
        ck.save_dir({"model.safetensors": Safetensors({"w": torch.zeros(2)}),
                     "optimizer.bin": {"step": 900}}, str(root)).result()
    (root / "training_args.txt").write_text("lr=1e-3")  # the user's, beside
    rows = cli("ls", root, "--json").json()
    assert [(r["name"], r["status"]) for r in rows] == [
        (str(root), "committed"), ("checkpoint-500", "committed")]
    assert cli("verify", root).code == 0
    opt = root / "checkpoint-500" / "optimizer.bin"
    data = bytearray(opt.read_bytes())
    data[100] ^= 0xFF
    opt.write_bytes(bytes(data))
    r = cli("verify", root)
    assert r.code == 1 and f"CORRUPT    {root}/checkpoint-500" in r.out
    assert f"OK         {root}\n" in r.out


def test_a_fifo_named_like_a_carrier_above_a_member_hangs_nothing(cli, tmp_path):
    d = _folder(tmp_path / "a" / "b")
    os.mkfifo(tmp_path / "optimizer.bin")  # two folders above ckpt/: a reader would block on it
    os.mkfifo(tmp_path / "a" / "x.ckpt")
    doc = cli("inspect", os.path.join(d, "model.safetensors"), "--json").json()
    assert doc["part_of"] == d
    assert cli("ls", tmp_path / "a", "--json").json() == []


def test_a_sub_folder_two_levels_down_belongs_to_the_checkpoint_above(cli, tmp_path):
    with stagesave.Checkpointer(tmp_path) as ck:
        ck.save_dir({"optimizer.bin": {"a": torch.ones(2)}, "sub/opt2.bin": {"b": torch.ones(2)},
                     "sub/deeper/m.safetensors": Safetensors({"w": torch.ones(2)})},
                    "ckpt").result()
    d = tmp_path / "ckpt"
    assert cli("verify", d).code == 0
    r = cli("ls", d / "sub")
    assert r.code == 0 and "is not a checkpoint of its own" in r.out and "deeper" not in r.out
    r = cli("verify", d / "sub")
    assert "CORRUPT" not in r.out and "is not a checkpoint of its own" in r.err


def test_verify_checks_a_folders_nested_parts_and_torn_saves_beside_a_root_checkpoint(
        cli, tmp_path):
    """A folder saved with ``nested`` parts (an FSDP checkpoint's DCP folders, each a folder
    checkpoint of its own): a damaged part fails the folder's verify and its root's."""
    with stagesave.Checkpointer(tmp_path) as ck:
        ck.save_dir({"optimizer.bin": {"t": torch.zeros(300)}}, "ckpt", nested=["part"]).result()
        ck.save_dir({"shard.safetensors": Safetensors({"w": torch.ones(1000)}),
                     "meta.bin": {"k": torch.zeros(3)}}, "tmp_part").result()
    os.rename(tmp_path / "tmp_part", tmp_path / "ckpt" / "part")
    assert cli("verify", tmp_path / "ckpt").code == 0
    shard = tmp_path / "ckpt" / "part" / "shard.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    for where in (tmp_path / "ckpt", tmp_path):
        r = cli("verify", where)
        assert r.code == 1 and f"CORRUPT    {tmp_path}/ckpt/part\n" in r.out, where
    # a torn save beside a folder checkpoint at the top of a run's folder: --strict fails
    (tmp_path / "ckpt" / ".step_9.999999-0123abcd.stagesave-tmp").mkdir()
    ((tmp_path / "ckpt" / ".step_9.999999-0123abcd.stagesave-tmp" / "optimizer.bin")
     .write_bytes(b"x" * 100))
    r = cli("verify", "--strict", tmp_path / "ckpt")
    assert r.code == 1 and f"TORN       {tmp_path}/ckpt/step_9" in r.out
