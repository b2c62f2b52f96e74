"""fsspec URL destinations: memory:// in process, and a real S3 server on loopback."""

from __future__ import annotations

import fsspec
import pytest
import stagesave.accelerate as sa
from accel_helpers import MANIFEST, assert_same, build, snapshot, train
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration


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
    assert sorted(p.rpartition("/")[2] for p in fs.ls(memory_root, detail=False)) == ["checkpoint_1", "checkpoint_2"]
    assert fs.exists(f"{memory_root}/checkpoint_2/{MANIFEST}")
    assert not (tmp_path / "checkpoints").exists()
    # A torn remote save (files without manifest: the object-store commit never happened) is skipped.
    fs.rm_file(f"{memory_root}/checkpoint_2/{MANIFEST}")
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
