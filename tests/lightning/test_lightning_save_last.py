"""``save_last`` in every mode Lightning supports: ``last.ckpt`` always names a committed
checkpoint, also across a SIGKILL while a save is pending."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_helpers import (
    HERE,
    HeldCheckpointIO,
    StepBatches,
    TinyModel,
    WriterGate,
    make_trainer,
    run_python,
)
from stagesave.lightning import StagedCheckpointIO

import stagesave


class LastProbe(Callback):
    """Before every batch, records what ``last.ckpt`` is: absent, dangling, or a checkpoint
    with a status (``verified`` when its bytes match the proof inside it)."""

    def __init__(self, d: Path, release: Any, first_held: Any = None) -> None:
        self.last = d / "last.ckpt"
        self.release = release
        self.first_held = first_held
        self.seen: list[str] = []

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == 3 and self.first_held is not None:
            assert self.first_held()  # the step-2 saves are done, later ones are held
        for _ in range(5):
            if os.path.lexists(self.last) and not self.last.exists():
                self.seen.append("dangling")
            elif self.last.exists():
                target = self.last.resolve()  # read the link once: the writer thread moves it
                try:
                    self.seen.append(stagesave.verify(str(target)).status)
                except FileNotFoundError:
                    # The link moved on and the checkpoint it held was removed (queued behind
                    # that link update) between our two reads: look again. A dangling link
                    # would still be caught above.
                    if self.last.resolve() != target:
                        continue
                    raise
            else:
                self.seen.append("absent")
            return

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.release()

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        self.release()


def _eventually(cond: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _run(tmp_path: Path, io: Any, release: Any, save_last: Any, top_k: int = 1,
         first_held: Any = None) -> tuple[LastProbe, Path]:
    d = tmp_path / "ckpt"
    probe = LastProbe(d, release, first_held)
    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=top_k, save_last=save_last)
    make_trainer(tmp_path, [io], [mc, probe], max_steps=8).fit(TinyModel(), StepBatches())
    return probe, d


@pytest.mark.parametrize("save_last", [True, "link"])
def test_last_is_always_a_committed_checkpoint(tmp_path: Path, save_last: Any) -> None:
    # Hold the writer on the second committed save: with save_last=True the last.ckpt copy of
    # step 2, so every later save waits; with "link" the step-4 save, so the link update to it
    # (an ordered step behind that save) and everything after it wait.
    gate = WriterGate(hold_after=2)
    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=8)
    last = tmp_path / "ckpt" / "last.ckpt"

    def first_held() -> bool:  # the step-2 saves committed (and, with "link", last points there)
        return (gate.entered.wait(30) if save_last is True else True) and _eventually(last.exists)

    probe, d = _run(tmp_path, io, gate.open, save_last, first_held=first_held)
    assert set(probe.seen) <= {"absent", "verified"}
    # steps 3-7: the step-2 checkpoint while later ones are held
    assert probe.seen[3:] == ["verified"] * 5
    assert gate.entered.is_set()
    assert last.is_symlink() == (save_last == "link")
    assert stagesave.verify(str(last)).status == "verified"  # the link verifies as its target
    assert torch.load(last, weights_only=False)["global_step"] == 8
    files = sorted(p.name for p in d.glob("*.ckpt") if not p.is_symlink())
    assert files == (
        ["epoch=0-step=8.ckpt"] if save_last == "link" else ["epoch=0-step=8.ckpt", "last.ckpt"]
    )


def test_async_checkpointio_link_fails_while_the_first_save_is_pending(tmp_path: Path) -> None:
    held = HeldCheckpointIO(hold_after=0)
    with pytest.raises(FileNotFoundError, match=r"epoch=0-step=2.ckpt"):
        _run(tmp_path, AsyncCheckpointIO(held), held.release.set, "link")
    held.release.set()


def test_async_checkpointio_link_dangles_while_a_save_is_pending(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    held = HeldCheckpointIO(hold_after=1)
    probe, _ = _run(tmp_path, AsyncCheckpointIO(held), held.release.set, "link")
    assert "dangling" in probe.seen


def test_plugin_link_works_from_the_first_save(tmp_path: Path) -> None:
    probe, d = _run(tmp_path, StagedCheckpointIO(), lambda: None, "link")
    assert set(probe.seen) <= {"absent", "verified"}  # never a dangling link, never a failure
    assert os.readlink(d / "last.ckpt") == "epoch=0-step=8.ckpt"


def test_save_last_false_writes_no_last(tmp_path: Path) -> None:
    io = StagedCheckpointIO()
    _, d = _run(tmp_path, io, lambda: None, False, top_k=-1)
    assert sorted(p.name for p in d.glob("*.ckpt")) == [
        f"epoch=0-step={s}.ckpt" for s in (2, 4, 6, 8)
    ]


def test_link_to_a_failed_save_keeps_the_previous_target(tmp_path: Path, gate: WriterGate) -> None:
    io = StagedCheckpointIO(telemetry_callback=gate, max_pending=8)
    good, bad = tmp_path / "good", tmp_path / "bad"
    link = good / "last.ckpt"
    io.save_checkpoint({"v": torch.ones(3)}, good / "a.ckpt")
    io.link(good / "a.ckpt", link)
    assert gate.entered.wait(30)
    io.save_checkpoint({"v": torch.zeros(3)}, bad / "b.ckpt")
    io.link(bad / "b.ckpt", link)
    bad.rename(tmp_path / "gone")
    (tmp_path / "bad").write_bytes(b"")  # the directory is replaced by a file: the write fails
    gate.open()
    with pytest.raises(stagesave.CheckpointError):
        io.wait()
    assert os.readlink(link) == "a.ckpt"
    assert torch.equal(io.load_checkpoint(link)["v"], torch.ones(3))
    io.teardown()


# ---------------------------------------------------------------- SIGKILL while the save is pending
class StartStep(Callback):
    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.step = trainer.global_step


def _crash_then_resume(tmp_path: Path, mode: str) -> tuple[dict[str, Any], int | None]:
    proc = run_python([str(HERE / "_child_link.py"), mode, str(tmp_path)])
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    at_kill = json.loads(proc.stdout.strip().splitlines()[-1])
    io: Any = AsyncCheckpointIO() if mode == "async" else StagedCheckpointIO()
    start = StartStep()
    mc = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=1, save_last="link"
    )
    make_trainer(tmp_path, [io], [mc, start], max_steps=6).fit(
        TinyModel(), StepBatches(), ckpt_path="last"
    )
    return at_kill, start.step


def test_async_checkpointio_crash_during_link_trains_from_scratch(tmp_path: Path) -> None:
    at_kill, start = _crash_then_resume(tmp_path, "async")
    # last.ckpt pointed at a file never written; step 2 was already removed.
    assert at_kill == {"last": "epoch=0-step=4.ckpt", "files": ["last.ckpt"]}
    assert start == 0  # ckpt_path="last" silently started over


def test_plugin_crash_during_link_resumes_from_the_committed_checkpoint(tmp_path: Path) -> None:
    at_kill, start = _crash_then_resume(tmp_path, "staged")
    assert at_kill["last"] == "epoch=0-step=2.ckpt"
    assert "epoch=0-step=2.ckpt" in at_kill["files"]
    assert start == 2


def test_links_with_changing_names_replace_each_other(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=1, save_last="link")
    # a new link name each time: the previous link is removed
    mc.CHECKPOINT_NAME_LAST = "last-{step}"
    make_trainer(tmp_path, [StagedCheckpointIO()], [mc], max_steps=6).fit(
        TinyModel(), StepBatches()
    )
    links = sorted(p.name for p in d.iterdir() if p.is_symlink())
    assert links == ["last-step=6.ckpt"]
    assert os.readlink(d / "last-step=6.ckpt") == "epoch=0-step=6.ckpt"
    assert sorted(p.name for p in d.glob("*.ckpt") if not p.is_symlink()) == ["epoch=0-step=6.ckpt"]


# ---------------------------------------------------------------- SIGKILL inside a commit
@pytest.mark.parametrize("n", range(1, 7))
def test_sigkill_after_each_commit_rename_leaves_last_on_a_committed_checkpoint(
    tmp_path: Path, n: int
) -> None:
    # The writer publishes this run in six renames, in order: the step-2 file, the link to it,
    # the step-4 file, the link, the step-6 file, the link (the link's commit is the core's
    # commit_link). Killed right after the n-th: only Lightning's names are there (no temporary
    # left: each rename consumed its own), last.ckpt names the newest checkpoint whose link
    # update ran, that checkpoint verifies, and ckpt_path="last" resumes from it.
    proc = run_python([str(HERE / "_child_crash_link.py"), str(tmp_path)],
                      # the crash point is in the trainer's own writer
                      env={"STAGESAVE_CRASH_AT": f"after_rename:{n}", "STAGESAVE_WRITER": "thread"})
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-4000:]
    d = tmp_path / "ckpt"
    linked = 2 * (n // 2)  # the step last.ckpt was moved to (0: not made yet)
    newest = 2 * ((n + 1) // 2)  # the newest file committed
    listing = sorted(os.listdir(d))
    assert f"epoch=0-step={newest}.ckpt" in listing
    assert all(
        p == "last.ckpt" or (p.startswith("epoch=0-step=") and p.endswith(".ckpt")) for p in listing
    ), listing
    last = d / "last.ckpt"
    start = StartStep()
    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=1, save_last="link")
    trainer = make_trainer(tmp_path, [StagedCheckpointIO()], [mc, start], max_steps=8)
    if linked == 0:
        assert not os.path.lexists(last)
    else:
        assert os.readlink(last) == f"epoch=0-step={linked}.ckpt"
        assert stagesave.verify(last).status == "verified"
    trainer.fit(TinyModel(), StepBatches(), ckpt_path="last")
    assert start.step == linked and trainer.global_step == 8
