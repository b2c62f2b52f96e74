"""A Ctrl-C while a save hands its order to the writer agent, and a forked child using the
Checkpointer it inherited: later saves are right, nothing hangs, the child is told why.

The interrupt is a real ``SIGINT`` sent to this process; where it lands (inside the order's
pickling, halfway through sending it) is arranged by wrapping the function it interrupts."""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
import traceback

import pytest
import torch
from agentwatch import exited

import stagesave
from stagesave.agent import wire
from stagesave.errors import ClosedError, UsageError


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # the handler raises KeyboardInterrupt at the next bytecode


def _equal(loaded: dict, state: dict) -> bool:
    return loaded.keys() == state.keys() and all(
        torch.equal(loaded[k], v) for k, v in state.items())


def test_a_ctrl_c_while_an_order_is_pickled_leaves_later_saves_right(tmp_path, shm, monkeypatch):
    """The trainer's layouts are changes to what the agent last received: a save interrupted
    before its order was sent must not count as sent (every later save was damaged)."""
    real, armed = wire.dumps, [False]

    def dumps(message: object) -> bytes:
        data = real(message)
        if armed[0] and isinstance(message, wire.Order):
            armed[0] = False
            _ctrl_c()
        return data

    monkeypatch.setattr(wire, "dumps", dumps)
    a = {"a": torch.arange(1000.0), "b": torch.ones(3, 5)}
    b = {"x": torch.randn(300), "y": torch.randn(7, 11), "z": torch.arange(50)}
    root = tmp_path / "ck"
    with stagesave.Checkpointer(root, writer="process") as ck:
        ck.save(a, "a.ckpt").result(60)
        armed[0] = True
        with pytest.raises(KeyboardInterrupt):
            ck.save(b, "b.ckpt")
        for name in ("b1.ckpt", "b2.ckpt"):
            ck.save(b, name).result(60)
        assert ck.writer.agent is not None and ck.writer.agent.lost is None  # still the agent's
    with stagesave.Checkpointer(root, writer="thread") as ck:
        for name in ("b1.ckpt", "b2.ckpt"):
            assert _equal(ck.load(root / name), b), name
        assert _equal(ck.load(root / "a.ckpt"), a)
    assert sorted(os.listdir(root)) == ["a.ckpt", "b1.ckpt", "b2.ckpt"]
    assert os.listdir(shm) == []


def test_a_ctrl_c_halfway_through_sending_an_order_hangs_nothing(tmp_path, shm, monkeypatch):
    """Half an order in the stream: the agent cannot read the next one right. It is stopped,
    this process writes what it had, and close() returns."""
    real, armed = wire.send_bytes, [False]

    def send_bytes(sock, data: bytes) -> None:
        if armed[0] and len(data) > 1 << 16:
            armed[0] = False
            sock.sendall(wire._LEN.pack(len(data)) + data[: len(data) // 2])
            _ctrl_c()
        real(sock, data)

    monkeypatch.setattr(wire, "send_bytes", send_bytes)
    first = {"w": torch.randn(1000)}
    big = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}  # an order of ~1 MB
    root = tmp_path / "ck"
    with stagesave.Checkpointer(root, writer="process") as ck:
        ck.save(first, "first.ckpt").result(60)
        agent = ck.writer.agent
        assert agent is not None and agent.pid is not None
        armed[0] = True
        with pytest.raises(KeyboardInterrupt):
            ck.save(big, "big.ckpt")
        assert exited(agent.pid, 10), "the agent was not stopped"
        with pytest.warns(RuntimeWarning, match="a message to it was interrupted midway"):
            ck.save(big, "after.ckpt").result(60)
    with stagesave.Checkpointer(root, writer="thread") as ck:
        assert _equal(ck.load(root / "after.ckpt"), big)
        assert _equal(ck.load(root / "first.ckpt"), first)
    assert sorted(os.listdir(root)) == ["after.ckpt", "first.ckpt"]
    assert os.listdir(shm) == []


def test_a_save_refused_by_a_racing_close_is_not_written_by_the_agent(tmp_path, shm):
    """The order was handed over before close() refused the job: the agent, which runs every
    order it holds when it exits, must drop this one (its buffer was given back)."""
    root = tmp_path / "ck"
    ck = stagesave.Checkpointer(root, writer="process")
    ck.save({"w": torch.ones(8)}, "kept.ckpt").result(60)
    route = ck.writer.route

    closing = threading.Thread(target=ck.close)

    def route_then_close(job, settings):
        routed = route(job, settings)
        closing.start()  # close() wins the race right after the hand-over
        while not ck.pipeline._closed:  # the race's moment, made to happen
            time.sleep(0.001)
        time.sleep(0.5)  # close() went on towards telling the agent to exit
        return routed

    ck.writer.route = route_then_close
    with pytest.raises(ClosedError, match="it was not written"):
        ck.save({"w": torch.zeros(8)}, "refused.ckpt")
    closing.join(60)
    assert not closing.is_alive()
    assert sorted(os.listdir(root)) == ["kept.ckpt"]
    assert os.listdir(shm) == []


def test_an_agent_told_to_exit_removes_the_segments_it_knows(tmp_path, shm, monkeypatch):
    """A trainer killed during close(), after its agent exited but before it removed its own
    segments (stood for here by a memory release that does nothing), leaves none behind."""
    root = tmp_path / "ck"
    ck = stagesave.Checkpointer(root, writer="process")
    ck.save({"w": torch.ones(1 << 18)}, "a.ckpt").result(60)
    assert os.listdir(shm) != []
    agent = ck.writer.agent
    assert agent is not None and agent.pid is not None
    monkeypatch.setattr(ck.memory, "close", lambda: None)  # the trainer dies right here
    ck.close()
    assert exited(agent.pid, 10)
    assert os.listdir(shm) == []
    assert sorted(os.listdir(root)) == ["a.ckpt"]


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_forked_child_reads_through_its_inherited_checkpointer_and_may_not_save(
        tmp_path, shm, writer):
    """The child forks while the parent's writer is busy with a save: the parent's queue, its
    pending saves and its threads are not the child's to wait for."""
    state = {"w": torch.randn(1 << 16)}
    tmp_path = tmp_path / "ck"
    ck = stagesave.Checkpointer(tmp_path, writer=writer)
    try:
        ck.save(state, "parent.ckpt").result(60)
        ck.load(tmp_path / "parent.ckpt")  # the parent's I/O threads exist
        busy = ck.save({"big": torch.randn(16 << 20)}, "busy.ckpt")  # in flight at the fork
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            code = 1
            try:
                faulthandler.dump_traceback_later(60, exit=True)  # a hang ends the child
                torch.set_num_threads(1)  # as a DataLoader worker: torch's pool is the parent's
                said = ""
                try:
                    ck.save(state, "child.ckpt")
                except UsageError as exc:
                    said = str(exc)
                ck.wait()
                ok = (_equal(ck.load(tmp_path / "parent.ckpt"), state)
                      and ck.verify(tmp_path / "parent.ckpt").status == "verified"
                      and ck.latest() is not None and ck.pending() == 0)
                os.write(write_end, f"{ok}|{said}".encode())
                code = 0
            except BaseException:  # noqa: BLE001 - the child reports any failure
                os.write(write_end, traceback.format_exc().encode())
            finally:
                os._exit(code)
        os.close(write_end)
        busy.result(60)
        _, status = os.waitpid(pid, 0)
        report = os.read(read_end, 4096).decode()
        os.close(read_end)
        assert os.waitstatus_to_exitcode(status) == 0, report
        ok, said = report.split("|", 1)
        assert ok == "True"
        assert "forked" in said and "make a new Checkpointer in the child" in said
        assert sorted(os.listdir(tmp_path)) == ["busy.ckpt", "parent.ckpt"]
        ck.save(state, "later.ckpt").result(60)  # the parent's writer is untouched
    finally:
        ck.close()
    assert sorted(os.listdir(tmp_path)) == ["busy.ckpt", "later.ckpt", "parent.ckpt"]
