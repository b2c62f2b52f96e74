"""``writer="process"``: a writer agent that outlives its trainer (issue 21).

Real processes throughout: trainers forked from a server that imported torch, SIGKILLed right
after ``save()`` returns or during the background write; agents killed at named crash points of
the commit protocol (``STAGESAVE_AGENT_CRASH_AT``); real shared-memory segments.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import agentchild
import pytest
import torch
from agentwatch import exited

import stagesave
from stagesave._crash import AGENT_ENV_VAR  # fault injection: the agent's crash point
from stagesave.agent.segments import (
    abandoned_segments,
    create_segment,
    map_segment,
    owned_segments,
    read_snapshot,
)
from stagesave.formats import Safetensors

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "stagesave", "agentchild"])


def _assert_state(loaded, step, seed):
    expected = agentchild.state_of(step, seed)
    assert loaded["step"] == step and loaded["name"] == expected["name"]
    assert len(loaded["tensors"]) == len(expected["tensors"])
    for got, want in zip(loaded["tensors"], expected["tensors"]):
        assert torch.equal(got, want)


def _trial(root: Path, shm: Path, seed: int, mode: str) -> tuple[list[int], int]:
    """One trainer killed after its saves returned; the steps that returned and the agent pid."""
    saves = random.Random(seed).randint(1, 4)
    parent, child = _ctx.Pipe()
    p = _ctx.Process(target=agentchild.save_then_die,
                     args=(str(root), str(shm), seed, saves, mode, child))
    p.start()
    child.close()
    returned, agent = [], -1
    while True:
        try:
            step, agent = parent.recv()
        except EOFError:
            break
        returned.append(step)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL, p.exitcode
    assert agent > 0 and exited(agent), "the agent did not exit after its trainer died"
    return returned, agent


def test_every_save_that_returned_is_committed_after_a_sigkill_100_trials(tmp_path, shm):
    """100 trainers SIGKILLed right after ``save()`` returned (half of them a random moment
    into the background write): every save that returned is committed and verifies, the newest
    is ``latest()``, the agent exits on its own, and it leaves only the newest file's snapshot."""
    failures = []
    for seed in range(100):
        root = tmp_path / f"t{seed}"
        mode = "after_return" if seed % 2 == 0 else "during_write"
        returned, _agent = _trial(root, shm, seed, mode)
        assert returned, "the trainer returned from no save"
        with stagesave.Checkpointer(root) as ck:
            for step in returned:
                info = ck.verify(root / f"step-{step:03d}.ckpt")
                if info.status != "verified":
                    failures.append((seed, step, info.status, info.problems))
            best = ck.latest()
            assert best is not None and best.path == str(root / f"step-{returned[-1]:03d}.ckpt")
            _assert_state(ck.load(best.path, verify=True), returned[-1], seed)
        assert sorted(os.listdir(root)) == [f"step-{s:03d}.ckpt" for s in returned]
        left = owned_segments(str(shm))
        assert len(left) <= 1, left  # the newest committed file's snapshot, nothing else
        for seg in left:
            snap = read_snapshot(seg)
            assert snap is not None and snap.path == best.path
            os.unlink(seg)
            os.unlink(seg + ".json")
        assert os.listdir(shm) == []
    assert failures == []


def test_agent_killed_mid_write_its_save_is_written_in_process_and_warned_once(
        tmp_path, shm, monkeypatch):
    monkeypatch.setenv(AGENT_ENV_VAR, "mid_data")  # the agent SIGKILLs itself mid-write
    state = {"w": torch.arange(3_000_000, dtype=torch.float32), "step": 1}
    with stagesave.Checkpointer(tmp_path / "ck", writer="process", chunk_bytes=1 << 20) as ck:
        h = ck.save(state, "a.ckpt")
        with pytest.warns(RuntimeWarning, match=r"writer agent \(pid \d+\) was killed by signal 9"):
            tel = h.result(60)
        assert tel.error is None
        agent = ck.writer.agent
        assert agent is not None and agent.lost is not None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # reported once: later saves are quietly in-process
            state["step"] = 2
            ck.save(state, "b.ckpt").result(60)
        for name, step in (("a.ckpt", 1), ("b.ckpt", 2)):
            assert ck.verify(tmp_path / "ck" / name).status == "verified"
            loaded = ck.load(tmp_path / "ck" / name)
            assert loaded["step"] == step and torch.equal(loaded["w"], state["w"])
        # the agent's torn temporary was removed once this process wrote the save
        assert [i.name for i in ck.list()] == ["b.ckpt", "a.ckpt"]
        assert sorted(os.listdir(tmp_path / "ck")) == ["a.ckpt", "b.ckpt"]
    assert os.listdir(shm) == []


def test_agent_dead_while_idle_next_save_falls_back(tmp_path, shm):
    with stagesave.Checkpointer(tmp_path, writer="process") as ck:
        ck.save({"x": torch.ones(10)}, "one.ckpt").result(60)
        agent = ck.writer.agent
        assert agent is not None and agent.pid is not None
        os.kill(agent.pid, signal.SIGKILL)
        assert exited(agent.pid, 10)
        with pytest.warns(RuntimeWarning, match="writer agent"):
            ck.save({"x": torch.full((10,), 2.0)}, "two.ckpt").result(60)
        assert torch.equal(ck.load(tmp_path / "two.ckpt")["x"], torch.full((10,), 2.0))


def test_trainer_and_agent_both_killed_gc_removes_what_they_left(tmp_path, shm):
    """A double crash: the agent dies mid-write, the trainer right after ``save()`` returned.
    The checkpoint before stays the latest; ``stagesave gc --shm`` and ``gc ROOT`` remove the
    segments and the temporary left behind."""
    root = tmp_path / "ck"
    with stagesave.Checkpointer(root) as ck:  # a checkpoint from before, by the thread writer
        ck.save(agentchild.state_of(0, 7), "step-000.ckpt").result()
    parent, child = _ctx.Pipe()
    p = _ctx.Process(target=agentchild.save_then_die,
                     args=(str(root), str(shm), 7, 2, "during_write", child, "mid_data"))
    p.start()
    child.close()
    pids = []
    while True:
        try:
            pids.append(parent.recv()[1])
        except EOFError:
            break
    p.join(60)
    assert p.exitcode == -signal.SIGKILL and pids and exited(pids[-1])
    with stagesave.Checkpointer(root) as ck:
        best = ck.latest()
        assert best is not None and best.path == str(root / "step-000.ckpt")
        _assert_state(ck.load(best.path), 0, 7)
    left = owned_segments(str(shm))
    assert left  # nobody was left to remove them
    assert abandoned_segments(str(shm), min_age_s=0) != []
    env = dict(os.environ)
    cli = [sys.executable, "-m", "stagesave"]
    young = subprocess.run([*cli, "gc", "--shm"], check=True, env=env, capture_output=True,
                           text=True).stdout
    assert "no abandoned shared-memory segments" in young and owned_segments(str(shm)) == left
    # --shm leaves segments younger than 10 s: age them as a later gc would find them
    for seg in owned_segments(str(shm)):
        os.utime(seg, (time.time() - 60, time.time() - 60))
    out = subprocess.run([*cli, "gc", "--shm", str(root)], check=True, env=env,
                         capture_output=True, text=True).stdout
    assert "removed segment" in out
    assert os.listdir(shm) == []
    assert sorted(n for n in os.listdir(root)) == ["step-000.ckpt"]


def test_resume_from_the_agents_snapshot_in_memory(tmp_path, shm):
    """After the trainer died, the newest checkpoint is loaded from the snapshot its agent kept:
    checked against the file's proof, unpickled from memory (a byte damaged in the file on disk
    does not reach the load), consumed by that load."""
    root = tmp_path / "ck"
    returned, _ = _trial(root, shm, 11, "after_return")
    path = root / f"step-{returned[-1]:03d}.ckpt"
    (seg,) = owned_segments(str(shm))
    snap = read_snapshot(seg)
    assert snap is not None and snap.path == str(path)
    assert stat.S_IMODE(os.stat(seg).st_mode) == 0o600
    with stagesave.Checkpointer(root) as ck:
        assert ck.latest() is not None and ck.latest().path == str(path)
        with open(path, "r+b") as f:  # damage the data on disk, not the proof
            f.seek(snap.covered // 2)
            b = f.read(1)
            f.seek(snap.covered // 2)
            f.write(bytes([b[0] ^ 0xFF]))
        _assert_state(ck.load(path), returned[-1], 11)
        assert owned_segments(str(shm)) == []  # consumed
        with pytest.raises(stagesave.IntegrityError, match="checksum mismatch"):
            ck.load(path)  # from storage now: the damage is found


@pytest.mark.parametrize("verify", [True, False])
def test_a_snapshot_that_does_not_match_is_removed_and_storage_used(tmp_path, shm, verify):
    """Also with ``verify=False``: a trainer killed while staging its next save into the
    snapshot's segment leaves it torn, so a snapshot's bytes are always matched."""
    root = tmp_path / "ck"
    returned, _ = _trial(root, shm, 12, "after_return")
    path = root / f"step-{returned[-1]:03d}.ckpt"
    (seg,) = owned_segments(str(shm))
    snap = read_snapshot(seg)
    assert snap is not None
    mem = map_segment(seg)
    mem[snap.offset + snap.covered // 2] ^= 0xFF  # the memory is damaged, the file is not
    mem.close()
    with stagesave.Checkpointer(root) as ck:
        with pytest.warns(RuntimeWarning, match="snapshot of .* does not match"):
            loaded = ck.load(path, verify=verify)
        _assert_state(loaded, returned[-1], 12)
    assert owned_segments(str(shm)) == []


def test_segments_are_private_and_only_private_ones_are_mapped(shm):
    path, mem = create_segment(1 << 20)
    try:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        token = Path(path).name.split("-")[-1].removesuffix(".seg")
        assert len(token) == 32 and int(token, 16) >= 0  # 128 random bits
        map_segment(path).close()
        os.chmod(path, 0o644)
        with pytest.raises(PermissionError, match="not a private segment"):
            map_segment(path)
        link = shm / "link.seg"
        link.symlink_to(path)
        with pytest.raises(OSError):
            map_segment(str(link))  # never through a link
    finally:
        mem.close()
        os.unlink(path)


def test_writer_option_is_checked(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="writer must be 'thread' or 'process', got 'proc'"):
        stagesave.Checkpointer(tmp_path, writer="proc")
    monkeypatch.setenv("STAGESAVE_WRITER", "agent")
    with pytest.raises(ValueError, match=r"\$STAGESAVE_WRITER must be"):
        stagesave.Checkpointer(tmp_path)
    monkeypatch.delenv("STAGESAVE_WRITER")
    with stagesave.Checkpointer(tmp_path) as ck:
        assert ck.writer.mode == "process" and not ck.writer.explicit  # the default
    with stagesave.Checkpointer(tmp_path, device_staging=True) as ck:
        assert ck.writer.mode == "thread"  # the default yields to device staging
    monkeypatch.setenv("STAGESAVE_WRITER", "thread")
    with stagesave.Checkpointer(tmp_path) as ck:
        assert ck.writer.mode == "thread" and ck.writer.agent is None
    monkeypatch.setenv("STAGESAVE_WRITER", "process")
    with stagesave.Checkpointer(tmp_path) as ck:
        assert ck.writer.mode == "process" and ck.writer.explicit
    with stagesave.Checkpointer(tmp_path, device_staging=True) as ck:
        assert ck.writer.mode == "thread"  # the environment's default yields to device staging
    with pytest.raises(stagesave.UsageError, match="device_staging"):
        stagesave.Checkpointer(tmp_path, writer="process", device_staging=True)


def test_process_writer_saves_files_and_folders_and_leaves_nothing(tmp_path, shm):
    root = tmp_path / "ck"
    before = {t.name for t in threading.enumerate()}
    state = {"w": torch.randn(300, 300), "tied": None, "n": 3, "s": "text"}
    state["tied"] = state["w"][1:5]
    ck = stagesave.Checkpointer(root, writer="process", keep_last=2)
    for i in range(4):
        state["n"] = i
        tel = ck.save(state, f"s{i}.ckpt").result(60)
        assert tel.time_to_commit_s > 0 and tel.bytes > 0 and tel.blocking_s > 0
    ck.save_dir({"model.safetensors": Safetensors({"w": state["w"]}), "opt.bin": state},
                "folder").result(60)
    assert sorted(os.listdir(root)) == ["folder", "s3.ckpt"]  # keep_last by the agent
    loaded = ck.load(root / "s3.ckpt")
    assert loaded["n"] == 3 and torch.equal(loaded["w"], state["w"])
    assert loaded["tied"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()
    assert ck.verify(root / "folder").status == "verified"
    assert os.listdir(shm)  # its staging buffers, while it lives
    agent = ck.writer.agent
    assert agent is not None and agent.proc is not None
    with open(f"/proc/{agent.pid}/maps") as f:
        assert "libtorch" not in f.read()  # the agent never loaded torch: it cannot run its ops
    ck.close()
    assert agent.proc.poll() == 0  # exited by itself, after its orders
    assert os.listdir(shm) == []
    time.sleep(0.2)
    assert {t.name for t in threading.enumerate()} <= before


def test_agent_exits_when_its_trainer_dies_while_a_forked_worker_holds_the_socket(
        tmp_path, shm):
    """The end of the socket never comes while a forked worker keeps it open: the agent still
    notices that its trainer is gone (its parent changed), commits and exits."""
    root = tmp_path / "ck"
    parent, child = _ctx.Pipe()
    p = _ctx.Process(target=agentchild.save_fork_then_die, args=(str(root), str(shm), child))
    p.start()
    agent, worker = parent.recv()
    p.join(60)
    try:
        assert p.exitcode == -signal.SIGKILL
        assert exited(agent, 10), "the agent outlived its trainer"
        assert exited(worker, 0.01) is False  # the worker still holds the socket
        with stagesave.Checkpointer(root) as ck:
            assert ck.verify(root / "step-000.ckpt").status == "verified"
    finally:
        os.kill(worker, signal.SIGKILL)


def test_orders_carry_only_what_changed_and_every_save_is_right(tmp_path, shm, monkeypatch):
    """Orders send each file's layout as changes to the last one (a steady plan's lists are
    not sent again): through a sequence of kept and changed structures, file and folder saves
    interleaved, every checkpoint the agent commits verifies and loads as its state."""
    root = tmp_path / "ck"
    base = {f"layer{i}": torch.randn(16, 8) for i in range(400)}
    states: list[dict[str, object]] = []
    for step in range(3):  # the same structure: the layout is sent once
        states.append({**base, "step": step, "lr": 0.1 / (step + 1), "best": f"s{step}.ckpt"})
    moved = {k: v.clone() for k, v in base.items()}  # new storages of the same sizes
    states.append({**moved, "step": 3, "lr": 0.01, "best": "x"})
    states.append({**moved, "step": 4, "lr": 0.01, "best": "x", "extra": torch.ones(7)})
    states.append({**moved, "layer0": torch.randn(10), "step": 5, "lr": 0.0, "best": ""})
    states.append({**base, "step": 6, "lr": 0.5, "best": "again"})
    import pickle

    from stagesave.agent import wire

    sent: list[int] = []
    real_dumps = wire.dumps

    def dumps(message):  # observe the size of each file order on its way
        if isinstance(message, wire.Order) and message.kind == "file":
            sent.append(len(pickle.dumps(message.files[0].layout)))
        return real_dumps(message)

    monkeypatch.setattr(wire, "dumps", dumps)
    with stagesave.Checkpointer(root, writer="process") as ck:
        for i, state in enumerate(states):
            ck.save(state, f"s{i}.ckpt")
            ck.save_dir({"opt.bin": {"s": state["step"], "m": base["layer1"] * i},
                         "model.safetensors": Safetensors({"w": base["layer2"] + i})}, f"d{i}")
        ck.wait()
        assert sent[1] * 3 < sent[0] and sent[2] * 3 < sent[0], sent  # the same structure
        for i, state in enumerate(states):
            assert ck.verify(root / f"s{i}.ckpt").status == "verified"
            loaded = ck.load(root / f"s{i}.ckpt")
            assert loaded.keys() == state.keys()
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(loaded[k], v), (i, k)
                else:
                    assert loaded[k] == v, (i, k)
            assert ck.verify(root / f"d{i}").status == "verified"
            assert ck.load(root / f"d{i}" / "opt.bin")["s"] == state["step"]


def test_the_agent_writes_with_o_direct_where_the_thread_writer_does(tmp_path, shm):
    """The agent writes whole pages, as the in-process writer does: O_DIRECT applies to a file
    of any length (a file's length is rarely a whole number of pages; found by the benchmark:
    every agent save went through the page cache and an fsync of ~0.75 s per 2 GiB)."""
    state = {"w": torch.randn(3_000_001), "name": "odd length"}
    got = {}
    for writer in ("thread", "process"):
        with stagesave.Checkpointer(tmp_path / writer, writer=writer) as ck:
            tel = ck.save(state, "a.ckpt").result(60)
            assert tel.bytes % 4096 != 0
            got[writer] = tel.direct_io
            folder = ck.save_dir({"a.bin": state, "b.bin": {"x": torch.ones(3)}}, "d").result(60)
            assert folder.direct_io == got[writer]
    assert got["process"] == got["thread"]


def test_a_full_shared_memory_filesystem_falls_back_to_private_staging(tmp_path, monkeypatch):
    """A container's small /dev/shm: the segment cannot be made (a real ENOSPC from a 2 MiB
    tmpfs); the save stages in private memory and is written by this process, one warning."""
    small = tmp_path / "small-shm"
    small.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root and mounts")
    monkeypatch.setenv("STAGESAVE_SHM_DIR", str(small))
    try:
        state = {"w": torch.randn(4_000_000)}  # 16 MB: no room for its segment
        with stagesave.Checkpointer(tmp_path / "ck", writer="process") as ck:
            with pytest.warns(RuntimeWarning, match="no shared-memory segment of 64 MiB"):
                ck.save(state, "a.ckpt")
            ck.wait()
            state["w"].add_(1)
            ck.save(state, "b.ckpt").result(60)  # quietly, the same way
            assert torch.equal(ck.load(tmp_path / "ck" / "b.ckpt")["w"], state["w"])
            assert ck.verify(tmp_path / "ck" / "a.ckpt").status == "verified"
        assert os.listdir(small) == []
        # the writer agent not asked for (the default): the same fallback, without a warning
        monkeypatch.delenv("STAGESAVE_WRITER", raising=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with stagesave.Checkpointer(tmp_path / "ck2") as ck:
                assert ck.writer.mode == "process" and not ck.writer.explicit
                ck.save(state, "c.ckpt").result(60)
                assert torch.equal(ck.load(tmp_path / "ck2" / "c.ckpt")["w"], state["w"])
        assert os.listdir(small) == []
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_save_queued_behind_a_removal_of_its_name_is_committed_after_it(tmp_path, shm,
                                                                          writer):
    """Removals and actions queued before a save run before it is committed, with either
    writer: the agent runs an order only when this process's writer reaches its job (else a
    removal of the same name, still queued, would delete the new checkpoint)."""
    gate = threading.Event()
    with stagesave.Checkpointer(tmp_path, writer=writer) as ck:
        ck.save({"v": torch.ones(1000)}, "a.ckpt").result(60)
        ck.run_after(lambda: gate.wait(60), description="gate")
        ck.remove("a.ckpt")
        h = ck.save({"v": torch.full((1000,), 2.0)}, "a.ckpt")
        time.sleep(0.5)  # an agent that did not wait would have committed it by now
        assert torch.equal(torch.load(tmp_path / "a.ckpt")["v"], torch.ones(1000))
        gate.set()
        h.result(60)
        assert torch.equal(ck.load("a.ckpt")["v"], torch.full((1000,), 2.0))


def test_a_save_held_behind_an_action_is_committed_when_the_trainer_dies(tmp_path, shm):
    """The trainer is SIGKILLed while its writer is stuck in an action queued before a save
    whose ``save()`` returned: the agent held that order, and commits it once the trainer is
    gone."""
    root = tmp_path / "ck"
    parent, child = _ctx.Pipe()
    p = _ctx.Process(target=agentchild.save_behind_an_action_then_die,
                     args=(str(root), str(shm), child))
    p.start()
    child.close()
    agent = parent.recv()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    assert exited(agent), "the agent did not exit after its trainer died"
    with stagesave.Checkpointer(root, writer="thread") as ck:
        best = ck.latest(verify=True)
        assert best is not None and best.name == "step-001.ckpt"
        _assert_state(ck.load(best.path), 1, 5)
        assert ck.verify(root / "step-000.ckpt").status == "verified"


def test_a_jobs_sigterm_does_not_stop_the_agent(tmp_path, shm):
    """SLURM or a preemption sends SIGTERM to every process of the job: the agent leaves it to
    the trainer (whose flush commits through it) and keeps serving."""
    with stagesave.Checkpointer(tmp_path, writer="process") as ck:
        ck.save({"x": torch.ones(4)}, "a.ckpt").result(60)
        agent = ck.writer.agent
        assert agent is not None and agent.pid is not None
        os.kill(agent.pid, signal.SIGTERM)
        os.kill(agent.pid, signal.SIGINT)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback: the agent still writes
            ck.save({"x": torch.full((4,), 2.0)}, "b.ckpt").result(60)
        assert agent.lost is None and agent.proc is not None and agent.proc.poll() is None
    assert torch.equal(stagesave.load(tmp_path / "b.ckpt")["x"], torch.full((4,), 2.0))
