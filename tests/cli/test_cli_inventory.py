"""`ls`, `inspect`, `verify` on real checkpoints written by the core (local): format 2 (the proof
inside the files), format 1 (sidecar manifests, as stagesave wrote them before) and plain files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from clitools import (
    small_state,
    write_checkpoints,
    write_dir_checkpoint,
    write_format1,
    write_format1_dir,
)
from proofkit import flip_byte

import stagesave


def test_ls_lists_newest_first_with_status_step_size_tier(cli, tmp_path):
    write_format1(tmp_path, "old.ckpt", small_state(1), metadata={"step": 1})
    write_checkpoints(tmp_path)
    write_dir_checkpoint(tmp_path)
    torch.save(small_state(5), tmp_path / "plain.pt")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    rows = cli("ls", tmp_path, "--json").json()
    # newest as latest() sees them: format 2 by sequence number, then the rest by time
    names = [r["name"] for r in rows]
    assert names == [
        "checkpoint_3",
        "step=30.ckpt",
        "step=20.ckpt",
        "step=10.ckpt",
        "plain.pt",
        "old.ckpt",
    ]
    assert [r["seq"] for r in rows] == [4, 3, 2, 1, None, None]
    assert [r["format"] for r in rows] == [2, 2, 2, 2, 0, 1]
    by = {r["name"]: r for r in rows}
    assert by["step=20.ckpt"]["status"] == "committed" and by["step=20.ckpt"]["step"] == 20
    assert by["step=20.ckpt"]["size"] == os.path.getsize(tmp_path / "step=20.ckpt")
    assert by["step=20.ckpt"]["tier"] == "local"
    assert (
        by["checkpoint_3"]["folder"]
        and by["checkpoint_3"]["status"] == "committed"
        and by["checkpoint_3"]["step"] == 3
    )
    assert by["plain.pt"]["status"] == "unverified"
    assert by["old.ckpt"]["status"] == "committed" and by["old.ckpt"]["step"] == 1
    assert not any(n.endswith(".stagesave.json") for n in names)
    text = cli("ls", tmp_path).out
    assert (
        "step=30.ckpt" in text
        and "checkpoint_3/" in text
        and "committed" in text
        and "notes.txt" not in text
    )
    assert "seq" in text.splitlines()[0] and "format" in text.splitlines()[0]


def test_ls_shows_corrupt_and_torn(cli, tmp_path, crashed):
    paths = write_checkpoints(tmp_path, steps=(1, 2))
    with open(paths[0], "r+b") as f:  # truncated: its proof is gone with its end
        f.truncate(os.path.getsize(paths[0]) - 100)
    crashed("proof", tmp_path)  # a format-2 save killed just before its rename
    _, sidecar = write_format1(tmp_path, "gone.ckpt", small_state(3))
    os.remove(tmp_path / "gone.ckpt")  # a format-1 save whose data never appeared
    by = {r["name"]: r for r in cli("ls", tmp_path, "--json").json()}
    assert by["step=1.ckpt"]["status"] == "corrupt"
    assert "footer is damaged" in by["step=1.ckpt"]["problems"][0]
    assert by["crashed.ckpt"]["status"] == "torn" and by["crashed.ckpt"]["format"] == 2
    assert (
        "no crashed.ckpt exists: a save (or removal) of it was interrupted"
        in by["crashed.ckpt"]["problems"][0]
    )
    assert "is not running on this host" in by["crashed.ckpt"]["problems"][0]
    assert by["gone.ckpt"]["status"] == "torn" and by["gone.ckpt"]["format"] == 1
    assert os.path.basename(sidecar) in by["gone.ckpt"]["problems"][0]
    assert by["step=2.ckpt"]["status"] == "committed"
    out = cli("ls", tmp_path).out
    assert "torn" in out and "stagesave gc" in out


def test_ls_torn_only_when_the_checkpoint_is_missing(cli, tmp_path, crashed):
    """A crash while replacing a checkpoint left a temporary, but the old checkpoint is intact:
    no torn row, only a leftover to clean."""
    crashed("replace", tmp_path)
    rows = cli("ls", tmp_path, "--json").json()
    assert [(r["name"], r["status"]) for r in rows] == [("last.ckpt", "committed")]
    assert "1 leftovers of crashed saves" in cli("ls", tmp_path).out


def test_ls_prints_names_literally(cli, tmp_path):
    """Names are data: rich markup is not interpreted, control characters are escaped."""
    write_checkpoints(tmp_path, steps=(1,))
    os.rename(tmp_path / "step=1.ckpt", tmp_path / "ckpt[bold]x.ckpt")
    torch.save({"w": torch.ones(2)}, tmp_path / "evil\x1b[31m.pt")
    out = cli("ls", tmp_path).out
    assert "ckpt[bold]x.ckpt" in out
    assert "\x1b" not in out and "evil\\x1b[31m.pt" in out
    rows = cli("ls", tmp_path, "--json").json()
    assert {r["name"] for r in rows} == {"ckpt[bold]x.ckpt", "evil\x1b[31m.pt"}
    r = cli("inspect", tmp_path / "ckpt[bold]x.ckpt")
    assert r.code == 0 and r.out.startswith(f"{tmp_path}/ckpt[bold]x.ckpt\n")


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


def test_inspect_file_shows_the_proof_inside_it(cli, tmp_path):
    path = write_checkpoints(tmp_path, steps=(6, 7))[1]
    doc = cli("inspect", path, "--json").json()
    assert doc["status"] == "committed" and doc["step"] == 7 and doc["metadata"] == {"step": 7}
    assert doc["format"] == 2 and doc["seq"] == 2 and doc["manifest"] is None
    state = small_state(7)
    names = {t["name"]: t for t in doc["tensors"]}  # the index record inside the file
    w = state["model"]["0.weight"]
    assert names["model.0.weight"]["shape"] == list(w.shape)
    assert names["model.0.weight"]["dtype"] == "float32"
    assert names["model.0.weight"]["bytes"] == w.numel() * 4
    (entry,) = doc["files"]
    info = stagesave.verify(path)
    proven = info.manifest.files[0]
    assert entry["serialization_id"] == proven.serialization_id
    assert entry["algorithm"] == "crc32" and entry["first_digest"] == proven.chunks[0]
    assert entry["chunks"] == len(proven.chunks) and entry["covered"] == proven.end
    assert entry["size"] == os.path.getsize(path) and ".data/stagesave/proof.json" in entry["proof"]
    assert doc["telemetry"]["bytes"] == proven.end and doc["telemetry"]["blocking_s"] > 0
    text = cli("inspect", path).out
    assert (
        "model.0.weight" in text
        and "64x64" in text
        and "crc32" in text
        and "blocked training" in text
    )
    assert "seq       2" in text and "the proof is inside the file" in text


def test_inspect_format1_file_reads_its_sidecar(cli, tmp_path):
    path, sidecar = write_format1(tmp_path, "old.ckpt", small_state(2), metadata={"step": 2})
    doc = cli("inspect", path, "--json").json()
    assert doc["status"] == "committed" and doc["format"] == 1 and doc["seq"] is None
    assert doc["manifest"] == os.path.basename(sidecar) and doc["step"] == 2
    assert (
        doc["files"][0]["algorithm"] == "xxh3_128"
        and doc["files"][0]["proof"] == f"sidecar {os.path.basename(sidecar)}"
    )
    assert {"model.0.weight", "optimizer.state.0.exp_avg"} <= {t["name"] for t in doc["tensors"]}
    assert doc["telemetry"]["blocking_s"] == 0.25


def test_inspect_hostile_but_valid_manifest(cli, tmp_path):
    """A sidecar that parses (JSON allows 1e999, odd tensor entries) is refused as corrupt with the
    field named, and the output stays valid JSON (tests/cli/test_cli_hostile.py: every case)."""
    path, sidecar = write_format1(tmp_path, "odd.ckpt", {"w": torch.ones(3)})
    doc = json.loads(Path(sidecar).read_text())
    doc["telemetry"] = {"blocking_s": 1e999, "write_s": "fast", "direct_io": 3}
    doc["metadata"] = {"lr": -1e999, "name": "[red]x[/red]"}
    doc["tensors"] = [
        7,
        {"name": "a", "dtype": "float32", "shape": [10**6] * 40},
        {"name": "b"},
        {"name": "c[bold]", "dtype": "float16", "shape": [2, 3]},
        {"name": "d", "dtype": "nope", "shape": [4]},
    ]
    with open(sidecar, "w") as f:
        f.write(json.dumps(doc).replace("Infinity", "1e999"))
    r = cli("inspect", path, "--json")
    assert r.code == 1 and r.err.count("\n") == 1, r.err
    out = r.json()
    assert out["status"] == "corrupt" and "tensors[0] is not an object" in out["problems"][0]
    r = cli("inspect", path)
    assert r.code == 1 and "tensors[0] is not an object" in r.err


def test_inspect_plain_file_reads_structure_only(cli, tmp_path):
    torch.save({"w": torch.zeros(1000, 1000, dtype=torch.bfloat16), "n": 3}, tmp_path / "plain.pt")
    doc = cli("inspect", tmp_path / "plain.pt", "--json").json()
    assert doc["status"] == "unverified"
    assert doc["tensors"] == [
        {"name": "w", "dtype": "bfloat16", "shape": [1000, 1000], "bytes": 2_000_000}
    ]


def test_inspect_folder_lists_every_file(cli, tmp_path):
    d = write_dir_checkpoint(tmp_path)
    doc = cli("inspect", d, "--json").json()
    assert doc["folder"] and doc["status"] == "committed" and doc["step"] == 3
    assert {f["name"] for f in doc["files"]} == {
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
    }
    kinds = {f["name"]: f["kind"] for f in doc["files"]}
    assert kinds["model.safetensors"] == "safetensors" and kinds["optimizer.bin"] == "torch"
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["model.safetensors:0.weight"]["shape"] == [64, 64]
    assert tensors["model.safetensors:0.weight"]["bytes"] == 64 * 64 * 4
    assert "optimizer.bin:state.0.exp_avg" in tensors  # from the index record inside optimizer.bin
    # the carrier's proof names every file; each member carries its own
    assert doc["format"] == 2 and doc["seq"] == 1 and doc["carrier"] == "optimizer.bin"
    roles = {f["name"]: (f["role"], f["proof"]) for f in doc["files"]}
    assert roles["optimizer.bin"][0] == "carrier" and roles["model.safetensors"][0] == "member"
    assert "__metadata__['stagesave.proof']" in roles["model.safetensors"][1]
    assert doc["metadata"] == {"step": 3} and doc["telemetry"]["blocking_s"] > 0


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
    assert (
        status["step=10.ckpt"]["status"] == "verified"
        and status["step=30.ckpt"]["status"] == "verified"
    )
    assert status["step=20.ckpt"]["status"] == "corrupt"
    assert (
        "checksum mismatch in bytes [65536, 131072) (chunk 1)"
        in status["step=20.ckpt"]["problems"][0]
    )
    assert status["step=20.ckpt"]["format"] == 2 and status["step=20.ckpt"]["seq"] == 2
    assert status["checkpoint_3"]["status"] == "corrupt"
    assert (
        "optimizer.bin: checksum mismatch in bytes [0, 65536)"
        in status["checkpoint_3"]["problems"][0]
    )
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
    crashed("proof", tmp_path)
    r = cli("verify", tmp_path)
    assert r.code == 0 and "TORN" in r.out and "was interrupted" in r.out
    assert cli("verify", tmp_path, "--strict").code == 1


def test_verify_format1_file_and_folder(cli, tmp_path):
    path, _ = write_format1(tmp_path, "old.ckpt", small_state(1))
    d = write_format1_dir(tmp_path)
    r = cli("verify", tmp_path, "--json")
    assert r.code == 0, r.err
    assert {
        (os.path.basename(c["path"]), c["status"], c["format"]) for c in r.json()["checkpoints"]
    } == {("old.ckpt", "verified", 1), ("checkpoint_1", "verified", 1)}
    assert cli("verify", d).code == 0 and cli("verify", path).code == 0
    flip_byte(os.path.join(d, "config.json"), 2)
    r = cli("verify", d)
    assert r.code == 1 and "config.json: checksum mismatch" in r.err
    flip_byte(path, 1000)
    r = cli("verify", path)
    assert r.code == 1 and f"{path}: checksum mismatch in bytes [0, " in r.err


def test_verify_through_a_link(cli, tmp_path):
    """Lightning's save_last="link": the link is judged by its target."""
    write_checkpoints(tmp_path, steps=(1,))
    os.symlink("step=1.ckpt", tmp_path / "last.ckpt")
    r = cli("verify", tmp_path / "last.ckpt")
    assert r.code == 0, r.err
    assert r.out.startswith(f"OK         {tmp_path / 'last.ckpt'}")


def test_missing_paths(cli, tmp_path):
    for cmd in ("inspect", "verify"):
        r = cli(cmd, tmp_path / "nope.ckpt")
        assert r.code == 1
        assert r.err == f"stagesave: error: no such file or folder: {tmp_path / 'nope.ckpt'}\n"
    r = cli("verify", tmp_path)
    assert r.code == 1 and "no checkpoints under" in r.err


def test_verify_folder_with_a_broken_manifest_is_corrupt(cli, tmp_path):
    d = write_format1_dir(tmp_path)
    with open(os.path.join(d, "checkpoint.stagesave.json"), "w") as f:
        f.write("{not json")
    r = cli("verify", d)
    assert r.code == 1 and "checkpoint.stagesave.json: not valid JSON" in r.err


def test_verify_folder_with_a_file_its_proof_does_not_list(cli, tmp_path):
    d = write_dir_checkpoint(tmp_path)
    with open(os.path.join(d, "extra.bin"), "wb") as f:
        f.write(b"added by hand")
    r = cli("verify", d)
    assert r.code == 0, r.err
    assert "1 file beside it that is not part of the checkpoint (kept, never read): extra.bin" \
        in r.out


def test_verify_file_with_a_damaged_proof(cli, tmp_path):
    path = write_checkpoints(tmp_path, steps=(1,))[0]
    info = stagesave.verify(path)
    flip_byte(path, info.manifest.files[0].end + 200)  # inside the records that follow the data
    r = cli("verify", path)
    assert r.code == 1 and r.err.startswith(f"stagesave: error: {path}: ")


def test_progress_bars_on_a_terminal(tmp_path):
    """On a terminal, verify draws a progress bar (from several reader threads) on stderr."""
    import argparse
    import io

    from rich.console import Console

    # a terminal console cannot be given through main(): the command is run with one
    from stagesave.cli import _verify
    from stagesave.cli._common import Env

    path = write_checkpoints(tmp_path, steps=(1,), chunk_bytes=64 * 1024)[0]
    err = io.StringIO()
    env = Env(
        out=Console(file=io.StringIO()), err=Console(file=err, force_terminal=True, width=100)
    )
    assert env.interactive
    assert _verify.run(env, argparse.Namespace(path=path, strict=False, json=False)) == 0
    assert "verifying step=1.ckpt" in err.getvalue()
    quiet = Env(quiet=True, err=Console(file=io.StringIO(), force_terminal=True))
    assert not quiet.interactive
