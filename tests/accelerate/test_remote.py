"""fsspec URL destinations: memory:// in process, and a real S3 server on loopback."""

from __future__ import annotations

import shutil

import fsspec
import pytest
import stagesave.accelerate as sa
from accel_helpers import ListingWatcher, assert_same, build, snapshot, train, visible
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import stagesave

#: What Accelerate writes for build()'s run (one model, optimizer, scheduler, 2 custom objects).
FILES = sorted(["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl"])


def _files(fs, url: str) -> list[str]:
    """Every object under a checkpoint folder URL, relative."""
    root = url.split("://", 1)[1].rstrip("/")
    return sorted(
        p.split("://", 1)[-1].lstrip("/")[len(root.lstrip("/")) + 1 :] for p in fs.find(url)
    )


def _carrier(url: str, **options) -> str:
    """The file of a committed folder that carries the folder's proof."""
    info = stagesave.verify(url, **options)
    assert info.status == "verified", info.problems
    return info.manifest.folder.carrier


@pytest.fixture
def memory_root(request):
    root = f"memory://stagesave-accel/{request.node.name}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_explicit_url_save_and_load(memory_root):
    acc = Accelerator(cpu=True)
    run = build(acc)
    sa.enable(acc)
    train(acc, run, 2)
    before = snapshot(acc, run)
    where = acc.save_state(f"{memory_root}/ck")
    assert where == f"{memory_root}/ck"
    train(acc, run, 2)
    acc.load_state(f"{memory_root}/ck")
    assert_same(before, snapshot(acc, run))


def test_destination_url_with_automatic_naming_and_total_limit(memory_root, tmp_path):
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2))
    run = build(acc)
    sa.enable(acc, destination=memory_root)
    states = []
    for _ in range(3):
        train(acc, run, 1)
        states.append(snapshot(acc, run))
        acc.save_state()
    acc._stagesave.wait()
    fs = fsspec.filesystem("memory")
    assert sorted(p.rpartition("/")[2] for p in fs.ls(memory_root, detail=False)) == [
        "checkpoint_1",
        "checkpoint_2",
    ]
    assert _files(fs, f"{memory_root}/checkpoint_2") == FILES  # exactly Accelerate's files
    carrier = _carrier(f"{memory_root}/checkpoint_2")
    assert not (tmp_path / "checkpoints").exists()
    # A torn remote save (the object written last, the carrier of the folder's proof, never came)
    # is skipped.
    fs.rm_file(f"{memory_root}/checkpoint_2/{carrier}")
    train(acc, run, 3)
    acc.load_state()
    assert_same(states[1], snapshot(acc, run))
    assert acc.project_configuration.iteration == 2


@pytest.mark.s3
def test_s3_destination_roundtrip(s3_url, s3_options, tmp_path):
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    run = build(acc)
    sa.enable(acc, destination=s3_url, storage_options=s3_options)
    train(acc, run, 2)
    acc.save_state()
    train(acc, run, 1)
    before = snapshot(acc, run)
    acc.save_state()
    acc._stagesave.wait()
    train(acc, run, 2)
    acc.load_state()
    assert_same(before, snapshot(acc, run))
    assert acc.project_configuration.iteration == 2


def _fresh_auto(tmp_path, total_limit=None):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    return Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=total_limit))


def test_local_tier_in_front_of_a_url_destination(memory_root, tmp_path):
    acc = _fresh_auto(tmp_path, total_limit=2)
    run = build(acc)
    local = tmp_path / "nvme"
    tier = {"destination": memory_root, "local_tier": str(local), "keep_local": 1}
    ckpt = sa.enable(acc, **tier)
    states = []
    for i in range(3):
        train(acc, run, 1)
        states.append(snapshot(acc, run))
        assert acc.save_state() == local / f"checkpoint_{i}"  # committed locally first
    uploads = ckpt.wait_uploads()
    assert uploads and all(u.tier == "remote" and u.error is None for u in uploads)
    fs = fsspec.filesystem("memory")
    # total_limit on both tiers (the durable history on the remote), keep_local on the local one
    assert sorted(p.rpartition("/")[2] for p in fs.ls(memory_root, detail=False)) == [
        "checkpoint_1",
        "checkpoint_2",
    ]
    for name in ("checkpoint_1", "checkpoint_2"):  # complete, proven copies
        assert _files(fs, f"{memory_root}/{name}") == FILES
        _carrier(f"{memory_root}/{name}")
    assert visible(local) == ["checkpoint_2"]
    latest = ckpt.latest()
    assert (latest.name, latest.tier) == ("checkpoint_2", "local")

    train(acc, run, 2)
    acc.load_state()  # the valid local copy
    assert_same(states[2], snapshot(acc, run))
    sa.disable(acc)  # finishes uploads; plain Accelerate reads the local copy as well
    train(acc, run, 1)
    acc.load_state(str(local / "checkpoint_2"))
    assert_same(states[2], snapshot(acc, run))

    # A new node with an empty local disk resumes from the remote tier.
    shutil.rmtree(local)
    acc2 = _fresh_auto(tmp_path, total_limit=2)
    run2 = build(acc2, seed=5)
    ckpt2 = sa.enable(acc2, **tier)
    assert ckpt2.latest().tier == "remote"
    acc2.load_state()
    assert_same(states[2], snapshot(acc2, run2))
    assert acc2.project_configuration.iteration == 3
    sa.disable(acc2)


def _folders_with_objects(fs, url: str) -> list[str]:
    """Top-level folders holding objects (SeaweedFS keeps empty directory entries after deletes)."""
    root = url.removeprefix("s3://")
    return sorted({p[len(root) + 1 :].split("/")[0] for p in fs.find(url, refresh=True)})


@pytest.mark.s3
def test_local_tier_in_front_of_s3(s3_url, s3_options, tmp_path):
    acc = _fresh_auto(tmp_path, total_limit=2)
    run = build(acc)
    local = tmp_path / "nvme"
    tier = {"destination": s3_url, "local_tier": str(local), "storage_options": s3_options}
    ckpt = sa.enable(acc, **tier)
    for _ in range(3):
        train(acc, run, 1)
        acc.save_state()
    before = snapshot(acc, run)
    assert all(u.error is None for u in ckpt.wait_uploads())
    fs = fsspec.filesystem("s3", **s3_options)
    assert _folders_with_objects(fs, s3_url) == ["checkpoint_1", "checkpoint_2"]
    assert visible(local) == ["checkpoint_1", "checkpoint_2"]  # keep_local defaults to total_limit
    sa.disable(acc)
    shutil.rmtree(local)  # the node is gone; the next one starts with an empty local disk
    acc2 = _fresh_auto(tmp_path, total_limit=2)
    run2 = build(acc2, seed=9)
    ckpt2 = sa.enable(acc2, **tier)
    assert ckpt2.latest().tier == "remote"
    acc2.load_state()
    assert_same(before, snapshot(acc2, run2))
    assert acc2.project_configuration.iteration == 3
    train(acc2, run2, 1)
    assert acc2.save_state() == local / "checkpoint_3"  # new saves commit locally again
    sa.disable(acc2)
    assert _folders_with_objects(fs, s3_url) == ["checkpoint_2", "checkpoint_3"]


@pytest.mark.s3
def test_local_tier_saves_are_assembled_beside_their_folder(s3_url, s3_options, tmp_path):
    import os
    import threading
    import time

    acc = _fresh_auto(tmp_path, total_limit=2)
    run = build(acc, width=256)
    local = tmp_path / "nvme"
    ckpt = sa.enable(
        acc, destination=s3_url, local_tier=str(local), storage_options=s3_options, io_threads=1
    )
    with ListingWatcher(local) as watcher:
        for i in range(3):
            train(acc, run, 1)
            if i == 2:  # hold the third save mid-write: its only I/O thread waits behind a gate
                gate = threading.Event()
                ckpt._checkpointer("auto").pipeline.queue.io_pool.submit(gate.wait)
            assert acc.save_state() == local / f"checkpoint_{i}"
            if i == 2:
                deadline = time.monotonic() + 30
                while not [n for n in os.listdir(local) if stagesave.is_temporary(n)]:
                    assert time.monotonic() < deadline, (
                        "the save was not assembled beside its folder"
                    )
                    time.sleep(0.005)
                [assembling] = [n for n in os.listdir(local) if stagesave.is_temporary(n)]
                assert assembling.startswith(".checkpoint_2.") and assembling.endswith(
                    ".stagesave-tmp"
                )
                assert visible(local) == ["checkpoint_0", "checkpoint_1"]
                gate.set()
            ckpt.wait()
        before = snapshot(acc, run)
        uploads = ckpt.wait_uploads()
    # The local tier's listing showed each folder only once committed, and otherwise only
    # stagesave's dot-named temporaries (gone now); nothing of stagesave's beside the local tier.
    assert {n for n in watcher.seen if not stagesave.is_temporary(n)} == {
        "checkpoint_0",
        "checkpoint_1",
        "checkpoint_2",
    }
    assert sorted(os.listdir(local)) == ["checkpoint_1", "checkpoint_2"]
    assert sorted(os.listdir(tmp_path)) == ["nvme"]
    assert uploads and all(u.error is None for u in uploads)
    assert visible(local) == ["checkpoint_1", "checkpoint_2"]
    fs = fsspec.filesystem("s3", **s3_options)
    assert _folders_with_objects(fs, s3_url) == ["checkpoint_1", "checkpoint_2"]
    assert sorted(os.listdir(local / "checkpoint_2")) == FILES
    assert _files(fs, f"{s3_url}/checkpoint_2") == FILES
    for name in FILES:  # the remote copy, byte for byte
        assert (
            fs.cat_file(f"{s3_url}/checkpoint_2/{name}")
            == (local / "checkpoint_2" / name).read_bytes()
        ), name
    _carrier(f"{s3_url}/checkpoint_2", storage_options=s3_options)
    sa.disable(acc)
    shutil.rmtree(local)  # resume from the remote tier
    acc2 = _fresh_auto(tmp_path, total_limit=2)
    run2 = build(acc2, width=256, seed=3)
    ckpt2 = sa.enable(acc2, destination=s3_url, local_tier=str(local), storage_options=s3_options)
    assert ckpt2.latest().tier == "remote"
    acc2.load_state()
    assert_same(before, snapshot(acc2, run2))
    sa.disable(acc2)
