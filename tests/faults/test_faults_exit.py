"""The process ends while a save is still being written: it commits or leaves nothing valid, and
the process does not hang.

Children are forked from a server with torch preloaded (a fork, not an interpreter start); their
disk is slowed by a hook on ``stagesave.stores.posix`` so that the save is really in flight when the
process ends. A multiprocessing child ends through ``threading._shutdown()`` like an interpreter
does (that is where stagesave flushes), but not through ``atexit``; one case therefore also runs
a real interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import faultchild
import pytest
import torch
from faulthelp import debris, file_state, latest_name

pytestmark = pytest.mark.usefixtures("thread_writer")  # faults injected in this process

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "stagesave", "faultchild"])

FAULT_CLASS = "process exit with a pending save"


def _exit_child(root: str, how: str, signal_after_submit: bool = False):  # type: ignore[no-untyped-def]
    import stagesave

    stagesave.save(file_state(1), os.path.join(root, "last.ckpt"))
    parent, child = _ctx.Pipe()
    p = _ctx.Process(target=faultchild.exit_with_pending_save, args=(root, how, child))
    t0 = time.monotonic()
    p.start()
    assert parent.poll(60) and parent.recv() == "submitted"
    if signal_after_submit:
        time.sleep(0.1)  # inside the slowed write ("sigterm": a write that never ends)
        os.kill(p.pid, signal.SIGTERM)
    p.join(60)
    assert p.exitcode is not None, f"the process hangs at exit ({how})"
    return p.exitcode, time.monotonic() - t0


@pytest.mark.fault_class(FAULT_CLASS)
@pytest.mark.parametrize(("how", "code"), [("return", 0), ("sys.exit(1)", 1), ("exception", 1)])
def test_exit_flushes_the_pending_save(tmp_path, how, code):
    exitcode, _ = _exit_child(str(tmp_path), how)
    assert exitcode == code
    assert latest_name(tmp_path) == ("last.ckpt", 2)  # committed by the flush at exit
    assert debris(tmp_path) == []


@pytest.mark.fault_class(FAULT_CLASS)
def test_sigterm_kills_mid_save_and_leaves_only_the_previous(tmp_path):
    """Default SIGTERM action: the process dies at once; the half-written save is not valid."""
    exitcode, _ = _exit_child(str(tmp_path), "sigterm", signal_after_submit=True)
    assert exitcode == -signal.SIGTERM
    assert latest_name(tmp_path) == ("last.ckpt", 1)
    import stagesave

    with stagesave.Checkpointer(tmp_path) as ck:
        assert [(c.name, c.status) for c in ck.list()] == [("last.ckpt", "committed")]
    assert all(".stagesave-tmp" in d for d in debris(tmp_path))  # only gc-able temporaries


@pytest.mark.fault_class(FAULT_CLASS)
def test_sigterm_handler_that_exits_flushes_the_save(tmp_path):
    """Training scripts (and Lightning) turn SIGTERM into an orderly exit: the save commits."""
    exitcode, _ = _exit_child(str(tmp_path), "sigterm-handler", signal_after_submit=True)
    assert exitcode == 143
    assert latest_name(tmp_path) == ("last.ckpt", 2)
    assert debris(tmp_path) == []


@pytest.mark.fault_class(FAULT_CLASS)
def test_exit_with_a_failing_pending_save_reports_and_does_not_hang(tmp_path):
    exitcode, _ = _exit_child(str(tmp_path), "failing-save")
    assert exitcode == 0  # the flush reports on stderr; it cannot change a finished exit code
    assert latest_name(tmp_path) == ("last.ckpt", 1)
    assert debris(tmp_path) == []


@pytest.mark.fault_class(FAULT_CLASS)
@pytest.mark.slow
def test_uncaught_exception_in_a_real_interpreter(tmp_path):
    """The same through a real interpreter's exit (atexit, threading shutdown, stderr)."""
    import stagesave

    stagesave.save(file_state(1), tmp_path / "last.ckpt")
    code = (
        "import torch, stagesave\n"
        f"ck = stagesave.Checkpointer({str(tmp_path)!r})\n"
        "ck.save({'step': 2, 'w': torch.arange(4000, dtype=torch.float32) + 2}, 'last.ckpt')\n"
        "raise RuntimeError('the training loop crashed')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 1 and "the training loop crashed" in r.stderr
    assert latest_name(tmp_path) == ("last.ckpt", 2)
    assert torch.equal(stagesave.load(tmp_path / "last.ckpt")["w"], file_state(2)["w"])
