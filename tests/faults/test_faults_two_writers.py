"""Two processes save the same checkpoint path at once, in every order of their commit steps.

Each writer is a real process (forked from a server with torch preloaded) that stops before each
step of its commit (creating the temporary; making its data durable; making its proof durable,
which follows taking the directory's commit lock and its sequence number; the publishing rename)
until the parent lets it go on. The parent drives both through every interleaving of those steps
(C(8, 4) = 70 schedules) and checks afterwards: ``last.ckpt`` is the old checkpoint or one of the
two new ones, whole and verified (a file carries its own proof: there is no pair to mismatch);
if both writers reported success it is one of theirs; a writer that reported failure is not the
one that won; every failure is a CheckpointError naming the path; the winner's sequence number
is above the old checkpoint's.

A writer that waits for the other's commit lock (seen in /proc/locks) is left waiting and the
schedule goes on with the other.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.connection
import os
import time
import warnings

import faultchild
import faultstats
import pytest
import torch
from faultchild import file_state
from faulthelp import blocked_on_a_lock

import stagesave

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "stagesave", "faultchild"])

FAULT_CLASS = "two writers, every commit interleaving (2 processes)"
SCHEDULES = sorted({"".join(p) for p in itertools.permutations("AAAABBBB")})
STEP = {"A": 2, "B": 3}


@pytest.fixture(scope="module")
def writers():
    procs = {}
    for w in "AB":
        parent, child = _ctx.Pipe()
        p = _ctx.Process(target=faultchild.writer_server, args=(child,))
        p.start()
        procs[w] = (p, parent)
    yield procs
    for p, conn in procs.values():
        try:
            conn.send(None)
        except OSError:
            pass
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join()


def _step(writers, w: str) -> tuple[str, object] | None:
    """Let writer ``w`` run to its next stop; None if it is left waiting (for the other's lock)."""
    p, conn = writers[w]
    conn.send("go")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if conn.poll(0.01):
            return conn.recv()
        if blocked_on_a_lock(p.pid):
            return None
    return None  # stalled for another reason: the schedule goes on without it


def _drive(writers, root: str, schedule: str) -> dict[str, str | None]:
    """Run both saves through ``schedule``; each writer's outcome (None: success)."""
    for w in "AB":
        writers[w][1].send((root, "last.ckpt", STEP[w]))
    last = {w: writers[w][1].recv() for w in "AB"}  # both stopped before creating their data
    waiting = {"A": False, "B": False}
    for w in schedule:
        if last[w][0] == "done" or waiting[w]:
            continue
        got = _step(writers, w)
        if got is None:
            waiting[w] = True
        else:
            last[w] = got
    # Let both finish, in whatever order their locks allow.
    while any(last[w][0] != "done" for w in "AB"):
        for w in "AB":
            if last[w][0] != "done" and not waiting[w]:
                writers[w][1].send("go")
                waiting[w] = True
        busy = {writers[w][1]: w for w in "AB" if waiting[w]}
        ready = multiprocessing.connection.wait(list(busy), timeout=60)
        assert ready, "both writers hang"
        for conn in ready:
            w = busy[conn]
            last[w] = conn.recv()
            waiting[w] = False
    return {w: last[w][1] for w in "AB"}


def _judge(root: str, outcomes: dict[str, str | None]) -> list[str]:
    problems = []
    for w, out in outcomes.items():
        if out is not None and (out.startswith("UNEXPECTED") or "last.ckpt" not in out):
            problems.append(f"writer {w} failed unclearly: {out}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with stagesave.Checkpointer(root) as ck:
            info = ck.verify("last.ckpt")
            if info.status != "verified":
                return problems + [f"last.ckpt is {info.status}: {'; '.join(info.problems)}"]
            state = ck.load("last.ckpt")
            best = ck.latest(verify=True)
    step = state["step"]
    if info.seq is None or info.seq <= 1:
        problems.append(
            f"last.ckpt has sequence number {info.seq}, not above the old checkpoint's 1"
        )
    if not torch.equal(state["w"], file_state(step)["w"]):
        problems.append(f"last.ckpt of step {step} holds other values")
    winner = {2: "A", 3: "B"}.get(step)
    if best is None or best.name != "last.ckpt":
        problems.append(f"latest() is {best and best.name}, not last.ckpt")
    if all(o is None for o in outcomes.values()) and winner is None:
        problems.append("both writers reported success but last.ckpt is the old checkpoint")
    if winner is not None and outcomes[winner] is not None:
        problems.append(f"writer {winner} reported failure but its checkpoint is last.ckpt")
    return problems


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_processes_save_the_same_path(tmp_path, writers, schedule):
    root = str(tmp_path)
    stagesave.save(file_state(1), os.path.join(root, "last.ckpt"))
    outcomes = _drive(writers, root, schedule)
    problems = _judge(root, outcomes)
    faultstats.record(FAULT_CLASS, 1, int(bool(problems)))
    assert not problems, problems
