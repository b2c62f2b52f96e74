"""Staging semantics: what save() captured is what gets written, whatever happens after."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from helpers import assert_same

import stagesave


def test_mutating_tensors_arrays_and_containers_after_save_changes_nothing(ckpt_dir):
    w = torch.randn(256, 256)
    arr = np.arange(10, dtype=np.float64)
    lst = [1, 2, 3]
    inner = {"k": "v"}
    state = {"w": w, "view": w[:2], "arr": arr, "lst": lst, "inner": inner, "step": 7}
    expected = {"w": w.clone(), "view": w[:2].clone(), "arr": arr.copy(), "lst": [1, 2, 3],
                "inner": {"k": "v"}, "step": 7}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        h = ck.save(state, "m.ckpt")
        # Mutate everything immediately, before the background write can have finished.
        w.mul_(0).add_(5)
        arr[:] = -1
        lst.append(4)
        inner["k"] = "changed"
        state["step"] = 8
        state["new"] = torch.ones(1)
        h.result()
        loaded = ck.load("m.ckpt")
    assert torch.equal(loaded["w"], expected["w"])
    assert torch.equal(loaded["view"], expected["view"])
    assert loaded["arr"].tobytes() == expected["arr"].tobytes()
    assert loaded["lst"] == [1, 2, 3] and loaded["inner"] == {"k": "v"} and loaded["step"] == 7
    assert "new" not in loaded


def test_many_saves_in_flight_each_keeps_its_own_values(ckpt_dir):
    w = torch.zeros(64, 64)
    with stagesave.Checkpointer(ckpt_dir, max_pending=3) as ck:
        handles = []
        for i in range(12):
            w.fill_(i)
            handles.append(ck.save({"w": w, "i": i}, f"s{i}.ckpt"))
        for h in handles:
            h.result(timeout=60)
        for i in range(12):
            out = ck.load(f"s{i}.ckpt")
            assert out["i"] == i and bool((out["w"] == i).all())


def test_same_path_saved_repeatedly_leaves_exactly_that_file(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        for i in range(6):
            ck.save({"i": i, "t": torch.full((10,), i)}, "last.ckpt")
        ck.wait()
        assert ck.load("last.ckpt")["i"] == 5
        assert ck.latest().seq == 6  # one more than the highest committed, at every save
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt"]  # no sidecar, no temporary


def test_load_while_saving_waits_for_the_pending_save(ckpt_dir):
    big = torch.randn(4 * 1024 * 1024)  # 16 MiB: the write takes a moment
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"v": 1, "big": big}, "x.ckpt").result()
        ck.save({"v": 2, "big": big}, "x.ckpt")
        assert ck.load("x.ckpt")["v"] == 2  # never the old file, never a half-written one


def test_remove_is_ordered_after_pending_saves(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"a": torch.randn(1 << 20)}, "gone.ckpt")
        ck.remove("gone.ckpt").result(timeout=60)
        ck.save({"a": torch.ones(1)}, "kept.ckpt")
        ck.wait()
    names = sorted(p.name for p in ckpt_dir.iterdir())
    assert not any(n.startswith("gone.ckpt") for n in names), names
    assert "kept.ckpt" in names


def test_max_pending_back_pressure_bounds_buffers(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir, max_pending=1) as ck:
        waits = []
        for i in range(4):
            h = ck.save({"t": torch.randn(1 << 20)}, f"b{i}.ckpt")
            waits.append(h.telemetry.buffer_wait_s)
            assert ck.memory.host.in_use() <= 1
        ck.wait()
        assert ck.memory.host._count == 1  # one buffer, reused by all four saves


def test_keep_last_keeps_the_newest_by_sequence(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir, keep_last=2) as ck:
        for i in range(5):
            ck.save({"i": i}, f"step{i}.ckpt").result()
        assert [c.name for c in ck.list()] == ["step4.ckpt", "step3.ckpt"]
        assert [c.seq for c in ck.list()] == [5, 4]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step3.ckpt", "step4.ckpt"]


def test_handle_and_telemetry(ckpt_dir):
    seen = []
    with stagesave.Checkpointer(
        ckpt_dir, telemetry_callback=seen.append, telemetry_jsonl=True
    ) as ck:
        h = ck.save({"t": torch.randn(1000)}, "t.ckpt")
        tel = h.result(timeout=30)
        assert h.done()
    assert seen == [tel]
    assert tel.bytes > 4000 and tel.tensor_bytes == 4000 and tel.blocking_s > 0 and tel.write_s > 0
    assert (
        tel.time_to_commit_s >= tel.blocking_s
        and tel.committed_at is not None
        and tel.error is None
    )
    lines = (ckpt_dir / "stagesave-telemetry.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"bytes": ' in lines[0]


def test_save_returns_before_the_write_finishes(tmp_path):
    """The write really is in the background: a save whose commit we hold back returns at once."""
    gate = threading.Event()
    with stagesave.Checkpointer(tmp_path) as ck:
        q = ck.pipeline.queue or None
        ck.save({"a": torch.ones(1)}, "warm.ckpt").result()
        ck.pipeline.queue.submit(gate.wait)  # occupy the writer
        h = ck.save({"a": torch.ones(1)}, "x.ckpt")
        time.sleep(0.2)
        assert not h.done()
        gate.set()
        h.result(timeout=30)
        del q


def test_interpreter_exit_flushes_pending_saves(tmp_path):
    import subprocess
    import sys

    code = (
        "import stagesave, torch\n"
        f"ck = stagesave.Checkpointer({str(tmp_path)!r})\n"
        "ck.save({'a': torch.arange(1 << 20)}, 'exit.ckpt')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    out = stagesave.load(tmp_path / "exit.ckpt")
    assert torch.equal(out["a"], torch.arange(1 << 20))
    assert stagesave.verify(tmp_path / "exit.ckpt").status == "verified"


@pytest.mark.parametrize("algorithm", ["xxh3_128", "xxh3_64", "blake3", "sha256"])
def test_checksum_algorithms(ckpt_dir, algorithm):
    with stagesave.Checkpointer(ckpt_dir, checksum=algorithm, chunk_bytes=4096) as ck:
        ck.save({"t": torch.randn(5000)}, "c.ckpt").result()
        info = ck.verify("c.ckpt")
    assert info.status == "verified"
    assert info.manifest.files[0].algorithm == algorithm and len(info.manifest.files[0].chunks) > 1
    assert_same(stagesave.load(ckpt_dir / "c.ckpt")["t"].shape, torch.Size([5000]))


def test_checksums_computed_while_staging_verify_the_same(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir, checksum_in="staging", chunk_bytes=1 << 16) as ck:
        h = ck.save({"t": torch.randn(100_000)}, "s.ckpt")
        assert h.telemetry.checksum_s > 0 and h.telemetry.blocking_s >= h.telemetry.checksum_s
        h.result()
        info = ck.verify("s.ckpt")
        assert info.status == "verified" and len(info.manifest.files[0].chunks) > 1
    with pytest.raises(ValueError, match="checksum_in"):
        stagesave.Checkpointer(checksum_in="later")


@pytest.mark.parametrize("checksum_in", [None, "auto", "staging"])
def test_host_state_is_hashed_before_save_returns_by_default(ckpt_dir, checksum_in):
    """Host-memory state: the default ("auto") hashes on the caller's time, like "staging"."""
    options = {} if checksum_in is None else {"checksum_in": checksum_in}
    with stagesave.Checkpointer(ckpt_dir, chunk_bytes=1 << 16, **options) as ck:
        h = ck.save({"t": torch.randn(100_000)}, "w.ckpt")
        assert h.telemetry.checksum_s > 0 and h.telemetry.blocking_s >= h.telemetry.checksum_s
        h.result()
        assert ck.verify("w.ckpt").status == "verified"


@pytest.mark.parametrize(
    ("checksum_in", "host", "device_pending"),
    [("auto", True, False), ("staging", True, True), ("background", False, False)],
)
def test_where_checksums_are_computed(ckpt_dir, checksum_in, host, device_pending):
    """"auto" leaves hashing to the writers while a device-to-host copy is still in flight, and
    for states of many small tensors (private: the choice itself is not observable otherwise)."""
    from stagesave.saving.fastplan import plan

    big, small = (
        plan({"t": torch.zeros(1 << 20)}),
        plan({str(i): torch.zeros(16) for i in range(100)}),
    )
    with stagesave.Checkpointer(ckpt_dir, checksum_in=checksum_in) as ck:
        assert ck.stager.hash_while_staging(device_copy_pending=False, image=big) is host
        assert ck.stager.hash_while_staging(device_copy_pending=True, image=big) is device_pending
        assert ck.stager.hash_while_staging(device_copy_pending=False, image=small) is (
            checksum_in == "staging"
        )


def test_many_small_tensors_hashed_in_the_background_verify(ckpt_dir):
    state = {f"t{i}": torch.full((i % 7 + 1,), float(i)) for i in range(3000)}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        h = ck.save(state, "small.ckpt")
        assert h.telemetry.checksum_s == 0  # nothing hashed on the caller's time
        h.result()
        assert h.telemetry.checksum_s > 0
        assert ck.verify("small.ckpt").status == "verified"
        loaded = ck.load("small.ckpt")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_io_threads_option_sizes_the_writer_pool(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir, io_threads=3) as ck:
        ck.save({"a": torch.ones(1)}, "x.ckpt").result()
        assert ck.pipeline.queue.io_pool._max_workers == 3


def test_save_dir_folder_appears_only_at_commit_and_raw_files(tmp_path):
    import threading

    from stagesave.formats import Raw

    with stagesave.Checkpointer(tmp_path) as ck:
        ck.save({"a": 1}, "warm.ckpt").result()
        gate = threading.Event()
        ck.pipeline.queue.submit(gate.wait)
        h = ck.save_dir({"config.json": Raw(b'{"x": 1}'), "w.bin": {"w": torch.ones(3)}}, "ck_0")
        assert not (tmp_path / "ck_0").exists()  # not even an empty folder before the commit
        gate.set()
        h.result(timeout=30)
        assert (tmp_path / "ck_0" / "config.json").read_bytes() == b'{"x": 1}'
        assert ck.verify("ck_0").status == "verified"


def test_save_dir_staging_dir_keeps_temporaries_out_of_the_listed_folder(tmp_path):
    listed = tmp_path / "checkpoints"
    staging = tmp_path / ".staging"
    seen = []
    with stagesave.Checkpointer(listed) as ck:
        import threading

        ck.save({"a": 1}, "warm.ckpt").result()
        gate = threading.Event()
        ck.pipeline.queue.submit(gate.wait)
        h = ck.save_dir({"w.bin": {"w": torch.ones(3)}}, "checkpoint_1", staging_dir=staging)
        gate.set()
        while not h.done():
            seen.extend(p.name for p in listed.iterdir())
        h.result()
        assert not any(".stagesave-tmp" in n for n in seen)
        assert ck.verify("checkpoint_1").status == "verified"
        assert list(staging.iterdir()) == []


def test_run_after_is_ordered_after_pending_saves(ckpt_dir):
    seen = []
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"a": torch.randn(1 << 20)}, "x.ckpt")
        h = ck.run_after(lambda: seen.append((ckpt_dir / "x.ckpt").exists()), description="check")
        h.result(timeout=60)
        assert seen == [True]
        bad = ck.run_after(lambda: 1 / 0, description="boom")
        with pytest.raises(stagesave.CheckpointError, match="boom failed"):
            bad.result(timeout=60)


def test_an_action_that_reads_lists_and_waits_does_not_wait_for_itself(ckpt_dir):
    """An action on the writer thread may read what the saves before it committed: listing,
    latest(), load() and wait() of its own and of other Checkpointers return at once while a
    save queued behind the action is still pending: waiting for it would wait for the action
    itself."""
    held, release = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def action() -> None:
        held.wait(30)
        seen["list"] = [c.name for c in ck.list()]
        seen["latest"] = ck.latest(verify=True).name  # type: ignore[union-attr]
        seen["load"] = int(ck.load("a.ckpt")["step"])
        ck.wait()
        seen["module latest"] = stagesave.latest(ckpt_dir).name  # type: ignore[union-attr]
        with stagesave.Checkpointer(ckpt_dir) as other:
            seen["other"] = [c.name for c in other.list()]
        release.set()

    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"step": 1, "w": torch.ones(10)}, "a.ckpt")
        h = ck.run_after(action, description="reading action")
        later = ck.save({"step": 2, "w": torch.ones(10)}, "b.ckpt")  # queued behind the action
        held.set()
        h.result(timeout=60)
        later.result(timeout=60)
    assert release.is_set()
    assert seen == {"list": ["a.ckpt"], "latest": "a.ckpt", "load": 1,
                    "module latest": "a.ckpt", "other": ["a.ckpt"]}, seen


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_checkpointer_dropped_without_close_gives_its_threads_and_buffers_back(
    ckpt_dir, shm, writer
):
    """Dropped unclosed: its threads end, its buffers (and shared segments) are freed, and with
    the writer agent (the default) the agent process exits."""
    import gc
    import weakref

    from agentwatch import exited

    before = {t.ident for t in threading.enumerate()}
    ck = stagesave.Checkpointer(ckpt_dir, writer=writer)
    ck.save({"w": torch.ones(1 << 16)}, "a.ckpt").result(timeout=60)
    ours = [t for t in threading.enumerate() if t.ident not in before]
    assert sorted(t.name.rstrip("_0123456789") for t in ours) == (
        # the agent writes: this process's I/O threads are not started
        ["stagesave-agent-replies", "stagesave-hash", "stagesave-writer"] if writer == "process"
        else ["stagesave-hash", "stagesave-io", "stagesave-writer"]
    )
    agent = ck.writer.agent
    pid = agent.pid if agent is not None else None
    assert (pid is not None) == (writer == "process")
    assert len(list(shm.iterdir())) == (1 if writer == "process" else 0)
    pool = ck.memory.host
    assert pool.total_bytes() > 0
    gone = weakref.ref(ck)
    del ck, agent
    gc.collect()
    assert gone() is None, "an idle Checkpointer is still referenced"
    for t in ours:
        t.join(10)
    assert [t.name for t in ours if t.is_alive()] == []
    assert pool.total_bytes() == 0
    if pid is not None:
        assert exited(pid, 10)
    assert list(shm.iterdir()) == []
    assert stagesave.load(ckpt_dir / "a.ckpt")["w"].shape == (1 << 16,)


def test_link_inside_the_root_loads_and_verifies_as_its_target(ckpt_dir):
    import os

    stagesave.save({"w": torch.ones(3)}, ckpt_dir / "epoch=1.ckpt")
    os.symlink("epoch=1.ckpt", ckpt_dir / "last.ckpt")
    assert stagesave.verify(ckpt_dir / "last.ckpt").status == "verified"
    assert torch.equal(stagesave.load(ckpt_dir / "last.ckpt")["w"], torch.ones(3))


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_flush_on_sigterm_commits_pending_saves_then_dies_of_sigterm(tmp_path, shm, writer):
    """The save commits, the process still dies of SIGTERM, and with the writer agent (the
    default) the agent exits keeping nothing in shared memory (the process ended on purpose:
    no snapshot)."""
    import signal
    import subprocess
    import sys

    code = (
        "import os, signal, stagesave, torch\n"
        "stagesave.flush_on_sigterm(timeout=60)\n"
        f"ck = stagesave.Checkpointer({str(tmp_path)!r}, writer={writer!r})\n"
        "ck.save({'a': torch.arange(1 << 22)}, 't.ckpt')\n"
        "print(ck.writer.agent.pid if ck.writer.agent else 0, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "import time; time.sleep(30)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], timeout=120, check=False,
                       capture_output=True, text=True)
    assert r.returncode == -signal.SIGTERM, r.stderr[-2000:]
    assert stagesave.verify(tmp_path / "t.ckpt").status == "verified"
    agent = int(r.stdout.split()[0])
    assert (agent > 0) == (writer == "process")
    if agent:
        from agentwatch import exited

        assert exited(agent, 10)
    assert list(shm.iterdir()) == []


def test_closing_joins_the_hashing_threads_and_none_start_afterwards(ckpt_dir):
    """close() joins the threads that hash after the copy; a save racing close() cannot restart
    them."""
    ck = stagesave.Checkpointer(ckpt_dir)
    ck.save({"t": torch.randn(100_000)}, "h.ckpt").result()
    hashing = [t for t in ck.stager.threads._threads if t.is_alive()]
    assert hashing and all(t.name.startswith("stagesave-hash") for t in hashing)
    ck.close()
    assert not any(t.is_alive() for t in hashing) and ck.stager.threads is None
    with pytest.raises(stagesave.ClosedError, match="closed"):
        ck.stager.copy_threads()
    assert ck.stager.threads is None


@pytest.mark.parametrize("checksum_in", ["auto", "background"])
def test_folder_saves_hash_after_the_copy_by_default_and_verify_either_way(tmp_path, checksum_in):
    from stagesave.formats import Safetensors

    files = {"model.safetensors": Safetensors({"w": torch.randn(300, 300)}),
             "optimizer.bin": {"state": {0: {"exp_avg": torch.randn(50_000)}}, "step": 3}}
    with stagesave.Checkpointer(tmp_path, chunk_bytes=1 << 16, checksum_in=checksum_in) as ck:
        h = ck.save_dir(files, "checkpoint_0")
        if checksum_in == "auto":  # host state: hashed before save_dir returns
            assert 0 < h.telemetry.checksum_s <= h.telemetry.blocking_s
        h.result()
        info = ck.verify("checkpoint_0")
    assert info.status == "verified"
    assert all(len(f.chunks) > 1 for f in info.manifest.files)
    loaded = stagesave.load(tmp_path / "checkpoint_0" / "optimizer.bin")
    assert torch.equal(loaded["state"][0]["exp_avg"], files["optimizer.bin"]["state"][0]["exp_avg"])


def test_a_folder_with_files_in_sub_folders_is_one_checkpoint(ckpt_dir):
    """A hook's files in sub-folders (``tokenizer/vocab.txt``) are part of the folder's proof:
    listed exactly and verified; a file added in a sub-folder is the user's (beside it), one of
    them changed makes the folder invalid."""
    from stagesave.formats import Raw

    files = {"model.bin": {"w": torch.arange(100.0)}, "tokenizer/vocab.txt": Raw(b"a\nb\n"),
             "tokenizer/deep/merges.txt": Raw(b"x y\n")}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save_dir(files, "checkpoint_1").result()
        assert ck.verify("checkpoint_1").status == "verified"
        assert ck.latest().name == "checkpoint_1"
    listed = sorted(os.path.relpath(os.path.join(d, f), ckpt_dir / "checkpoint_1")
                    for d, _, fs in os.walk(ckpt_dir / "checkpoint_1") for f in fs)
    assert listed == ["model.bin", "tokenizer/deep/merges.txt", "tokenizer/vocab.txt"]
    assert (ckpt_dir / "checkpoint_1" / "tokenizer" / "vocab.txt").read_bytes() == b"a\nb\n"
    (ckpt_dir / "checkpoint_1" / "tokenizer" / "extra.txt").write_bytes(b"?")
    info = stagesave.verify(ckpt_dir / "checkpoint_1")
    assert (info.status, info.beside) == ("verified", ["tokenizer/extra.txt"])
    (ckpt_dir / "checkpoint_1" / "tokenizer" / "vocab.txt").write_bytes(b"a\nc\n")
    info = stagesave.verify(ckpt_dir / "checkpoint_1")
    assert info.status == "corrupt" and "tokenizer/vocab.txt" in info.problems[0]


def test_user_files_that_look_like_stagesave_debris_are_never_touched(ckpt_dir):
    """A file named like a format-1 manifest of a checkpoint, and a folder named like an aside
    folder, both of the user's: saving, removing and latest() leave them alone."""
    notes = ckpt_dir / "x.ckpt.0123456789.stagesave.json"
    notes.write_text("my notes, not a manifest")
    aside = ckpt_dir / ".mine.x.stagesave-aside"
    aside.mkdir()
    (aside / "keep.txt").write_text("mine")
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"i": 1}, "x.ckpt").result()
        ck.save({"i": 2}, "x.ckpt").result()
        assert ck.latest().name == "x.ckpt"
        ck.remove("x.ckpt").result()
    assert notes.read_text() == "my notes, not a manifest"
    assert (aside / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("name, message", [
    ("a.ckpt.stagesave-tmp", "reserved for stagesave"),
    ("x/.b.stagesave-aside/c.ckpt", "reserved for stagesave"),
    ("n.ckpt.0123456789.stagesave.json", "named like a stagesave manifest"),
    ("checkpoint.stagesave.json", "named like a stagesave manifest"),
    ("é" * 101 + ".ckpt", "more than the 200"),
])
def test_names_stagesave_cannot_hold_are_refused_at_save(ckpt_dir, name, message):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        with pytest.raises(ValueError, match=message):
            ck.save({"i": 1}, name)
        with pytest.raises(ValueError, match=message):
            ck.save_dir({"m.bin": {"i": 1}}, name)
    assert os.listdir(ckpt_dir) == []


def test_dot_names_are_saved_listed_and_latest(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"i": 1}, "a.ckpt").result()
        ck.save({"i": 2}, ".hidden.ckpt").result()
        assert ck.latest().name == ".hidden.ckpt"
        assert [c.name for c in ck.list()] == [".hidden.ckpt", "a.ckpt"]


@pytest.mark.usefixtures("thread_writer")  # the clock is patched in this process only
def test_the_clock_stepping_back_changes_no_order(ckpt_dir, monkeypatch):
    """Newest is the sequence number, never the wall clock: with the clock stepped back an hour
    after the first save, latest() is still the last save and keep_last removes the oldest."""
    import stagesave.saving.commit as commit_mod

    real = commit_mod.time.time_ns
    with stagesave.Checkpointer(ckpt_dir, keep_last=2) as ck:
        ck.save({"i": 1}, "a.ckpt").result()
        monkeypatch.setattr(commit_mod.time, "time_ns", lambda: real() - 3600 * 10**9)
        ck.save({"i": 2}, "b.ckpt").result()
        ck.save({"i": 3}, "c.ckpt").result()
        assert ck.latest().name == "c.ckpt"
        assert [(c.name, c.seq) for c in ck.list()] == [("c.ckpt", 3), ("b.ckpt", 2)]
        assert ck.list()[0].created < time.time() - 3000  # its recorded time is an hour back
    assert sorted(os.listdir(ckpt_dir)) == ["b.ckpt", "c.ckpt"]
