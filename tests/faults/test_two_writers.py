"""Two processes save the same checkpoint path at once, in every order of their commit steps.

Each writer is a real process (forked from a server with torch preloaded) that stops before each
step of its commit (creating the data temporary; writing the manifest, which follows listing the
manifests it will replace; the publishing rename; removing the replaced manifests) until the
parent lets it go on. The parent drives both through every interleaving of those steps
(C(8, 4) = 70 schedules) and checks afterwards: ``last.ckpt`` is the old checkpoint or one of the
two new ones, whole and verified (never one writer's bytes under the other's manifest); if both
writers reported success it is one of theirs; a writer that reported failure is not the one
that won; every failure is a CheckpointError naming the path.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import warnings

import faultchild
import faultstats
import pytest
import torch
from faultchild import file_state

import stagesave

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "stagesave", "faultchild"])

FAULT_CLASS = "two writers, every commit interleaving (2 processes)"
SCHEDULES = sorted({"".join(p) for p in itertools.permutations("AAAABBBB")})
STEP = {"A": 2, "B": 3}


def _loses_manifest(schedule: str) -> bool:
    """Whether the current protocol loses the winner's manifest in this interleaving.

    Segments per writer: 1 = write data + list the manifests to replace, 2 = write own manifest,
    3 = publishing rename, 4 = remove the listed manifests. The winner W renames last; the loser
    L lists W's manifest among those it replaces (and later removes it) iff L's segment 1 comes
    after W's segment 2: W's file then ends up without its manifest.
    """
    done = {"A": 0, "B": 0}
    when: dict[tuple[str, int], int] = {}
    for i, w in enumerate(schedule):
        done[w] += 1
        when[(w, done[w])] = i
    winner = "A" if when[("A", 3)] > when[("B", 3)] else "B"
    loser = "B" if winner == "A" else "A"
    return when[(loser, 1)] > when[(winner, 2)]


#: Interleavings where one writer removes the other's manifest and the other's rename wins:
#: both report success, and last.ckpt (the other's bytes) has no manifest that matches it.
LOST_MANIFEST = {s for s in SCHEDULES if _loses_manifest(s)}


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


def _drive(writers, root: str, schedule: str) -> dict[str, str | None]:
    """Run both saves through ``schedule``; each writer's outcome (None: success)."""
    for w in "AB":
        writers[w][1].send((root, "last.ckpt", STEP[w]))
    last = {w: writers[w][1].recv() for w in "AB"}  # both stopped before creating their data
    waiting = {"A": False, "B": False}
    for w in schedule:
        conn = writers[w][1]
        if last[w][0] == "done" or waiting[w]:
            continue
        conn.send("go")
        if conn.poll(5):
            last[w] = conn.recv()
        else:
            waiting[w] = True  # it waits for the other writer (a lock would do that): go on
    for w in "AB":
        conn = writers[w][1]
        while last[w][0] != "done":
            if not waiting[w]:
                conn.send("go")
            waiting[w] = False
            assert conn.poll(60), f"writer {w} hangs"
            last[w] = conn.recv()
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


@pytest.mark.parametrize("schedule", [
    pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=(
        "the loser lists the winner's manifest as 'replaced' before its own rename, then deletes "
        "it after the winner's rename: both report success, last.ckpt has no matching manifest "
        "and is refused as corrupt (no lock, no re-check of the file's id before deleting)"
    ))) if s in LOST_MANIFEST else s
    for s in SCHEDULES
])
def test_two_processes_save_the_same_path(tmp_path, writers, schedule):
    root = str(tmp_path)
    stagesave.save(file_state(1), os.path.join(root, "last.ckpt"))
    outcomes = _drive(writers, root, schedule)
    problems = _judge(root, outcomes)
    faultstats.record(FAULT_CLASS, 1, int(bool(problems)), known_bug=schedule in LOST_MANIFEST)
    assert not problems, problems
