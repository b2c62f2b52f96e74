"""Trainers run by the writer-agent crash tests in forked children (imported by the forkserver,
not collected): they save with ``writer="process"`` and are SIGKILLed after a save returns."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import torch

import stagesave
from stagesave._crash import AGENT_ENV_VAR  # fault injection in the agent


def state_of(step: int, seed: int) -> dict[str, Any]:
    """The state a trial saves at ``step``: sizes vary with the seed, values name the step."""
    rng = random.Random(seed * 1000 + step)
    n = rng.randint(1, 6)
    return {
        "step": step,
        "tensors": [torch.full((rng.randint(1, 400_000),), float(step * 10 + i))
                    for i in range(n)],
        "name": f"trial-{seed}-step-{step}",
    }


def save_then_die(root: str, shm: str, seed: int, saves: int, mode: str, conn: Any,
                  agent_crash: str | None = None) -> None:
    """Save ``saves`` checkpoints with a writer agent, telling the parent after each returned;
    then SIGKILL this process: at once (``mode="after_return"``) or after a random moment of
    the background write (``"during_write"``). ``agent_crash``: the crash point at which the
    agent SIGKILLs itself (fault injection)."""
    os.environ["STAGESAVE_SHM_DIR"] = shm
    os.environ.pop(AGENT_ENV_VAR, None)
    if agent_crash:
        os.environ[AGENT_ENV_VAR] = agent_crash
    rng = random.Random(seed)
    ck = stagesave.Checkpointer(root, writer="process", chunk_bytes=1 << 20)
    for step in range(saves):
        ck.save(state_of(step, seed), f"step-{step:03d}.ckpt")
        assert ck.writer.agent is not None
        conn.send((step, ck.writer.agent.pid))
    if mode == "during_write":
        time.sleep(rng.uniform(0.0, 0.03))
    os.kill(os.getpid(), signal.SIGKILL)


def save_fork_then_die(root: str, shm: str, conn: Any) -> None:
    """Save once, fork a child that keeps every descriptor open (a DataLoader worker started
    with fork holds the agent's socket too), then SIGKILL this process."""
    os.environ["STAGESAVE_SHM_DIR"] = shm
    os.environ.pop(AGENT_ENV_VAR, None)
    ck = stagesave.Checkpointer(root, writer="process")
    ck.save(state_of(0, 3), "step-000.ckpt")
    assert ck.writer.agent is not None
    worker = os.fork()
    if worker == 0:
        time.sleep(60)
        os._exit(0)
    conn.send((ck.writer.agent.pid, worker))
    os.kill(os.getpid(), signal.SIGKILL)


def save_behind_an_action_then_die(root: str, shm: str, conn: Any) -> None:
    """Save step 0; queue an action that never ends (a slow removal, a callback) and behind it
    step 1; tell the parent once step 1's ``save()`` returned, then SIGKILL this process: step
    1's order is held by the agent (this process's writer never reached it)."""
    os.environ["STAGESAVE_SHM_DIR"] = shm
    os.environ.pop(AGENT_ENV_VAR, None)
    ck = stagesave.Checkpointer(root, writer="process")
    ck.save(state_of(0, 5), "step-000.ckpt").result()
    ck.run_after(lambda: time.sleep(3600), description="stuck action")
    ck.save(state_of(1, 5), "step-001.ckpt")
    assert ck.writer.agent is not None
    conn.send(ck.writer.agent.pid)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
