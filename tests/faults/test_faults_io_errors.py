"""EIO from fsync, ENOSPC in the middle of the background write and from fallocate.

These faults are injected by wrapping ``stagesave.stores.posix`` (``faultfs.Recorder.fail``): the
wrapped call raises before it reaches the kernel. A real EIO from fsync needs a failing device
(or dm-flakey / dm-error, which need a block device and root in a VM); this sandbox has neither,
so the injected error stands in for it. Real ENOSPC on a small tmpfs is tested in
``tests/core/test_bad_input.py``; here the fault lands at an exact call of the protocol.

For every fault the contract is the same: the handle raises a :class:`StorageError` naming the
checkpoint and the cause; the fault fires once, so a retry of the failed call would succeed and
turn into a false success, which the test would see; the previous checkpoint stays the latest,
bit for bit; no temporary is left; the next save of the same path succeeds.
"""

from __future__ import annotations

import errno
import os
import re

import faultstats
import pytest
from faultfs import Call, Recorder
from faulthelp import debris, dir_state, file_state, latest_name

import stagesave
from stagesave.errors import StorageError

pytestmark = pytest.mark.usefixtures("thread_writer")  # faults injected in this process

EIO_CLASS = "EIO from fsync (injected)"
ENOSPC_CLASS = "ENOSPC mid-write / fallocate (injected)"
_NO_SPACE = "no space left on the device"
#: (folder?, name saved second): over the first checkpoint, or beside it.
SAVES = [(False, "last.ckpt"), (False, "new.ckpt"), (True, "checkpoint"), (True, "other")]


def _save(ck: stagesave.Checkpointer, is_dir: bool, step: int, name: str) -> stagesave.SaveHandle:
    return ck.save_dir(dir_state(step), name) if is_dir else ck.save(file_state(step), name)


def _first(is_dir: bool) -> str:
    return "checkpoint" if is_dir else "last.ckpt"


def _fault_then_recover(root, *, is_dir: bool, name: str, op: str, err: int, nth: int) -> Call:
    """Save 1, then save 2 with the ``nth`` call of ``op`` failing, then save 3; check each."""
    first = _first(is_dir)
    with stagesave.Checkpointer(root, chunk_bytes=8192) as ck:
        _save(ck, is_dir, 1, first).result()
        with Recorder(root) as rec:
            fired = rec.fail(op, err, nth=nth)
            try:  # the fault may strike the caller's own checks (a new folder made durable) ...
                handle = _save(ck, is_dir, 2, name)
            except StorageError as exc:
                error = exc
            else:  # ... or the background write
                with pytest.raises(StorageError) as ei:
                    handle.result(timeout=60)
                error = ei.value
        assert len(fired) == 1, f"the fault never fired: the save made fewer than {nth} {op} calls"
        message = str(error)
        assert str(root / name) in message and (
            "saving checkpoint" in message or "cannot write" in message
        )
        assert (_NO_SPACE if err in (errno.ENOSPC, errno.EDQUOT) else os.strerror(err)) in message
        assert error.errno == err
        assert debris(root) == []
        assert latest_name(root) == (first, 1)  # the previous checkpoint, verified
        if name != first:  # nothing of the failed save is offered, even as an unverified file
            assert name not in {c.name for c in ck.list() if c.valid}
        _save(ck, is_dir, 3, name).result(timeout=60)  # the cause is gone: the next save works
    assert latest_name(root) == (name, 3)
    assert debris(root) == []
    return fired[0]


def _fsyncs_of_a_clean_save(root, is_dir: bool, name: str, op: str = "fsync") -> list[str]:
    """Every ``op`` call the same save makes without a fault, described (file or folder, and
    which)."""
    root.mkdir()
    calls: list[str] = []
    with stagesave.Checkpointer(root, chunk_bytes=8192) as ck:
        _save(ck, is_dir, 1, _first(is_dir)).result()
        with Recorder(root) as rec:
            rec.add_hook(lambda c: calls.append(_describe(root, c)) if c.name == op else None)
            _save(ck, is_dir, 2, name).result()
    return calls


def _describe(root, call: Call) -> str:
    rel = re.sub(r"\.\d+-[0-9a-f]+\.stagesave-tmp", ".<tmp>", os.path.relpath(call.path, root))
    rel = re.sub(r"\.\d{20,}\.", ".<id>.", rel)  # the torch serialization id of each save
    return f"{'folder' if call.is_dir else 'file'} {rel}"


@pytest.mark.parametrize(
    ("is_dir", "name"), SAVES, ids=[f"{'dir' if d else 'file'}-{n}" for d, n in SAVES]
)
def test_eio_from_every_fsync_of_a_save(tmp_path, is_dir, name):
    """EIO at each fsync the protocol makes (data, proof, every directory; whichever thread):
    fatal, reported, never retried, the previous checkpoint kept, the next save fine."""
    fsyncs = _fsyncs_of_a_clean_save(tmp_path / "clean", is_dir, name)
    # a file: its data, its proof, its directory; a folder: that for each of its files, then its
    # staging folder and its parent
    assert len(fsyncs) >= (8 if is_dir else 3), fsyncs
    violations = []
    for nth, what in enumerate(fsyncs, 1):
        root = tmp_path / f"eio-{nth}"
        root.mkdir()
        try:
            fired = _fault_then_recover(
                root, is_dir=is_dir, name=name, op="fsync", err=errno.EIO, nth=nth
            )
            assert _describe(root, fired) == what, (fired, what)
        except (AssertionError, pytest.fail.Exception) as exc:
            violations.append(f"EIO at fsync #{nth} ({what}): {exc}")
    faultstats.record(EIO_CLASS, len(fsyncs), len(violations))
    assert not violations, "\n".join(violations)


@pytest.mark.fault_class(ENOSPC_CLASS)
@pytest.mark.parametrize("is_dir", [False, True], ids=["file", "dir"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EIO], ids=errno.errorcode.get)
@pytest.mark.parametrize("nth", [1, 3])
def test_error_in_the_middle_of_the_background_write(tmp_path, is_dir, err, nth):
    """pwrite fails (disk full, quota, I/O error) while the writer threads are mid-file."""
    _fault_then_recover(
        tmp_path,
        is_dir=is_dir,
        name="next" if is_dir else "next.ckpt",
        op="pwrite",
        err=err,
        nth=nth,
    )


@pytest.mark.fault_class(ENOSPC_CLASS)
@pytest.mark.parametrize(("is_dir", "nth"), [(False, 1), (True, 1), (True, 2)],
                         ids=["file", "dir-first-file", "dir-second-file"])
def test_enospc_from_fallocate(tmp_path, is_dir, nth):
    """fallocate reserves the whole file first; a full disk fails there, before any data."""
    _fault_then_recover(tmp_path, is_dir=is_dir, name="next" if is_dir else "next.ckpt",
                        op="posix_fallocate", err=errno.ENOSPC, nth=nth)


@pytest.mark.fault_class(ENOSPC_CLASS)
def test_enospc_from_the_proof_write(tmp_path):
    """The proof, the file's last write after every chunk, is the last thing to fill the disk."""
    pwrites = _fsyncs_of_a_clean_save(tmp_path / "clean", False, "next.ckpt", op="pwrite")
    root = tmp_path / "fault"
    root.mkdir()
    _fault_then_recover(
        root, is_dir=False, name="next.ckpt", op="pwrite", err=errno.ENOSPC, nth=len(pwrites)
    )


def test_fallocate_unsupported_is_not_an_error(tmp_path):
    """Filesystems without fallocate (EOPNOTSUPP) still get the checkpoint, verified."""
    with stagesave.Checkpointer(tmp_path, chunk_bytes=8192) as ck, Recorder(tmp_path) as rec:
        fired = rec.fail("posix_fallocate", errno.EOPNOTSUPP, nth=1)
        ck.save(file_state(7), "x.ckpt").result(timeout=60)
    assert len(fired) == 1
    assert latest_name(tmp_path) == ("x.ckpt", 7)


@pytest.mark.fault_class("EIO from close (injected)")
def test_eio_from_close_is_reported_and_the_fd_is_not_closed_twice(tmp_path):
    """NFS reports deferred write errors at close; Linux has released the fd all the same, so
    closing it again could close a file another thread just opened."""
    with stagesave.Checkpointer(tmp_path, chunk_bytes=8192) as ck:
        ck.save(file_state(1), "last.ckpt").result()
        with Recorder(tmp_path) as rec:
            closes: list[int] = []
            state = {"armed": True}

            def close_then_fail(call: Call) -> None:
                if call.name != "close":
                    return
                closes.append(call.args[0])
                if state["armed"] and not call.is_dir and call.path:
                    state["armed"] = False
                    os.close(call.args[0])  # Linux releases the fd even when close reports EIO
                    raise OSError(errno.EIO, "Input/output error (injected, after the close)")

            rec.add_hook(close_then_fail)
            with pytest.raises(StorageError, match="Input/output error"):
                ck.save(file_state(2), "last.ckpt").result(timeout=60)
        assert debris(tmp_path) == []
        assert latest_name(tmp_path) == ("last.ckpt", 1)
        assert len(closes) == len(set(closes)), f"fd closed twice: {closes}"
