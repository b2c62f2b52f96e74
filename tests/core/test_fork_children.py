"""A process forked from a trainer (a DataLoader worker, a fork-started helper) inherits copies
of its Checkpointers and stores; when it exits, those copies are not its to flush or close: the
parent's writer agent keeps serving, its shared-memory segments stay, and the child's exit does
not wait for work only the parent's threads can do. And a telemetry callback may wait for a
tiered store's uploads. (Review findings, 2026-12-06; each test fails without its fix.)"""

from __future__ import annotations

import multiprocessing
import os
import warnings
from pathlib import Path

import torch

import stagesave
from stagesave import TieredStore

_fork = multiprocessing.get_context("fork")


def _nothing() -> None:
    """A child that does nothing and exits normally (through threading's exit hooks)."""


def _state(step: int) -> dict[str, object]:
    return {"step": step, "w": torch.full((300_000,), float(step))}


def test_a_forked_child_that_exits_leaves_the_parents_writer_agent_and_segments(
        tmp_path: Path, shm: Path) -> None:
    with warnings.catch_warnings(record=True) as seen, \
            stagesave.Checkpointer(tmp_path / "ck", writer="process") as ck:
        warnings.simplefilter("always")
        ck.save(_state(1), "a.ckpt").result(60)
        agent = ck.writer.agent
        assert agent is not None and agent.proc is not None
        segments = sorted(p.name for p in shm.iterdir())
        assert segments
        child = _fork.Process(target=_nothing)
        child.start()
        child.join(60)
        assert child.exitcode == 0
        # the child's exit told the agent nothing and removed nothing
        assert agent.proc.poll() is None and agent.lost is None
        assert sorted(p.name for p in shm.iterdir()) == segments
        ck.save(_state(2), "b.ckpt").result(60)  # still through the agent
        assert ck.writer.agent is agent and agent.lost is None
    assert [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)] == []
    assert stagesave.load(tmp_path / "ck" / "b.ckpt")["step"] == 2


def test_a_child_forked_while_a_tiered_commit_reports_exits(tmp_path: Path) -> None:
    """Forked while the local commit's telemetry goes out (its upload not queued yet): the
    child's exit does not wait for an upload only the parent's writer thread will queue."""
    exits: list[int | None] = []

    def fork_on_local(tel: stagesave.SaveTelemetry) -> None:
        if tel.tier == "local":
            child = _fork.Process(target=_nothing)
            child.start()
            child.join(30)
            exits.append(child.exitcode)
            if child.exitcode is None:
                child.kill()

    with TieredStore(str(tmp_path / "local"), str(tmp_path / "remote")) as store, \
            stagesave.Checkpointer(store, writer="thread",
                                   telemetry_callback=fork_on_local) as ck:
        ck.save(_state(1), "a.ckpt").result(60)
        uploads = store.wait_uploads(timeout=60)
    assert exits == [0]
    assert [(u.tier, u.error) for u in uploads] == [("remote", None)]
    assert os.path.exists(tmp_path / "remote" / "a.ckpt")


def test_a_telemetry_callback_may_wait_for_the_tiered_uploads(tmp_path: Path) -> None:
    """The callback runs on the writer thread before that save's upload is queued: waiting for
    the uploads there returns (it deadlocked: the wait counted the upload only that thread
    could queue)."""
    waited: list[int] = []

    def wait_on_local(tel: stagesave.SaveTelemetry) -> None:
        if tel.tier == "local":
            waited.append(len(store.wait_uploads(timeout=20)))

    with TieredStore(str(tmp_path / "local"), str(tmp_path / "remote")) as store, \
            stagesave.Checkpointer(store, writer="thread",
                                   telemetry_callback=wait_on_local) as ck:
        for step in (1, 2):
            ck.save(_state(step), f"s{step}.ckpt").result(60)
        store.wait_uploads(timeout=60)
    assert len(waited) == 2
    assert sorted(os.listdir(tmp_path / "remote")) == ["s1.ckpt", "s2.ckpt"]
