"""A trainer for the held-save crash test, run in forked children (imported by the forkserver,
not collected): one save committed, then one held save (``plan_behind=True``), then SIGKILL at
a chosen moment after that save returned."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import stagesave


def held_state(step: int) -> dict[str, Any]:
    """2,500 tensors of 64 floats (held by default), their values naming the step."""
    return {"state": {i: {"exp_avg": torch.full((64,), float(step * 10_000 + i)),
                          "exp_avg_sq": torch.full((64,), -float(i))} for i in range(1_250)},
            "step": step}


def small_state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1_000,), float(step)), "step": step}


def held_then_die(root: str, shm: str, writer: str, delay: float, conn: Any) -> None:
    os.environ["STAGESAVE_SHM_DIR"] = shm
    ck = stagesave.Checkpointer(root, writer=writer, plan_behind=True, chunk_bytes=1 << 20)
    ck.save(small_state(0), "step-000.ckpt").result()
    handle = ck.save(held_state(1), "step-001.ckpt")
    agent = ck.writer.agent
    conn.send((handle.telemetry.plan_s, agent.pid if agent is not None else None))
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)


def held_under_a_memory_limit(root: str, conn: Any) -> None:
    """A process whose address space fits a state and one staging buffer, not a held copy
    beside them (``RLIMIT_AS``, set after one save without holding made the same buffer): it
    tells the parent whether the next save, by a Checkpointer that would hold it, was held."""
    import resource

    state = {f"t{i}": torch.full((7_000,), float(i)) for i in range(7_000)}  # 196 MB, 7,000
    with stagesave.Checkpointer(root, writer="thread", plan_behind=False) as ck:
        ck.save(state, "a.ckpt").result()
    with stagesave.Checkpointer(root, writer="thread", plan_behind=True) as ck:
        ck.save({"warm": torch.ones(1)}, "warm.ckpt").result()  # its threads made
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (330 << 20), resource.RLIM_INFINITY))
        handle = ck.save(state, "b.ckpt")
        handle.result()
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    conn.send(handle.telemetry.plan_behind_s > 0)
