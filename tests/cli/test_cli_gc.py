"""`gc`: debris of real SIGKILLed saves is removed; nothing else ever is (live saves, user files,
symlink targets, evidence of corruption)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from clitools import flip_byte, write_checkpoints

import stagesave
from stagesave._gc import collect_garbage, find_debris, pid_alive
from stagesave._local import LocalStore


def _tree(root):
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for n in dirnames + filenames:
            out.add(os.path.normpath(os.path.join(rel, n)))
    return out


@pytest.fixture
def live_pid():
    """The pid of a real running process (not this one)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield p.pid
    p.kill()
    p.wait()


def test_dry_run_lists_and_changes_nothing_then_gc_removes(cli, crashed, tmp_path):
    write_checkpoints(tmp_path, steps=(1,))
    crashed("manifest", tmp_path)
    before = _tree(tmp_path)
    temps = [n for n in before if ".stagesave-tmp" in n]
    orphans = [n for n in before if n.startswith("crashed.ckpt.") and n.endswith(".stagesave.json")]
    assert len(temps) == 1 and len(orphans) == 1
    r = cli("gc", tmp_path, "--dry-run", "--json")
    assert r.code == 0
    doc = r.json()
    assert {(d["name"], d["kind"]) for d in doc["found"]} == {(temps[0], "temporary"), (orphans[0], "orphan-manifest")}
    assert doc["done"] == []
    assert "is not running on this host" in next(d["reason"] for d in doc["found"] if d["kind"] == "temporary")
    assert _tree(tmp_path) == before
    text = cli("gc", tmp_path, "-n").out
    assert "would remove temporary" in text and "would reclaim" in text
    r = cli("gc", tmp_path)
    assert r.code == 0 and "2 leftovers" in r.out
    assert _tree(tmp_path) == before - {temps[0], orphans[0]}
    assert stagesave.verify(tmp_path / "step=1.ckpt").status == "verified"
    assert cli("gc", tmp_path, "--json").json()["found"] == []


def test_crash_while_replacing_keeps_the_old_file_and_its_manifest(cli, crashed, tmp_path):
    crashed("replace", tmp_path)
    with stagesave.Checkpointer() as ck:
        old = ck.verify(tmp_path / "last.ckpt")
    assert old.status == "verified"
    assert cli("gc", tmp_path).code == 0
    left = sorted(os.listdir(tmp_path))
    assert left == ["last.ckpt", old.manifest_name]
    with stagesave.Checkpointer() as ck:
        assert ck.verify(tmp_path / "last.ckpt").status == "verified"
        assert torch.equal(ck.load(tmp_path / "last.ckpt")["w"], torch.arange(600_000, dtype=torch.float32))


def test_crashed_folder_saves(cli, crashed, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    crashed("dir_data", a)
    crashed("dir_aside", b)
    # a: the old folder is intact, the staging folder of the crashed save goes
    assert cli("gc", a).code == 0
    assert sorted(os.listdir(a)) == ["checkpoint_5"]
    assert stagesave.verify(a / "checkpoint_5").status == "verified"
    # b: the crash struck between the two renames: the aside folder is the only copy, restored
    r = cli("gc", b, "--json")
    kinds = {(d["kind"], d["action"]) for d in r.json()["done"]}
    assert kinds == {("aside-dir", "restore"), ("temporary-dir", "remove")}
    assert sorted(os.listdir(b)) == ["checkpoint_5"]
    info = stagesave.verify(b / "checkpoint_5")
    assert info.status == "verified"
    with stagesave.Checkpointer() as ck:
        assert ck.load(b / "checkpoint_5" / "optimizer.bin") == {"step": 1}


def test_nested_debris_is_found(cli, crashed, tmp_path):
    crashed("data", tmp_path / "run1" / "checkpoints")
    found = cli("gc", tmp_path, "-n", "--json").json()["found"]
    assert [d["name"].split("/")[:2] for d in found] == [["run1", "checkpoints"]]


def test_live_writers_are_left_alone_until_old(cli, tmp_path, live_pid):
    tmp = tmp_path / f".x.ckpt.{live_pid}-0123abcd.stagesave-tmp"
    tmp.write_bytes(b"\0" * 4096)
    manifest = tmp_path / "x.ckpt.0123456789.stagesave.json"
    manifest.write_text("{}")  # its data file is not published yet: a save in progress
    doc = cli("gc", tmp_path, "--json").json()
    assert doc["found"] == [] and tmp.exists() and manifest.exists()
    whys = {k["name"]: k["why"] for k in doc["kept"]}
    assert whys[tmp.name] == f"its writer (pid {live_pid}) is running"
    assert whys[manifest.name] == "a save of x.ckpt is in progress"
    # untouched for two hours: abandoned even though the pid is alive (pids get reused)
    old = time.time() - 7200
    os.utime(tmp, (old, old))
    doc = cli("gc", tmp_path, "--json").json()
    assert {d["name"] for d in doc["done"]} == {tmp.name, manifest.name}
    assert not tmp.exists() and not manifest.exists()


def test_no_pid_check_relies_on_age_only(cli, crashed, tmp_path):
    crashed("data", tmp_path)
    (tmp,) = [n for n in os.listdir(tmp_path) if ".stagesave-tmp" in n]
    # the writer is dead, but on a shared filesystem that proves nothing: too recent to remove
    os.utime(tmp_path / tmp, None)
    assert cli("gc", tmp_path, "--no-pid-check", "--json").json()["found"] == []
    assert cli("gc", tmp_path, "--no-pid-check", "--older-than", "1ms", "--json").json()["done"][0]["name"] == tmp


def test_never_touches_user_files_symlinks_or_evidence(cli, crashed, tmp_path):
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    crashed("data", outside)  # real debris, but outside the root
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    root.mkdir()
    (root / "notes.stagesave.json").write_text("user's own file")
    (root / "data.tmp").write_text("user temp")
    (root / "x.ckpt.deadbeef.stagesave.json.bak").write_text("backup")
    os.symlink(victim, root / ".evil.ckpt.1-0123abcd.stagesave-tmp")  # a link with a debris name
    os.symlink(outside, root / "linked")  # a linked folder full of debris
    os.symlink(outside, root / ".linked.1-0123abcd.stagesave-tmp")
    # evidence: a checkpoint whose manifest no longer matches it (corrupt, not debris)
    path = write_checkpoints(root, steps=(1,))[0]
    with open(path, "ab") as f:
        f.write(b"junk")
    before_root, before_outside = _tree(root), _tree(outside)
    doc = cli("gc", root, "--older-than", "1ms", "--json").json()
    assert doc["found"] == [] and doc["errors"] == []
    assert _tree(root) == before_root and _tree(outside) == before_outside
    assert victim.read_bytes() == b"precious"
    with stagesave.Checkpointer() as ck:
        assert ck.verify(path).status == "corrupt"


def test_stale_manifest_of_a_replaced_file_is_debris_but_a_mismatch_is_not(tmp_path):
    paths = write_checkpoints(tmp_path, steps=(1,))
    store = LocalStore(str(tmp_path))
    assert find_debris(store)[0] == []
    flip_byte(paths[0], 10)  # corrupt bytes, same size and id: still its own manifest
    assert find_debris(store)[0] == []


def test_pid_alive():
    assert pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not pid_alive(p.pid)
    assert not pid_alive(0) and not pid_alive(-5)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions: no EACCES to provoke")
def test_collect_garbage_reports_errors_and_goes_on(tmp_path, crashed):
    crashed("manifest", tmp_path)
    os.chmod(tmp_path, 0o555)  # real EACCES on unlink
    try:
        report = collect_garbage(LocalStore(str(tmp_path)))
    finally:
        os.chmod(tmp_path, 0o755)
    assert len(report.errors) == 2 and report.done == []
    assert all("Permission denied" in e for e in report.errors)


def test_gc_missing_root(cli, tmp_path):
    r = cli("gc", tmp_path / "nope")
    assert r.code == 1 and r.err == f"stagesave: error: {tmp_path / 'nope'} does not exist\n"
