"""When a save returns committed, and resources following the run (issue 17).

A ``save_state`` made inside a training loop (an optimizer of the Accelerator stepped since the
previous save or load) returns after staging; any other returns committed. ``end_training()``,
``free_memory()``/``clear()`` and a dropped Accelerator give stagesave's threads and buffers back,
after committing what was pending. Everything runs a real Accelerator on real files; the only
control is a real job queued on the writer thread that waits for an event (to hold a commit back
for as long as the test needs to look).
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
import weakref
from typing import Any

import pytest
import stagesave.accelerate as sa
import torch
from accel_helpers import build, train, tree
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration

import stagesave
from stagesave.errors import CheckpointError

_before: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _threads_before() -> None:
    """The threads alive when a test starts (an earlier test's may still be ending)."""
    _before.clear()
    _before.update(threading.enumerate())


def _threads() -> list[str]:
    """stagesave's threads started since the test began, still alive."""
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("stagesave") and t not in _before)


def _rss_mib() -> float:
    """Resident memory from /proc/self/statm, after glibc gave back the free heap pages it keeps
    for reuse (freed tensors of a few MiB come from the heap; a leaked buffer stays counted)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _auto(project: Any, total_limit: int | None = None) -> Any:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=total_limit))


def _explicit() -> Any:
    """An Accelerator saving to folders it is given (no automatic naming)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True)


def _hold_writer(ckpt: sa.AcceleratorCheckpointer, kind: str = "auto") -> threading.Event:
    """Queue a job that waits on the returned event: saves submitted after it cannot commit."""
    gate = threading.Event()
    # private: holding the writer thread needs the core Checkpointer behind the adapter
    ckpt._checkpointer(kind).run_after(lambda: gate.wait(60), description="gate")
    return gate


def _listings(project: Any, stagesave_on: bool, saves: int) -> list[list[str]]:
    """Accelerate's own test pattern: save_state() over and over with no training, and look at
    the project folder right after each call returns."""
    acc = _auto(project, total_limit=2)
    build(acc)
    if stagesave_on:
        sa.enable(acc)
    seen = []
    for _ in range(saves):
        acc.save_state()
        seen.append(tree(str(project)))
    acc.end_training()
    return seen


def test_project_listing_right_after_each_save_state_is_plain_accelerates(tmp_path):
    """Automatic naming with total_limit=2 and no training step: the whole project folder,
    hidden entries included, right after each save_state() returns, equals plain Accelerate's
    (test_checkpoint_deletion / test_with_save_limit of Accelerate's own suite)."""
    plain = _listings(tmp_path / "plain", stagesave_on=False, saves=4)
    ours = _listings(tmp_path / "staged", stagesave_on=True, saves=4)
    assert ours == plain
    assert sorted(os.listdir(tmp_path / "staged")) == ["checkpoints"]
    assert sorted(os.listdir(tmp_path / "staged" / "checkpoints")) == [
        "checkpoint_2",
        "checkpoint_3",
    ]
    for name in ("checkpoint_2", "checkpoint_3"):
        assert stagesave.verify(tmp_path / "staged" / "checkpoints" / name).status == "verified"


def test_a_save_after_a_training_step_is_asynchronous_and_one_without_is_committed_on_return(
    tmp_path,
):
    acc = _auto(tmp_path)
    run = build(acc)
    ckpt = sa.enable(acc)
    root = tmp_path / "checkpoints"

    train(acc, run, 1)  # an optimizer step: the next save sits inside a training loop
    gate = _hold_writer(ckpt)
    assert acc.save_state() == root / "checkpoint_0"
    assert not (root / "checkpoint_0").exists() and ckpt.pending() == 2  # the gate, then the save
    gate.set()
    ckpt.wait()
    assert stagesave.verify(root / "checkpoint_0").status == "verified"

    # no step since the previous save: save_state returns only once the folder is committed
    gate = _hold_writer(ckpt)
    opener = threading.Timer(0.3, gate.set)
    opener.start()
    t0 = time.monotonic()
    assert acc.save_state() == root / "checkpoint_1"
    assert time.monotonic() - t0 >= 0.3 and ckpt.pending() == 0
    assert stagesave.verify(root / "checkpoint_1").status == "verified"

    # a load counts as the end of a training stretch as well
    train(acc, run, 1)
    acc.load_state()
    gate = _hold_writer(ckpt)
    threading.Timer(0.3, gate.set).start()
    acc.save_state()
    assert ckpt.pending() == 0 and stagesave.verify(root / "checkpoint_2").status == "verified"

    # the handle-returning API follows the same rule
    train(acc, run, 1)
    gate = _hold_writer(ckpt)
    handle = ckpt.save_state()
    assert handle is not None and not handle.done()
    gate.set()
    handle.result()
    handle = ckpt.save_state()
    assert handle is not None and handle.done() and handle.result().error is None
    sa.disable(acc)


def test_sync_outside_training_false_keeps_every_save_asynchronous(tmp_path):
    acc = _auto(tmp_path)
    build(acc)
    ckpt = sa.enable(acc, sync_outside_training=False)
    gate = _hold_writer(ckpt)
    acc.save_state()
    assert not (tmp_path / "checkpoints" / "checkpoint_0").exists() and ckpt.pending() == 2
    gate.set()
    sa.disable(acc)
    assert stagesave.verify(tmp_path / "checkpoints" / "checkpoint_0").status == "verified"


def _break_parent_while_held(ckpt: sa.AcceleratorCheckpointer, parent: Any) -> threading.Event:
    """Hold the writer; once the next save is queued behind it, replace the folder's parent by a
    file and let the writer go: the commit fails for real."""
    gate = _hold_writer(ckpt, "plain")
    writer = ckpt._checkpointer("plain")

    def replace_then_open() -> None:
        deadline = time.monotonic() + 60
        while writer.pending() < 2 and time.monotonic() < deadline:  # the gate, then the save
            time.sleep(0.01)
        shutil.rmtree(parent)
        parent.write_bytes(b"not a folder")
        gate.set()

    threading.Thread(target=replace_then_open, daemon=True).start()
    return gate


def test_a_save_outside_training_raises_its_failure_from_save_state(tmp_path):
    acc = _explicit()
    build(acc)
    ckpt = sa.enable(acc)
    parent = tmp_path / "explicit"
    parent.mkdir()
    _break_parent_while_held(ckpt, parent)
    with pytest.raises(CheckpointError, match=r"saving checkpoint .*explicit/ck failed"):
        acc.save_state(str(parent / "ck"))
    assert parent.read_bytes() == b"not a folder"  # nothing was published
    acc.end_training()  # the failure was delivered: nothing left to raise
    assert _threads() == []


def test_end_training_commits_pending_saves_raises_failures_and_gives_everything_back(tmp_path):
    acc = _auto(tmp_path, total_limit=2)
    run = build(acc)
    ckpt = sa.enable(acc)
    train(acc, run, 1)
    gate = _hold_writer(ckpt)
    acc.save_state()  # asynchronous: still held when end_training() starts
    assert ckpt.pending() > 0 and _threads()
    threading.Timer(0.3, gate.set).start()  # (after the check: a slow save_state is no race)
    acc.end_training()
    assert _threads() == [] and ckpt.pending() == 0
    assert stagesave.verify(tmp_path / "checkpoints" / "checkpoint_0").status == "verified"
    # the Accelerator still saves afterwards: stagesave's threads come back on demand, and go again
    train(acc, run, 1)
    acc.save_state()
    assert _threads()  # created again
    acc.end_training()
    assert _threads() == []
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0", "checkpoint_1"]
    sa.disable(acc)


def test_a_failure_pending_at_end_training_is_raised_there_after_accelerates_end(tmp_path):
    acc = _explicit()
    run = build(acc)
    ckpt = sa.enable(acc)
    parent = tmp_path / "explicit"
    parent.mkdir()
    train(acc, run, 1)
    _break_parent_while_held(ckpt, parent)
    acc.save_state(str(parent / "ck"))  # asynchronous: returns before the failure
    with pytest.raises(CheckpointError, match=r"saving checkpoint .*explicit/ck failed"):
        acc.end_training()
    assert _threads() == []
    sa.disable(acc)  # the failure was delivered once


@pytest.mark.parametrize("method", ["free_memory", "clear"])
def test_free_memory_and_clear_commit_and_give_everything_back(tmp_path, method):
    acc = _auto(tmp_path)
    run = build(acc)
    ckpt = sa.enable(acc)
    train(acc, run, 1)
    gate = _hold_writer(ckpt)
    acc.save_state()
    assert ckpt.pending() > 0
    threading.Timer(0.2, gate.set).start()
    model = run["models"][0]
    (model,) = getattr(acc, method)(model)  # Accelerate's own method ran after stagesave's release
    assert model is None and acc._models == [] and acc.step == 0
    assert _threads() == [] and ckpt.pending() == 0
    assert stagesave.verify(tmp_path / "checkpoints" / "checkpoint_0").status == "verified"
    sa.disable(acc)


def test_a_dropped_accelerator_commits_and_gives_everything_back(tmp_path):
    acc = _auto(tmp_path)
    run = build(acc)
    ckpt = sa.enable(acc)
    train(acc, run, 1)
    gate = _hold_writer(ckpt)
    acc.save_state()
    assert ckpt.pending() > 0
    threading.Timer(0.2, gate.set).start()
    alive = weakref.ref(acc)
    del acc, ckpt, run, gate
    gc.collect()  # (stagesave adds no reference cycle; Accelerate's own objects may hold some)
    assert alive() is None
    assert _threads() == []
    assert stagesave.verify(tmp_path / "checkpoints" / "checkpoint_0").status == "verified"


def test_nothing_of_stagesave_keeps_an_accelerator_alive(tmp_path):
    acc = _auto(tmp_path)
    sa.enable(acc)
    alive = weakref.ref(acc)
    gc.disable()
    try:
        del acc
        assert alive() is None  # freed by reference counting alone: no cycle through stagesave
    finally:
        gc.enable()
    assert _threads() == []


def _one_run(project: Any, width: int) -> None:
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=1))
    sa.enable(acc)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, width)
    for _ in range(2):
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        acc.save_state()
    acc.end_training()


def test_a_hundred_accelerators_in_a_row_keep_no_threads_and_flat_memory(tmp_path):
    """Issue 17: 100 Accelerators created one after the other (a sweep), each enabling stagesave,
    training, saving inside its loop and ending: zero stagesave threads after each, and RSS
    within one state size (plus a small allowance) of the first iteration's."""
    width = 512
    state_mib = 2 * (width * width + width) * 4 * 3 / 2**20  # parameters + two Adam moments: ~6 MiB
    # warm-up of Python, torch and Accelerate caches over the first iterations (~12 MiB here)
    allowance_mib = 24.0
    after: list[float] = []
    for i in range(100):
        project = tmp_path / f"run{i}"
        _one_run(project, width)
        assert _threads() == [], f"after Accelerator {i}: {_threads()}"
        gc.collect()
        after.append(_rss_mib())
        assert stagesave.verify(project / "checkpoints" / "checkpoint_1").status == "verified"
        shutil.rmtree(project)
    bound = after[0] + state_mib + allowance_mib
    assert max(after) <= bound, (
        f"RSS after each (MiB): {[round(r) for r in after]}; bound {bound:.0f}"
    )
    print(
        f"RSS after Accelerators 0, 9, 49, 99: {[round(after[i], 1) for i in (0, 9, 49, 99)]} MiB "
        f"(max {max(after):.1f}, bound {bound:.1f})"
    )


def test_stagesave_gc_cleans_a_legacy_staging_folder(tmp_path):
    """Versions before issue 17 assembled folders in <project_dir>/.stagesave-staging (still
    named by ``STAGING_DIR``); what a killed save left there goes with ``stagesave gc`` on it."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    legacy = tmp_path / sa.STAGING_DIR
    # the core's folder in a staging_dir
    assembled = legacy / f"checkpoint_2.{dead.pid}-0123abcd.stagesave-tmp"
    work = legacy / f".checkpoint_3.{dead.pid}-4567cdef.stagesave-tmp"  # an FSDP work folder
    for folder in (assembled, work / "parts"):
        folder.mkdir(parents=True)
        (folder / "optimizer.bin").write_bytes(b"x" * 4096)
    user = legacy / "notes.txt"  # not stagesave's: left alone
    user.write_text("mine")
    cli = os.path.join(os.path.dirname(sys.executable), "stagesave")
    done = subprocess.run([cli, "gc", str(legacy)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(legacy)) == ["notes.txt"]
