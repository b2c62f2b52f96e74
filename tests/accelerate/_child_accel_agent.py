"""Child: a real ``Accelerator`` saving through a writer agent, SIGKILLed right after a
``save_state`` returns.

Usage: ``python _child_accel_agent.py PROJECT KILL_AFTER CHOICE TOTAL_LIMIT``. Automatic
checkpoint naming under ``PROJECT``; ``CHOICE`` is ``argument`` (``enable(acc,
writer="process")``) or ``environment`` (``$STAGESAVE_ACCELERATE_WRITER`` set by the parent);
``TOTAL_LIMIT`` 0 means none. Each iteration trains one step (so ``save_state`` returns once
staged) and saves; a registered :class:`Marker` carries an 8 MiB tensor filled with the save's
index, so the agent is still writing when the trainer dies. Before each save everything the
checkpoint must restore is written to ``PROJECT/expected/checkpoint_<i>.pt`` with plain
``torch.save``; once a save returns the child prints ``SAVED <i> <agent pid> <folder>``; after
the ``KILL_AFTER``-th it SIGKILLs itself at once.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import stagesave.accelerate as sa
import torch
from accel_helpers import build, snapshot, train
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

#: Elements of the marker tensor (float32: 8 MiB).
MARKER = 1 << 21


class Marker:
    """A checkpointed object whose tensor is filled with the index of the save."""

    def __init__(self) -> None:
        self.index = -1
        self.fill = torch.zeros(MARKER)

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index, "fill": self.fill}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])
        self.fill = state["fill"].clone()


def main() -> None:
    project, kill_after, choice = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    total_limit = int(sys.argv[4]) or None
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=total_limit))
    run = build(acc, width=512)
    marker = Marker()
    acc.register_for_checkpointing(marker)  # custom_checkpoint_2.pkl (after build's two)
    ckpt = sa.enable(acc, writer="process") if choice == "argument" else sa.enable(acc)
    expected = project / "expected"
    expected.mkdir(parents=True)
    for i in range(kill_after):
        train(acc, run, 1)  # inside training: save_state returns once staged
        marker.index, marker.fill = i, torch.full((MARKER,), float(i))
        torch.save(snapshot(acc, run), expected / f"checkpoint_{i}.pt")
        folder = acc.save_state()
        # private: the core Checkpointer of automatic naming, whose writer agent saves
        agent = ckpt._checkpointer("auto").writer.agent
        print(f"SAVED {i} {agent.pid if agent is not None else None} {folder}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
