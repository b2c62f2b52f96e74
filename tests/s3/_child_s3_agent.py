"""Child: saves to S3 through a writer agent, then is SIGKILLed.

Usage: ``python _child_s3_agent.py URL OPTIONS_JSON SAVES MIB MODE SEED``. Saves ``SAVES``
checkpoints ``step-<i>.ckpt`` (see :func:`state_of`: ``MIB`` MiB filled with ``i``) with
``writer="process"``, printing ``SAVED <i> <agent pid> <path>`` as each returns; then kills
itself: at once (``MODE=after_return``) or after a random 0-50 ms of the background upload
(``MODE=during_write``, drawn from ``SEED``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from typing import Any

import torch

import stagesave

MiB = 1 << 20


def state_of(i: int, mib: int) -> dict[str, Any]:
    """The state of save ``i``: its index, ``mib`` MiB of float32 equal to ``i``, a small
    tensor that names it too."""
    return {"step": i, "w": torch.full((mib * MiB // 4,), float(i)),
            "b": torch.arange(1000, dtype=torch.int64) + i}


def main() -> None:
    url, options = sys.argv[1], json.loads(sys.argv[2])
    saves, mib, mode, seed = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
    ck = stagesave.Checkpointer(url, writer="process", storage_options=options)
    for i in range(saves):
        handle = ck.save(state_of(i, mib), f"step-{i:03d}.ckpt")
        agent = ck.writer.agent
        print(f"SAVED {i} {agent.pid if agent is not None else None} {handle.path}", flush=True)
    if mode == "during_write":
        time.sleep(random.Random(seed).uniform(0.0, 0.05))
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
