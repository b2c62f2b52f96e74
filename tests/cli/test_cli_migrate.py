"""`migrate`: format-1 checkpoints (a file + its sidecar, a folder + checkpoint.stagesave.json)
rewritten in place as format-2 checkpoints that carry their own proof."""

from __future__ import annotations

import json
import os
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
from clitools import small_state, write_checkpoints, write_format1, write_format1_dir
from proofkit import flip_byte
from safetensors import safe_open
from safetensors.torch import load_file

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


def test_migrate_a_format1_file(cli, tmp_path):
    state = small_state(3)
    path, sidecar = write_format1(tmp_path, "old.ckpt", state, metadata={"step": 3})
    old_manifest = json.loads(Path(sidecar).read_text())
    # a format-1 file written by torch.save: zip tools accept it; after migration they still must
    r = cli("migrate", tmp_path)
    assert r.code == 0, r.err
    assert "migrated" in r.out and "1 of 1 format-1 checkpoints migrated" in r.out
    assert sorted(os.listdir(tmp_path)) == ["old.ckpt"]  # the sidecar is gone
    assert zipfile.ZipFile(path).testzip() is None
    assert _same(torch.load(path, weights_only=False), state)
    assert _same(torch.load(path, weights_only=False, mmap=True), state)
    r = cli("verify", path)
    assert r.code == 0 and r.out.startswith("OK ")
    info = stagesave.verify(path)
    assert (
        info.status == "verified" and info.format == 2 and info.seq == 0
    )  # migrated: older than any format-2 save
    m = info.manifest
    assert m.metadata == {"step": 3}  # carried over
    assert m.files[0].algorithm == "xxh3_128" and m.files[0].chunk_bytes == 64 * 1024
    assert m.files[0].serialization_id == old_manifest["files"][0]["serialization_id"]
    assert [t["name"] for t in m.tensors] == [t["name"] for t in old_manifest["tensors"]]
    assert m.telemetry["blocking_s"] == 0.25
    assert m.telemetry["migrated"]["created_ns"] == old_manifest["created_ns"]
    assert m.telemetry["migrated"]["from"] == os.path.basename(sidecar)
    assert _same(stagesave.load(path), state)
    doc = cli("inspect", path, "--json").json()
    assert doc["format"] == 2 and doc["seq"] == 0 and doc["step"] == 3
    # nothing left to do
    r = cli("migrate", tmp_path)
    assert r.code == 0 and "no format-1 checkpoints" in r.out


def test_migrate_a_format1_folder(cli, tmp_path):
    d = write_format1_dir(tmp_path, "checkpoint_1", step=1)
    before = {n: Path(os.path.join(d, n)).read_bytes() for n in os.listdir(d)}
    r = cli("migrate", tmp_path, "--json")
    assert r.code == 0, r.err
    (res,) = r.json()["checkpoints"]
    assert res["action"] == "migrated" and res["folder"] and res["seq"] == 0
    # exactly the checkpoint's files: no checkpoint.stagesave.json any more
    assert sorted(os.listdir(d)) == [
        "config.json",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
    ]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1"]
    state = small_state(1)
    for name in ("optimizer.bin", "random_states_0.pkl"):
        assert zipfile.ZipFile(os.path.join(d, name)).testzip() is None
    assert _same(
        torch.load(os.path.join(d, "optimizer.bin"), weights_only=False), state["optimizer"]
    )
    rs = torch.load(os.path.join(d, "random_states_0.pkl"), weights_only=False)
    assert rs["step"] == 1 and _same(rs["numpy_random_seed"], state["rng"])
    model = load_file(os.path.join(d, "model.safetensors"))
    assert set(model) == set(state["model"]) and all(
        torch.equal(model[k], v) for k, v in state["model"].items()
    )
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"  # the file's own metadata is kept
    assert (
        Path(os.path.join(d, "config.json")).read_bytes() == before["config.json"]
    )  # raw: byte for byte
    r = cli("verify", d)
    assert r.code == 0 and r.out.startswith("OK ")
    info = stagesave.verify(d)
    assert info.status == "verified" and info.format == 2 and info.manifest.metadata == {"step": 1}
    assert info.manifest.folder.carrier == "optimizer.bin"
    assert {e.name for e in info.manifest.folder.listed} == {"config.json"}
    flip_byte(os.path.join(d, "config.json"), 3)  # the raw file is proven by the carrier now
    assert cli("verify", d).code == 1


def test_dry_run_verifies_and_changes_nothing(cli, tmp_path):
    write_format1(tmp_path, "a.ckpt", small_state(1))
    write_format1_dir(tmp_path)
    before = {
        p: Path(os.path.join(dp, p)).read_bytes() for dp, _, fs in os.walk(tmp_path) for p in fs
    }
    r = cli("migrate", tmp_path, "--dry-run")
    assert r.code == 0, r.err
    assert (
        r.out.count("would migrate") == 2
        and "2 of 2 format-1 checkpoints would be migrated" in r.out
    )
    after = {
        p: Path(os.path.join(dp, p)).read_bytes() for dp, _, fs in os.walk(tmp_path) for p in fs
    }
    assert after == before


def test_a_corrupt_checkpoint_is_not_migrated(cli, tmp_path):
    good, _ = write_format1(tmp_path, "good.ckpt", small_state(1))
    time.sleep(0.01)
    bad, bad_sidecar = write_format1(tmp_path, "bad.ckpt", small_state(2))
    flip_byte(bad, 1000)
    bad_bytes = Path(bad).read_bytes()
    r = cli("migrate", tmp_path, "--json")
    assert r.code == 1
    results = {os.path.basename(c["path"]): c for c in r.json()["checkpoints"]}
    assert results["good.ckpt"]["action"] == "migrated"
    assert (
        results["bad.ckpt"]["action"] == "failed"
        and "does not verify" in results["bad.ckpt"]["detail"]
    )
    assert "checksum mismatch" in results["bad.ckpt"]["detail"]
    assert "bad.ckpt was not migrated" in r.err
    assert Path(bad).read_bytes() == bad_bytes and os.path.exists(bad_sidecar)  # left as it was
    assert stagesave.verify(good).format == 2


def test_order_is_kept_and_newer_format2_checkpoints_are_never_overtaken(cli, tmp_path):
    """Migrated checkpoints keep their creation time and take sequence number 0: older than any
    format-2 save, in their original order among themselves, whatever order they migrate in."""
    t0 = time.time_ns()
    write_format1(tmp_path, "step=2.ckpt", small_state(2), created_ns=t0 + 2_000_000_000)
    write_format1(tmp_path, "step=1.ckpt", small_state(1), created_ns=t0 + 1_000_000_000)
    write_format1(tmp_path, "step=3.ckpt", small_state(3), created_ns=t0 + 3_000_000_000)
    assert cli("migrate", tmp_path / "step=2.ckpt").code == 0  # the middle one alone first
    assert stagesave.latest(tmp_path).name == "step=3.ckpt"  # format 1 still, and the newest
    assert cli("migrate", tmp_path).code == 0
    listed = [(r["name"], r["seq"], r["format"]) for r in cli("ls", tmp_path, "--json").json()]
    assert listed == [("step=3.ckpt", 0, 2), ("step=2.ckpt", 0, 2), ("step=1.ckpt", 0, 2)]
    assert stagesave.latest(tmp_path).name == "step=3.ckpt"
    assert [round(c.created * 1e9) // 10**9 for c in stagesave.list_checkpoints(tmp_path)] == [
        (t0 + 3_000_000_000) // 10**9, (t0 + 2_000_000_000) // 10**9, (t0 + 1_000_000_000) // 10**9]
    # a directory that already holds format-2 checkpoints saved since: they stay the newest
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _, sidecar = write_format1(mixed, "old.ckpt", small_state(1))
    write_checkpoints(mixed, steps=(9,))
    assert cli("migrate", mixed).code == 0
    assert not os.path.exists(sidecar)
    assert stagesave.latest(mixed).name == "step=9.ckpt"
    assert [(c.name, c.seq) for c in stagesave.list_checkpoints(mixed)] == [
        ("step=9.ckpt", 1),
        ("old.ckpt", 0),
    ]


def test_adopted_files_are_left_unless_asked(cli, tmp_path):
    path = tmp_path / "theirs.ckpt"
    torch.save(small_state(4), path)
    assert cli("adopt", path).code == 0
    before = path.read_bytes()
    r = cli("migrate", tmp_path, "--json")
    assert r.code == 0
    (res,) = r.json()["checkpoints"]
    assert res["action"] == "skipped" and "stagesave adopt" in res["detail"]
    assert path.read_bytes() == before
    r = cli("migrate", tmp_path, "--include-adopted")
    assert r.code == 0, r.err
    info = stagesave.verify(path)
    assert (
        info.format == 2
        and info.status == "verified"
        and info.manifest.metadata["adopted_by"] == "stagesave adopt"
    )
    assert zipfile.ZipFile(path).testzip() is None and _same(
        torch.load(path, weights_only=False), small_state(4)
    )
    assert sorted(os.listdir(tmp_path)) == ["theirs.ckpt"]


def test_folders_migrate_only_what_they_prove(cli, tmp_path):
    from stagesave.ondisk.manifest import Manifest, parse_manifest
    from stagesave.ondisk.names import DIR_MANIFEST

    d = write_format1_dir(tmp_path, "checkpoint_1")
    with open(os.path.join(d, "notes.txt"), "w") as f:
        f.write("a file the manifest does not list")
    r = cli("migrate", d)
    assert r.code == 1 and "holds files its manifest does not list (notes.txt)" in r.err
    assert os.path.exists(os.path.join(d, DIR_MANIFEST))
    # a sharded (DCP) folder of format 1: re-save to migrate
    s = tmp_path / "sharded"
    s.mkdir()
    (s / ".metadata").write_bytes(b"metadata")
    (s / "__0_0.distcp").write_bytes(b"rank 0")
    m = parse_manifest(Path(os.path.join(d, DIR_MANIFEST)).read_bytes(), "x")
    from clitools import format1_entry

    entries = [
        format1_entry(str(s / n), n, k, "xxh3_128", 65536)
        for n, k in ((".metadata", "dcp-metadata"), ("__0_0.distcp", "dcp"))
    ]
    (s / DIR_MANIFEST).write_bytes(Manifest(entries, m.created_ns).to_json())
    r = cli("migrate", s, "--json")
    assert r.code == 0, r.err
    (res,) = r.json()["checkpoints"]
    assert res["action"] == "skipped" and "re-save to migrate" in res["detail"]
    assert (s / DIR_MANIFEST).exists()
