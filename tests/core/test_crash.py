"""Crash consistency: a real child process SIGKILLs itself at every point of the commit protocol.

Invariant: afterwards ``latest()`` names the newest checkpoint whose commit completed, it
verifies bit for bit, and nothing uncommitted is ever listed or loaded.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import crashchild
import pytest
import torch

import stagesave
from stagesave._crash import CRASH_POINTS  # fault injection: every named crash point is tested

pytestmark = pytest.mark.usefixtures("thread_writer")  # faults injected in this process

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "stagesave", "crashchild"])

#: Points after which the new checkpoint counts as committed.
COMMITTED_AFTER = {"after_rename", "after_commit", "during_retention"}


def _run(root, step, mode, crash=None):
    """Run one save in a child forked from a server that already imported torch; its exit code."""
    p = _ctx.Process(target=crashchild.save_step, args=(str(root), step, mode, crash))
    p.start()
    p.join(120)
    assert p.exitcode is not None, "child hung"
    return p.exitcode


def _check_invariant(root, expect_steps):
    with stagesave.Checkpointer(root) as ck:
        best = ck.latest(verify=True)
        assert best is not None
        assert ck.verify(best.path).status == "verified"
        loaded_step = (
            ck.load(best.path)
            if not best.is_dir
            else ck.load(os.path.join(best.path, "optimizer.bin"))
        )["step"]
        assert loaded_step in expect_steps, (loaded_step, expect_steps)
        for info in ck.list():
            assert info.status in ("committed",), (info.name, info.status, info.problems)
            assert ".stagesave-tmp" not in info.name
    return loaded_step


@pytest.mark.parametrize("mode", ["file", "file_device", "dir", "dir_replace", "dir_device"])
@pytest.mark.parametrize(
    "point", [p for p in CRASH_POINTS if p != "during_upload" and not p.startswith("dcp_")]
)
def test_sigkill_at_every_crash_point(tmp_path, mode, point):
    assert _run(tmp_path, 1, mode) == 0
    code = _run(tmp_path, 2, mode, crash=point)
    if point in ("after_aside", "into_folder"):
        # Only a folder replacement on a filesystem without RENAME_EXCHANGE has the first step
        # (tests/cli/test_cli_gc.py crashes there with the exchange disabled), only one into a
        # folder of the user's files the second (below)
        assert code == 0
        expect = {2}
    elif point == "during_retention":
        assert code in (0, -signal.SIGKILL)  # retention only deletes with >2 checkpoints
        expect = {2}
    else:
        assert code == -signal.SIGKILL, (point, code)
        expect = {2} if point in COMMITTED_AFTER else {1}
    assert _check_invariant(tmp_path, expect) in expect
    # and the next save after the crash works and becomes the latest
    assert _run(tmp_path, 3, mode) == 0
    assert _check_invariant(tmp_path, {3}) == 3


def test_many_saves_under_random_sigkills(tmp_path):
    """A child saving in a loop is killed at random moments; the invariant holds after each."""
    import random

    rng = random.Random(1234)
    committed_floor = 0
    step = 1
    trials = 12
    for _trial in range(trials):
        parent, child = _ctx.Pipe()
        p = _ctx.Process(target=crashchild.save_loop, args=(str(tmp_path), step, child))
        p.start()
        # Wait for a random number of submitted saves, then kill at a random moment.
        for _ in range(rng.randint(1, 6)):
            if not parent.poll(60):
                break
            parent.recv()
        time.sleep(rng.random() * 0.3)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        with stagesave.Checkpointer(tmp_path) as ck:
            best = ck.latest(verify=True)
            if best is not None:
                loaded = ck.load(best.path)
                assert loaded["step"] >= committed_floor
                assert torch.equal(loaded["w"], torch.full((500_000,), float(loaded["step"])))
                committed_floor = loaded["step"]
                for info in ck.list():
                    assert info.status == "committed", (info.name, info.problems)
            step = (best and ck.load(best.path)["step"] + 1) or step
    assert committed_floor > 0


@pytest.mark.parametrize("point", ["after_proof", "into_folder", "after_rename"])
def test_sigkill_while_saving_into_a_folder_that_holds_the_users_files(tmp_path, point):
    """A folder checkpoint saved over another in a folder that also holds a file of the user's
    is published into the folder, not swapped: a kill at any point leaves the user's file as it
    was, and the folder holds the old checkpoint, the new one, or (killed between the renames)
    none that loads, never a mix."""
    folder = tmp_path / "current"
    folder.mkdir()
    (folder / "notes.txt").write_bytes(b"the user's")
    assert _run(tmp_path, 1, "dir_beside") == 0
    assert _run(tmp_path, 2, "dir_beside", crash=point) == -signal.SIGKILL
    assert (folder / "notes.txt").read_bytes() == b"the user's"
    info = stagesave.verify(folder)
    if point == "into_folder":
        assert info.status == "corrupt", info
        assert "its carrier optimizer.bin is missing" in info.problems[0]
        with stagesave.Checkpointer(tmp_path) as ck, pytest.warns(UserWarning, match="skipping"):
            assert ck.latest(verify=True) is None
    else:
        assert (info.status, info.beside) == ("verified", ["notes.txt"])
        assert _check_invariant(tmp_path, {1, 2}) == (1 if point == "after_proof" else 2)
    assert _run(tmp_path, 3, "dir_beside") == 0  # (warning that it replaced a file: an error)
    assert _check_invariant(tmp_path, {3}) == 3
    assert sorted(os.listdir(folder)) == ["model.safetensors", "notes.txt", "optimizer.bin"]
