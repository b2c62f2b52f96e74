"""`ls`, `inspect`, `verify` on real checkpoints written by the core (local)."""

from __future__ import annotations

import json
import os

import torch
from clitools import flip_byte, small_state, write_checkpoints, write_dir_checkpoint

import stagesave


def test_ls_lists_newest_first_with_status_step_size_tier(cli, tmp_path):
    write_checkpoints(tmp_path)
    write_dir_checkpoint(tmp_path)
    torch.save(small_state(5), tmp_path / "plain.pt")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    rows = cli("ls", tmp_path, "--json").json()
    names = [r["name"] for r in rows]
    assert names == ["plain.pt", "checkpoint_3", "step=30.ckpt", "step=20.ckpt", "step=10.ckpt"]
    by = {r["name"]: r for r in rows}
    assert by["step=20.ckpt"]["status"] == "committed" and by["step=20.ckpt"]["step"] == 20
    assert by["step=20.ckpt"]["size"] == os.path.getsize(tmp_path / "step=20.ckpt")
    assert by["step=20.ckpt"]["tier"] == "local"
    assert by["checkpoint_3"]["folder"] and by["checkpoint_3"]["status"] == "committed" and by["checkpoint_3"]["step"] == 3
    assert by["plain.pt"]["status"] == "unverified"
    text = cli("ls", tmp_path).out
    assert "step=30.ckpt" in text and "checkpoint_3/" in text and "committed" in text and "notes.txt" not in text


def test_ls_shows_corrupt_and_torn(cli, tmp_path, crashed):
    paths = write_checkpoints(tmp_path, steps=(1, 2))
    with open(paths[0], "r+b") as f:  # truncated: the manifest names another size
        f.truncate(os.path.getsize(paths[0]) - 100)
    crashed("manifest", tmp_path)
    by = {r["name"]: r for r in cli("ls", tmp_path, "--json").json()}
    assert by["step=1.ckpt"]["status"] == "corrupt"
    assert "truncated or replaced" in by["step=1.ckpt"]["problems"][0]
    assert by["crashed.ckpt"]["status"] == "torn"
    assert by["step=2.ckpt"]["status"] == "committed"
    out = cli("ls", tmp_path).out
    assert "torn" in out and "stagesave gc" in out


def test_ls_several_roots_are_tiers(cli, tmp_path):
    a, b = tmp_path / "fast", tmp_path / "slow"
    a.mkdir(), b.mkdir()
    write_checkpoints(a, steps=(1,))
    write_checkpoints(b, steps=(2,))
    rows = cli("ls", a, b, "--json").json()
    assert [r["path"] for r in rows] == [str(b / "step=2.ckpt"), str(a / "step=1.ckpt")]


def test_ls_empty_and_missing(cli, tmp_path):
    r = cli("ls", tmp_path)
    assert r.code == 0 and "no checkpoints" in r.out
    r = cli("ls", tmp_path / "nope")
    assert r.code == 1 and r.err == f"stagesave: error: {tmp_path / 'nope'} does not exist\n"


def test_inspect_file_from_manifest(cli, tmp_path):
    path = write_checkpoints(tmp_path, steps=(7,))[0]
    doc = cli("inspect", path, "--json").json()
    assert doc["status"] == "committed" and doc["step"] == 7 and doc["metadata"] == {"step": 7}
    state = small_state(7)
    names = {t["name"]: t for t in doc["tensors"]}
    w = state["model"]["0.weight"]
    assert names["model.0.weight"]["shape"] == list(w.shape)
    assert names["model.0.weight"]["dtype"] == "float32"
    assert names["model.0.weight"]["bytes"] == w.numel() * 4
    (entry,) = doc["files"]
    info = stagesave.verify(path)
    assert entry["serialization_id"] == info.manifest.files[0].serialization_id
    assert entry["algorithm"] == "xxh3_128" and entry["first_digest"] == info.manifest.files[0].chunks[0]
    assert doc["telemetry"]["bytes"] == os.path.getsize(path)
    text = cli("inspect", path).out
    assert "model.0.weight" in text and "64x64" in text and "xxh3_128" in text and "blocked training" in text


def test_inspect_plain_file_reads_structure_only(cli, tmp_path):
    torch.save({"w": torch.zeros(1000, 1000, dtype=torch.bfloat16), "n": 3}, tmp_path / "plain.pt")
    doc = cli("inspect", tmp_path / "plain.pt", "--json").json()
    assert doc["status"] == "unverified"
    assert doc["tensors"] == [{"name": "w", "dtype": "bfloat16", "shape": [1000, 1000], "bytes": 2_000_000}]


def test_inspect_folder_lists_every_file(cli, tmp_path):
    d = write_dir_checkpoint(tmp_path)
    doc = cli("inspect", d, "--json").json()
    assert doc["folder"] and doc["status"] == "committed" and doc["step"] == 3
    assert {f["name"] for f in doc["files"]} == {"model.safetensors", "optimizer.bin", "random_states_0.pkl"}
    kinds = {f["name"]: f["kind"] for f in doc["files"]}
    assert kinds["model.safetensors"] == "safetensors" and kinds["optimizer.bin"] == "torch"
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["model.safetensors:0.weight"]["shape"] == [64, 64]
    assert tensors["model.safetensors:0.weight"]["bytes"] == 64 * 64 * 4


def test_verify_file_ok_and_corrupt(cli, tmp_path):
    path = write_checkpoints(tmp_path, steps=(1,))[0]
    r = cli("verify", path)
    assert r.code == 0 and r.out.startswith("OK ")
    flip_byte(path, os.path.getsize(path) // 2)
    r = cli("verify", path)
    assert r.code == 1
    assert f"{path}: checksum mismatch in bytes" in r.out
    assert r.err.startswith(f"stagesave: error: {path}: checksum mismatch in bytes [0, ")
    assert r.err.count("\n") == 1


def test_verify_root_names_each_problem(cli, tmp_path):
    paths = write_checkpoints(tmp_path, chunk_bytes=64 * 1024)
    d = write_dir_checkpoint(tmp_path, chunk_bytes=64 * 1024)
    flip_byte(paths[1], 70_000)  # second chunk of step=20
    flip_byte(os.path.join(d, "optimizer.bin"), 10)
    r = cli("verify", tmp_path, "--json")
    assert r.code == 1
    doc = json.loads(r.out)
    status = {os.path.basename(c["path"]): c for c in doc["checkpoints"]}
    assert status["step=10.ckpt"]["status"] == "verified" and status["step=30.ckpt"]["status"] == "verified"
    assert status["step=20.ckpt"]["status"] == "corrupt"
    assert "(chunk 1 of 3)" in status["step=20.ckpt"]["problems"][0]
    assert status["checkpoint_3"]["status"] == "corrupt"
    assert "optimizer.bin: checksum mismatch in bytes [0, 65536)" in status["checkpoint_3"]["problems"][0]
    assert "and 1 more checkpoints with problems" in r.err


def test_verify_folder_checkpoint(cli, tmp_path):
    d = write_dir_checkpoint(tmp_path)
    assert cli("verify", d).code == 0
    os.remove(os.path.join(d, "model.safetensors"))
    r = cli("verify", d)
    assert r.code == 1 and "model.safetensors is missing" in r.err


def test_verify_plain_file_and_strict(cli, tmp_path):
    torch.save(small_state(1), tmp_path / "plain.pt")
    r = cli("verify", tmp_path / "plain.pt")
    assert r.code == 0 and "UNVERIFIED" in r.out and "stagesave adopt" in r.out
    r = cli("verify", tmp_path / "plain.pt", "--strict")
    assert r.code == 1 and "is unverified" in r.err


def test_verify_torn_zip_without_manifest_is_corrupt(cli, tmp_path):
    torch.save(small_state(1), tmp_path / "plain.pt")
    with open(tmp_path / "plain.pt", "r+b") as f:
        f.truncate(30_000)
    r = cli("verify", tmp_path / "plain.pt")
    assert r.code == 1 and "truncated zip" in r.err


def test_verify_torn_save_only_fails_when_strict(cli, tmp_path, crashed):
    write_checkpoints(tmp_path, steps=(1,))
    crashed("manifest", tmp_path)
    r = cli("verify", tmp_path)
    assert r.code == 0 and "TORN" in r.out and "crashed before publishing" in r.out
    assert cli("verify", tmp_path, "--strict").code == 1


def test_missing_paths(cli, tmp_path):
    for cmd in ("inspect", "verify"):
        r = cli(cmd, tmp_path / "nope.ckpt")
        assert r.code == 1
        assert r.err == f"stagesave: error: no such file or folder: {tmp_path / 'nope.ckpt'}\n"
    r = cli("verify", tmp_path)
    assert r.code == 1 and "no checkpoints under" in r.err


def test_verify_folder_with_a_broken_manifest_is_corrupt(cli, tmp_path):
    d = write_dir_checkpoint(tmp_path)
    with open(os.path.join(d, "checkpoint.stagesave.json"), "w") as f:
        f.write("{not json")
    r = cli("verify", d)
    assert r.code == 1 and "checkpoint.stagesave.json: not valid JSON" in r.err


def test_progress_bars_on_a_terminal(tmp_path):
    """On a terminal, verify draws a progress bar (from several reader threads) on stderr."""
    import argparse
    import io

    from rich.console import Console

    from stagesave.cli import _verify
    from stagesave.cli._common import Env

    path = write_checkpoints(tmp_path, steps=(1,), chunk_bytes=64 * 1024)[0]
    err = io.StringIO()
    env = Env(out=Console(file=io.StringIO()), err=Console(file=err, force_terminal=True, width=100))
    assert env.interactive
    assert _verify.run(env, argparse.Namespace(path=path, strict=False, json=False)) == 0
    assert "verifying step=1.ckpt" in err.getvalue()
    quiet = Env(quiet=True, err=Console(file=io.StringIO(), force_terminal=True))
    assert not quiet.interactive
