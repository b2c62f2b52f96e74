"""Faults while a save is in flight: its temporary deleted, a load or removal of the same path,
readers looking at every step, close, and host memory under ``max_pending`` back-pressure.

A save is held at an exact call of the protocol by a hook on ``stagesave.stores.posix`` that blocks
the background writer thread until the test releases it; everything else is real.
"""

from __future__ import annotations

import errno
import gc
import multiprocessing
import os
import shutil
import sys
import threading
import time
import warnings

import faultchild
import faultstats
import psutil
import pytest
import torch
from faultfs import Call, Recorder
from faulthelp import debris, dir_state, file_state, latest_name, lock_waiters

import stagesave
from stagesave.errors import CheckpointError, CheckpointNotFoundError, ClosedError
from stagesave.saving import inflight as _inflight

pytestmark = pytest.mark.usefixtures("thread_writer")  # faults injected in this process

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "stagesave", "faultchild"])


class Gate:
    """Blocks the first call matching ``match`` until :meth:`open`; :meth:`reached` waits for it."""

    def __init__(self, rec: Recorder, match) -> None:  # type: ignore[no-untyped-def]
        self._match = match
        self._at = threading.Event()
        self._go = threading.Event()
        self.call: Call | None = None
        rec.add_hook(self._hook)

    def _hook(self, call: Call) -> None:
        if self.call is None and self._match(call):
            self.call = call
            self._at.set()
            assert self._go.wait(60), "the test never released the writer"

    def reached(self) -> Call:
        assert self._at.wait(60), "the save never reached the gate"
        assert self.call is not None
        return self.call

    def open(self) -> None:
        self._go.set()


def _is_publish(root, name):  # type: ignore[no-untyped-def]
    return lambda c: c.name == "replace" and os.path.abspath(c.args[1]) == os.path.join(root, name)


# ---------------------------------------------------------------------------- deleted under a save
@pytest.mark.fault_class("file deleted under a pending save")
@pytest.mark.parametrize("is_dir", [False, True], ids=["file", "dir"])
def test_temporary_deleted_under_a_pending_save(tmp_path, is_dir):
    """Someone (a cleanup cron, a user's rm) deletes the save's temporary while it is written."""
    with stagesave.Checkpointer(tmp_path, chunk_bytes=8192) as ck:
        first = "checkpoint" if is_dir else "last.ckpt"
        if is_dir:
            ck.save_dir(dir_state(1), first).result()
        else:
            ck.save(file_state(1), first).result()
        with Recorder(tmp_path) as rec:
            gate = Gate(rec, lambda c: c.name == "pwrite")
            h = ck.save_dir(dir_state(2), first) if is_dir else ck.save(file_state(2), first)
            temp = gate.reached().path
            victim = os.path.dirname(temp) if is_dir else temp  # the staging folder, or the file
            assert ".stagesave-tmp" in os.path.basename(victim)
            (shutil.rmtree if is_dir else os.unlink)(victim)
            gate.open()
            with pytest.raises(CheckpointNotFoundError) as ei:
                h.result(timeout=60)
        assert f"saving checkpoint {tmp_path / first} failed" in str(ei.value)
        assert isinstance(ei.value, FileNotFoundError)
        assert debris(tmp_path) == []
        assert latest_name(tmp_path) == (first, 1)
        if is_dir:
            ck.save_dir(dir_state(3), first).result(timeout=60)
        else:
            ck.save(file_state(3), first).result(timeout=60)
    assert latest_name(tmp_path) == (first, 3)


# ---------------------------------------------------------------------------- load/remove pending
@pytest.mark.fault_class("load/remove while a save is pending")
def test_load_waits_for_a_pending_save_held_at_its_rename(tmp_path):
    with stagesave.Checkpointer(tmp_path, chunk_bytes=8192) as ck:
        ck.save(file_state(1), "last.ckpt").result()
        with Recorder(tmp_path) as rec:
            gate = Gate(rec, _is_publish(str(tmp_path), "last.ckpt"))
            ck.save(file_state(2), "last.ckpt")
            gate.reached()
            got: list = []
            t = threading.Thread(target=lambda: got.append(ck.load("last.ckpt")["step"]))
            t.start()
            t.join(0.5)
            assert t.is_alive() and got == []  # neither the old one nor a half-published one
            gate.open()
            t.join(60)
        assert got == [2]


@pytest.mark.fault_class("load/remove while a save is pending")
def test_load_during_a_pending_save_that_fails_returns_the_previous(tmp_path):
    import errno

    with stagesave.Checkpointer(tmp_path, chunk_bytes=8192) as ck:
        ck.save(file_state(1), "last.ckpt").result()
        with Recorder(tmp_path) as rec:
            gate = Gate(rec, lambda c: c.name == "fsync")
            rec.fail("fsync", errno.EIO, nth=1)
            h = ck.save(file_state(2), "last.ckpt")
            gate.reached()
            got: list = []
            t = threading.Thread(target=lambda: got.append(ck.load("last.ckpt")["step"]))
            t.start()
            gate.open()
            t.join(60)
        assert got == [1]
        with pytest.raises(CheckpointError, match="Input/output error"):
            h.result()


@pytest.mark.fault_class("load/remove while a save is pending")
@pytest.mark.parametrize("is_dir", [False, True], ids=["file", "dir"])
def test_remove_while_a_save_of_the_same_path_is_pending(tmp_path, is_dir):
    name = "checkpoint" if is_dir else "last.ckpt"
    with stagesave.Checkpointer(tmp_path, chunk_bytes=8192) as ck:
        if is_dir:
            ck.save_dir(dir_state(1), name).result()
        with Recorder(tmp_path) as rec:
            gate = Gate(rec, lambda c: c.name == "pwrite")
            h = ck.save_dir(dir_state(2), name) if is_dir else ck.save(file_state(2), name)
            gate.reached()
            r = ck.remove(name)
            time.sleep(0.2)
            assert not r.done()  # ordered after the save
            gate.open()
            h.result(timeout=60)
            r.result(timeout=60)
        assert [p for p in os.listdir(tmp_path)] == []  # data, manifest, temporaries: all gone
        with pytest.raises(CheckpointNotFoundError):
            ck.load(os.path.join(name, "optimizer.bin") if is_dir else name)
        assert ck.latest() is None


# ---------------------------------------------------------------------------- readers at every step
class Stepper:
    """Holds the save's background threads before each of their ``_fsops`` calls, one at a time."""

    def __init__(self, rec: Recorder) -> None:
        self._at = threading.Event()
        self._go = threading.Event()
        # the I/O threads write chunks in parallel: one stops at a time
        self._one = threading.Lock()
        self._current: list[Call] = []
        rec.add_hook(self._hold)

    def _hold(self, call: Call) -> None:
        if threading.current_thread() is threading.main_thread():
            return  # the caller's own checks (check_writable) run before the save starts
        with self._one:
            self._current[:] = [call]
            self._at.set()
            assert self._go.wait(60), "the test never released the writer"
            self._go.clear()

    def next_call(self, handle: stagesave.SaveHandle) -> Call | None:
        """The call the writer is held at now; None once the save is done."""
        while not handle.done():
            if self._at.wait(0.05):
                self._at.clear()
                return self._current[0]
        return None

    def release(self) -> None:
        self._go.set()


def _in_thread(fn):  # type: ignore[no-untyped-def]
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - judged by the test
            box["error"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _waits_for_pending_save(thread: threading.Thread) -> bool:
    """Whether ``thread`` is waiting in the process-wide view for a save of this process."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("stagesave", "saving", "inflight.py")):
            return True
        frame = frame.f_back
    return False


def _settled(alive, pid: int, already_waiting: int = 0,  # type: ignore[no-untyped-def]
             thread: threading.Thread | None = None) -> bool:
    """Wait until a reader finished (True) or waits for a file lock held by the writer, or
    (``thread``, a reader in this process) for this process's pending save (False).

    ``already_waiting``: lock waits of ``pid`` that were there before this reader started.
    """
    deadline = time.monotonic() + 30
    while alive():
        if lock_waiters(pid) > already_waiting:
            return False
        if thread is not None and _waits_for_pending_save(thread):
            return False
        assert time.monotonic() < deadline, "the reader hangs without waiting for a lock"
        time.sleep(0.005)
    return True


def _read_file(root: str) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with stagesave.Checkpointer(root) as other:
            step = other.load("last.ckpt")["step"]
            best = other.latest(verify=True)
            assert best is not None and best.name == "last.ckpt", best
            return step


def test_reader_at_every_step_of_a_pending_overwrite_sees_old_or_new(tmp_path):
    """A reader process loads last.ckpt (``latest(verify=True)``, then ``load``) while the save
    is held before each of its calls: always the old or the new checkpoint, verified, never an
    error. A reader that waits for the writer's lock is let through after the step. A second
    Checkpointer of the writer's own process waits for the pending save and gets the new one."""
    root = str(tmp_path)
    readers = []
    with stagesave.Checkpointer(root, chunk_bytes=8192) as ck:
        ck.save(file_state(1), "last.ckpt").result()
        with Recorder(root) as rec:
            stepper = Stepper(rec)
            h = ck.save(file_state(2), "last.ckpt")
            same_process = None
            while (call := stepper.next_call(h)) is not None:
                if same_process is None:  # as an evaluation callback or a fresh Trainer would
                    t, box = _in_thread(lambda: _read_file(root))
                    same_process = (
                        t,
                        box,
                        _settled(t.is_alive, os.getpid(), lock_waiters(os.getpid()), t),
                    )
                r = ReaderProcess(root)
                readers.append((call, r, r.settled()))
                stepper.release()
            h.result(timeout=60)
    seen = [(c, r.result(), settled) for c, r, settled in readers]
    problems = [f"before {c.name} {c.path}: {out}" for c, out, _ in seen
                if out not in (("last.ckpt", 1), ("last.ckpt", 2))]
    faultstats.record("readers at every step of a pending save", len(seen), len(problems))
    assert not problems, problems
    in_step = [out[1] for _, out, settled in seen if settled]
    assert in_step == sorted(in_step)  # old until the rename, new from then on
    assert in_step[0] == 1 and seen[-1][1] == ("last.ckpt", 2)
    assert len(seen) > 15
    assert same_process is not None
    t, box, settled = same_process
    t.join(60)
    assert not settled, (
        "a Checkpointer of the writer's process read without waiting for its pending save"
    )
    assert box == {"result": 2}, box


@pytest.mark.fault_class("readers at every step of a pending save")
def test_a_temporary_published_while_a_reader_lists_the_directory(tmp_path, monkeypatch):
    """Seen in the reader test above as a rare race; made deterministic: the listing a reader
    makes of the directory still names a writer's temporary that is renamed away right after,
    and loading last.ckpt must not fail for it."""
    stagesave.save(file_state(1), tmp_path / "last.ckpt")
    temp = tmp_path / f".last.ckpt.{os.getpid()}-0badf00d.stagesave-tmp"
    temp.write_bytes(b"a writer's temporary")
    real_scandir = os.scandir

    def listing_then_publish(path):  # type: ignore[no-untyped-def]
        entries = list(real_scandir(path))
        if temp.exists():
            temp.rename(tmp_path / "elsewhere")  # gone from its name: its writer published it
        return iter(entries)

    monkeypatch.setattr(os, "scandir", listing_then_publish)
    assert stagesave.load(tmp_path / "last.ckpt")["step"] == 1


def _into_place(root: str):  # type: ignore[no-untyped-def]
    """The call that puts the staged folder under the checkpoint's name: the second rename of
    a replacement by renames, or the atomic exchange of the two folders."""
    final = os.path.join(root, "checkpoint")
    return lambda c: (
        c.name in ("rename", "exchange")
        and ".stagesave-tmp" in os.path.basename(c.path)
        and os.path.abspath(c.args[1]) == final
    )


class ReaderProcess:
    """``latest(verify=True)`` of ``root`` in another process (see ``faultchild.reader``)."""

    def __init__(self, root: str) -> None:
        self.conn, child = _ctx.Pipe()
        self.proc = _ctx.Process(target=faultchild.reader, args=(root, child))
        self.proc.start()

    def settled(self) -> bool:
        return _settled(lambda: not self.conn.poll(0), self.proc.pid)

    def result(self) -> tuple[str, object]:
        assert self.conn.poll(60), "the reader process hangs"
        out = self.conn.recv()
        self.proc.join(30)
        return out


def test_reader_process_at_every_step_of_a_pending_folder_overwrite(tmp_path):
    """The same with a reader process (``latest()`` repairs folders moved aside by dead writers,
    so a reader must be another process to see a live writer as alive). The one step between
    two renames of a replacement (where the filesystem cannot exchange two folders atomically)
    is tested on its own below."""
    root = str(tmp_path)
    into_place = _into_place(root)
    readers = []
    skipped = 0
    with stagesave.Checkpointer(root, chunk_bytes=8192) as ck:
        ck.save_dir(dir_state(1), "checkpoint").result()
        with Recorder(root) as rec:
            stepper = Stepper(rec)
            h = ck.save_dir(dir_state(2), "checkpoint")
            while (call := stepper.next_call(h)) is not None:
                if call.name == "rename" and into_place(call):
                    skipped += 1
                else:
                    r = ReaderProcess(root)
                    readers.append((call, r, r.settled()))
                stepper.release()
            h.result(timeout=60)
    seen = [(c.name, r.result(), settled) for c, r, settled in readers]
    assert skipped <= 1
    bad = [s for s in seen if s[1] not in (("checkpoint", 1), ("checkpoint", 2))]
    faultstats.record("readers at every step of a pending save", len(seen), len(bad))
    assert not bad, bad
    in_step = [r[1] for _, r, settled in seen if settled]
    assert in_step == sorted(in_step) and in_step[0] == 1 and seen[-1][1] == ("checkpoint", 2)
    assert len(seen) > 30


@pytest.mark.fault_class("readers at every step of a pending save")
@pytest.mark.parametrize("how", ["exchange", "renames"])
def test_reader_process_while_a_folder_replacement_is_held_at_its_publish(tmp_path, how):
    """Held right before the staged folder takes the checkpoint's name (the exchange of the two
    folders; or, where the filesystem cannot exchange, between the two renames), a reader process
    sees the old or the new checkpoint, never none (if it waits for the writer's lock, the writer
    is let go on)."""
    root = str(tmp_path)
    with stagesave.Checkpointer(root, chunk_bytes=8192) as ck:
        ck.save_dir(dir_state(1), "checkpoint").result()
        with Recorder(root) as rec:
            if how == "renames":
                rec.fail("exchange", errno.EINVAL, every=True)  # before the gate sees the call
            gate = Gate(rec, _into_place(root))
            h = ck.save_dir(dir_state(2), "checkpoint")
            gate.reached()
            reader = ReaderProcess(root)
            try:
                reader.settled()  # finished, or waits for the writer's lock: then let it commit
            finally:
                gate.open()
            seen = reader.result()
            h.result(timeout=60)
    assert seen in (("checkpoint", 1), ("checkpoint", 2)), seen


@pytest.mark.fault_class("load/remove while a save is pending")
@pytest.mark.parametrize("how", ["exchange", "renames"])
def test_latest_in_the_same_process_during_a_folder_replacement(tmp_path, how):
    """latest() from another Checkpointer of the same process (an evaluation callback) while a
    folder save is held at its publish: it waits for the pending save (the process-wide view)
    rather than seeing, or repairing, the live writer's aside folder, and offers the new one."""
    root = str(tmp_path)
    with stagesave.Checkpointer(root, chunk_bytes=8192) as ck:
        ck.save_dir(dir_state(1), "checkpoint").result()
        with Recorder(root) as rec:
            if how == "renames":
                rec.fail("exchange", errno.EINVAL, every=True)
            gate = Gate(rec, _into_place(root))
            h = ck.save_dir(dir_state(2), "checkpoint")
            # the old folder is aside (or about to be exchanged), the new one not in place
            gate.reached()
            t, box = _in_thread(lambda: latest_name(root))  # e.g. an evaluation callback
            try:
                settled = _settled(t.is_alive, os.getpid(), thread=t)
            finally:
                gate.open()
            t.join(60)
            error = h.exception(timeout=60)
        assert not settled, "latest() in the writer's process did not wait for its pending save"
        assert box.get("result") == ("checkpoint", 2), box
        assert error is None, f"the pending save failed: {error}"
        assert debris(root) == []
        assert latest_name(root) == ("checkpoint", 2)


# ---------------------------------------------------------------------------- close
@pytest.mark.fault_class("save after close")
def test_close_commits_pending_saves_then_refuses_everything(tmp_path):
    ck = stagesave.Checkpointer(tmp_path, chunk_bytes=8192)
    with Recorder(tmp_path) as rec:
        gate = Gate(rec, lambda c: c.name == "pwrite")
        ck.save(file_state(1), "a.ckpt")
        gate.reached()
        threading.Timer(0.3, gate.open).start()
        ck.close()  # waits for the held save, which then commits
    assert latest_name(tmp_path) == ("a.ckpt", 1)
    before = sorted(os.listdir(tmp_path))
    for attempt in (lambda: ck.save(file_state(2), "b.ckpt"),
                    lambda: ck.save_dir(dir_state(2), "c"),
                    lambda: ck.remove("a.ckpt")):
        with pytest.raises(ClosedError, match="closed; create a new one"):
            attempt()
    assert sorted(os.listdir(tmp_path)) == before
    assert ck.pending() == 0
    ck.close()


class _ClosesItsCheckpointer:
    """Pickling it (the save's plan) closes the Checkpointer from another thread: a close()
    that lands after save() checked it was open and before its job was queued."""

    def __init__(self, ck):
        self.ck = ck

    def __reduce__(self):
        t = threading.Thread(target=self.ck.close)
        t.start()
        t.join()
        return (int, (0,))


@pytest.mark.fault_class("save after close")
@pytest.mark.parametrize("kind", ["file", "folder"])
@pytest.mark.parametrize(
    ("checksum_in", "message"),
    [
        # refused when the copy wants its hashing threads
        ("staging", "this Checkpointer is closed"),
        # at the queue
        ("background",
         r"the Checkpointer was closed while .* was being staged; it was not written"),
    ],
)
def test_close_racing_a_save_being_staged_refuses_it_cleanly(tmp_path, kind, checksum_in, message):
    ck = stagesave.Checkpointer(tmp_path, checksum_in=checksum_in)
    state = {"w": torch.ones(1000), "closer": _ClosesItsCheckpointer(ck)}
    with pytest.raises(ClosedError, match=message):
        if kind == "file":
            ck.save(state, "a.ckpt")
        else:
            ck.save_dir({"optimizer.bin": state}, "c")
    assert os.listdir(tmp_path) == []
    # the staging buffer was given back and freed
    assert ck.memory.host.in_use() == 0 and ck.memory.host.total_bytes() == 0
    assert ck.pending() == 0  # and the process-wide view shows nothing pending on the path
    assert _inflight.pending(str(tmp_path / ("a.ckpt" if kind == "file" else "c"))) == []
    ck.close()  # and it stays closed, quietly


# ---------------------------------------------------------------------------- back-pressure
def test_max_pending_keeps_host_memory_within_budget_over_100_saves(tmp_path):
    """100 saves of 2 MiB as fast as the caller can submit them, behind a slow disk."""
    proc = psutil.Process()
    n = 1 << 19  # float32 elements: 2 MiB of tensor
    state = {"w": torch.zeros(n)}
    max_pending = 2
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(proc.memory_info().rss)
            time.sleep(0.002)

    gc.collect()
    base = proc.memory_info().rss  # before the checkpointer holds any buffer
    with stagesave.Checkpointer(
        tmp_path, max_pending=max_pending, keep_last=2, chunk_bytes=4 << 20
    ) as ck:
        with Recorder(tmp_path) as rec:
            rec.recording = False  # only slow the disk down; the log is not needed

            def slow(call: Call) -> None:
                if call.name == "fsync" and not call.is_dir:
                    time.sleep(0.005)

            rec.add_hook(slow)
            t = threading.Thread(target=sample, daemon=True)
            t.start()
            rss_at: dict[int, int] = {}
            waited = 0.0
            for i in range(100):
                state["w"].fill_(float(i))  # the state changes in place, as training does
                h = ck.save(state, f"s{i:03d}.ckpt")
                waited += h.telemetry.buffer_wait_s
                assert ck.memory.host.in_use() <= max_pending
                if i in (20, 99):
                    gc.collect()
                    rss_at[i] = proc.memory_info().rss
            ck.wait()
            stop.set()
            t.join()
        assert ck.memory.host._count <= max_pending
        image = h.telemetry.bytes
    peak = max(samples + [base])
    # Resident: the pages of max_pending staging buffers the images touch, plus allocator slack.
    budget = max_pending * image + (16 << 20)
    print(
        f"peak {(peak - base) / 2**20:.1f} MiB above start; "
        f"growth 20->99: {(rss_at[99] - rss_at[20]) / 2**20:.1f} MiB; waited {waited:.2f} s"
    )
    assert peak - base <= budget, (
        f"peak RSS {peak - base >> 20} MiB above start, budget {budget >> 20} MiB"
    )
    assert rss_at[99] - rss_at[20] <= 8 << 20, "RSS grows from save to save"
    assert waited > 0  # the disk was slower than the caller: back-pressure really acted
    with stagesave.Checkpointer(tmp_path) as ck:
        assert torch.equal(ck.load("s099.ckpt")["w"], torch.full((n,), 99.0))
    faultstats.record("max_pending back-pressure (RSS over 100 saves)", 100)
