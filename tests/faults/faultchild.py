"""Code run in child processes by the fault tests (preloaded by the forkserver, not collected).

Children are forked from a server that already imported torch and stagesave, so each costs a
fork, not an interpreter start. They report to the parent over a ``multiprocessing`` pipe.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
import traceback
from typing import Any

import torch
from faultfs import Call, Recorder

import stagesave


def file_state(step: int, n: int = 4000) -> dict[str, Any]:
    return {"step": step, "w": torch.arange(n, dtype=torch.float32) + step}


# ---------------------------------------------------------------------------- two writers
#: Where a writer stops for the parent, in protocol order.
WRITER_POINTS = ("data", "flushed", "sealed", "publish")


def _writer_point(root: str, name: str, call: Call, job: dict[str, Any]) -> str | None:
    leaf = os.path.basename(call.path)
    if call.name == "open" and leaf.startswith(f".{name}.") and leaf.endswith(".stagesave-tmp"):
        job["tmp"] = call.path
        return "data"  # the temporary is about to be created
    if call.name == "fsync" and call.path == job.get("tmp"):
        job["fsyncs"] = job.get("fsyncs", 0) + 1
        # the 1st makes the data durable (before the commit lock); the 2nd the proof, written under
        # the lock after the sequence number was taken
        return "flushed" if job["fsyncs"] == 1 else "sealed"
    if call.name == "replace" and os.path.abspath(call.args[1]) == os.path.join(root, name):
        return "publish"
    return None


def writer_server(conn: Any) -> None:
    """Serve saves ``(root, name, step)`` one after another, stopping at each of WRITER_POINTS
    (``("at", point)`` to the parent) until told to go on; ``None`` ends the loop."""
    rec = Recorder("/")
    rec.recording = False
    job: dict[str, Any] = {}

    def hook(call: Call) -> None:
        point = _writer_point(job["root"], job["name"], call, job)
        if point is not None and point not in job["seen"]:
            job["seen"].add(point)
            conn.send(("at", point))
            conn.recv()

    rec.add_hook(hook)
    with rec:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            root, name, step = msg
            job.clear()
            job.update(root=root, name=name, seen=set())
            outcome: str | None = None
            try:
                # the hooks see this process's calls: its own writer
                with stagesave.Checkpointer(root, chunk_bytes=8192, writer="thread") as ck:
                    ck.save(file_state(step), name).result(timeout=120)
            except stagesave.CheckpointError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            except BaseException as exc:  # noqa: BLE001 - reported, the parent judges
                outcome = f"UNEXPECTED {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            conn.send(("done", outcome))


# ---------------------------------------------------------------------------- readers
def reader(root: str, conn: Any) -> None:
    """Report what ``latest(verify=True)`` offers in ``root``, as another process sees it."""
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with stagesave.Checkpointer(root) as ck:
                info = ck.latest(verify=True)
                if info is None:
                    conn.send(("none", None))
                    return
                target = os.path.join(info.path, "optimizer.bin") if info.is_dir else info.path
                conn.send((info.name, ck.load(target)["step"]))
    except BaseException as exc:  # noqa: BLE001
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------------------- exits
def exit_with_pending_save(root: str, how: str, conn: Any) -> None:
    """Submit a save that is slow to write, then leave the process in the way ``how`` says."""
    rec = Recorder(root)
    rec.recording = False

    def slow(call: Call) -> None:
        if call.name == "pwrite":
            # a slow disk: the save is still being written when we exit; with the default
            # SIGTERM action, a disk that never finishes (the signal lands inside the write on
            # any machine, however loaded)
            time.sleep(120 if how == "sigterm" else 0.05)

    rec.add_hook(slow)
    if how == "failing-save":
        rec.fail("fsync", errno.EIO, nth=1)
    rec.__enter__()  # stays installed until the process is gone
    if how == "sigterm-handler":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ck = stagesave.Checkpointer(root, chunk_bytes=64 * 1024, io_threads=2, writer="thread")
    ck.save(file_state(2, 300_000), "last.ckpt")
    conn.send("submitted")
    if how in ("return", "failing-save"):
        return
    if how == "sys.exit(1)":
        sys.exit(1)
    if how == "exception":
        raise RuntimeError("the training loop crashed")
    if how in ("sigterm", "sigterm-handler"):
        time.sleep(120)  # the parent sends SIGTERM meanwhile
        return
    raise ValueError(how)
