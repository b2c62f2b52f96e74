"""Child process: train with ``save_last="link"`` (top-1, a checkpoint every two steps) until
the crash point named by ``STAGESAVE_CRASH_AT`` SIGKILLs it (a file's or a link's commit).

Usage: ``STAGESAVE_CRASH_AT=<point>:<n> python _child_crash_link.py ROOT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import StepBatches, TinyModel, make_trainer
from stagesave.lightning import StagedCheckpointIO


def main() -> None:
    root = Path(sys.argv[1])
    mc = ModelCheckpoint(
        dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=1, save_last="link"
    )
    make_trainer(root, [StagedCheckpointIO()], [mc], max_steps=6).fit(TinyModel(), StepBatches())
    print("not killed", flush=True)


if __name__ == "__main__":
    main()
