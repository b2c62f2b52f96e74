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
    conn.send(handle.telemetry.plan_s)
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)
