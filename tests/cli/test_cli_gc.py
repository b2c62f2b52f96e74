"""`gc`: debris of real SIGKILLed saves is removed (and stale format-1 manifests); nothing else
ever is (live saves, user files that only look like stagesave's, symlink targets, evidence of
corruption)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clitools import small_state, write_checkpoints, write_format1
from proofkit import flip_byte

import stagesave
from stagesave.restore.gc import collect_garbage, find_debris
from stagesave.restore.liveness import pid_alive
from stagesave.stores.local import LocalStore


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
    crashed("proof", tmp_path)  # format 2: a sealed temporary, never published
    write_format1(tmp_path, "gone.ckpt", small_state(2))
    os.remove(tmp_path / "gone.ckpt")  # format 1: a manifest whose data file is missing
    before = _tree(tmp_path)
    temps = [n for n in before if ".stagesave-tmp" in n]
    orphans = [n for n in before if n.startswith("gone.ckpt.") and n.endswith(".stagesave.json")]
    assert len(temps) == 1 and len(orphans) == 1
    r = cli("gc", tmp_path, "--dry-run", "--json")
    assert r.code == 0
    doc = r.json()
    assert {(d["name"], d["kind"]) for d in doc["found"]} == {
        (temps[0], "temporary"),
        (orphans[0], "orphan-manifest"),
    }
    assert doc["done"] == []
    assert "is not running on this host" in next(
        d["reason"] for d in doc["found"] if d["kind"] == "temporary"
    )
    assert "gone.ckpt does not exist" in next(
        d["reason"] for d in doc["found"] if d["kind"] == "orphan-manifest"
    )
    assert _tree(tmp_path) == before
    text = cli("gc", tmp_path, "-n").out
    assert "would remove temporary" in text and "would reclaim" in text
    r = cli("gc", tmp_path)
    assert r.code == 0 and "2 leftovers" in r.out
    assert _tree(tmp_path) == before - {temps[0], orphans[0]}
    assert stagesave.verify(tmp_path / "step=1.ckpt").status == "verified"
    assert cli("gc", tmp_path, "--json").json()["found"] == []


def test_crash_while_replacing_keeps_the_old_file(cli, crashed, tmp_path):
    crashed("replace", tmp_path)
    with stagesave.Checkpointer() as ck:
        old = ck.verify(tmp_path / "last.ckpt")
    assert old.status == "verified" and old.format == 2 and old.seq == 1
    assert cli("gc", tmp_path).code == 0
    assert sorted(os.listdir(tmp_path)) == [
        "last.ckpt"
    ]  # the file carries its own proof: nothing beside it
    with stagesave.Checkpointer() as ck:
        assert ck.verify(tmp_path / "last.ckpt").status == "verified"
        assert torch.equal(
            ck.load(tmp_path / "last.ckpt")["w"], torch.arange(600_000, dtype=torch.float32)
        )


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
    _, sidecar = write_format1(tmp_path, "x.ckpt", {"w": torch.ones(3)})
    os.remove(tmp_path / "x.ckpt")  # a format-1 manifest of a file a live save is writing
    manifest = tmp_path / os.path.basename(sidecar)
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
    assert (
        cli("gc", tmp_path, "--no-pid-check", "--older-than", "1ms", "--json").json()["done"][0][
            "name"
        ]
        == tmp
    )


def test_never_touches_user_files_symlinks_or_evidence(cli, crashed, tmp_path):
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    crashed("data", outside)  # real debris, but outside the root
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    root.mkdir()
    look_alikes = {
        "notes.stagesave.json": "user's own file",
        # named like a manifest, not one: its 'data file' is missing
        "notes.ckpt.123.stagesave.json": "named like a manifest, not one",
        # not a valid manifest
        "x.ckpt.0123.stagesave.json": '{"format": "stagesave", "schema": 1}',
        "x.stagesave-tmp": "not ours",
        ".x.stagesave-tmp": "not ours either",
        "notes.0123abcd.stagesave-tmp": "no leading dot: not a name stagesave gives a file",
        ".y.ckpt.0123abcd.stagesave-tmp.bak": "a backup",
        "data.tmp": "user temp",
        "x.ckpt.deadbeef.stagesave.json.bak": "backup",
    }
    for name, text in look_alikes.items():
        (root / name).write_text(text)
    (root / "mine.stagesave-aside").mkdir()
    (root / "mine.stagesave-aside" / "a.txt").write_text("a user's folder")
    (root / "staging.stagesave-tmp").mkdir()
    os.symlink(victim, root / ".evil.ckpt.1-0123abcd.stagesave-tmp")  # a link with a debris name
    os.symlink(outside, root / "linked")  # a linked folder full of debris
    os.symlink(outside, root / ".linked.1-0123abcd.stagesave-tmp")
    # evidence: checkpoints that no longer match their proofs (corrupt, not debris)
    path = write_checkpoints(root, steps=(1,))[0]
    with open(path, "ab") as f:
        f.write(b"junk")
    old, _ = write_format1(root, "old.ckpt", small_state(1))
    flip_byte(old, 100)
    before_root, before_outside = _tree(root), _tree(outside)
    doc = cli("gc", root, "--older-than", "1ms", "--json").json()
    assert doc["found"] == [] and doc["errors"] == []
    assert _tree(root) == before_root and _tree(outside) == before_outside
    assert victim.read_bytes() == b"precious"
    ignored = {d["name"] for d in doc["ignored"]}
    assert {
        "notes.ckpt.123.stagesave.json",
        "x.ckpt.0123.stagesave.json",
        "x.stagesave-tmp",
        ".x.stagesave-tmp",
        "notes.0123abcd.stagesave-tmp",
        ".y.ckpt.0123abcd.stagesave-tmp.bak",
        "mine.stagesave-aside",
        "staging.stagesave-tmp",
    } <= ignored
    assert not any(k["name"] in ignored for k in doc["kept"])
    r = cli("gc", root, "--older-than", "1ms", "-v")
    assert (
        "files only named like stagesave's left alone" in r.out
        and "ignored x.stagesave-tmp" in r.out
    )
    with stagesave.Checkpointer() as ck:
        assert ck.verify(path).status == "corrupt"
        assert ck.verify(old).status == "corrupt"


def test_stale_format1_manifests_are_debris_but_a_mismatch_is_not(tmp_path):
    store = LocalStore(str(tmp_path))
    path, sidecar = write_format1(tmp_path, "a.ckpt", small_state(1))
    assert find_debris(store)[0] == []
    flip_byte(path, 10)  # corrupt bytes, same size and id: still its own manifest (evidence)
    assert find_debris(store)[0] == []
    # the name now holds a file that carries its own proof: the old sidecar is stale
    stale = Path(sidecar).read_bytes()
    write_checkpoints(tmp_path, steps=(1,))
    os.replace(tmp_path / "step=1.ckpt", path)
    with open(sidecar, "wb") as f:
        f.write(stale)
    (d,) = find_debris(store)[0]
    assert d.name == os.path.basename(sidecar) and d.kind == "orphan-manifest"
    assert "carries its own proof now (format 2)" in d.reason
    collect_garbage(store)
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt"]
    assert stagesave.verify(path).status == "verified"


def test_pid_alive():
    assert pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not pid_alive(p.pid)
    assert not pid_alive(0) and not pid_alive(-5)


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root ignores directory permissions: no EACCES to provoke"
)
def test_collect_garbage_reports_errors_and_goes_on(tmp_path, crashed):
    crashed("proof", tmp_path)
    write_format1(tmp_path, "gone.ckpt", small_state(2))
    os.remove(tmp_path / "gone.ckpt")
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
