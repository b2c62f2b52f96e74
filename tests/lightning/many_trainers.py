"""Child process: N Trainers created and fitted one after another in one process.

Each fits a 48 MiB state (16 MiB of weights and Adam's two moments) with ``ModelCheckpoint``,
then saves once more after ``fit``. Prints one JSON line: live ``stagesave-*`` threads and RSS
after each trainer. glibc is told to serve every allocation of 1 MiB or more with its own
mapping (a fixed mmap threshold), so RSS shows live memory, not the allocator's cache.

    python many_trainers.py --runs 100 --io staged|torch --dir DIR
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

M_MMAP_THRESHOLD = -3
ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402, RUF100 - after mallopt
from lightning.pytorch import LightningModule  # noqa: E402, RUF100 - after mallopt
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402, RUF100 - after mallopt
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402, RUF100 - after mallopt
from lightning_helpers import StepBatches, make_trainer  # noqa: E402, RUF100 - after mallopt
from torch import nn  # noqa: E402, RUF100 - after mallopt

#: Bytes of checkpointed state (weights, bias and Adam's two moments of each).
STATE_BYTES = 3 * 2048 * 2049 * 4


class WideModel(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2048, 2048)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, _ = batch
        return self.net(x.repeat(1, 256)).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--io", choices=["staged", "torch"], default="staged")
    p.add_argument("--dir", required=True)
    a = p.parse_args()
    root = Path(a.dir)
    threads, rss, seconds = [], [], []
    for i in range(a.runs):
        t0 = time.perf_counter()
        d = root / f"run{i % 2}"  # each trainer overwrites the one before last
        if a.io == "staged":
            from stagesave.lightning import StagedCheckpointIO

            io: Any = StagedCheckpointIO()
        else:
            io = TorchCheckpointIO()
        mc = ModelCheckpoint(dirpath=d, save_top_k=1, every_n_train_steps=1)
        trainer = make_trainer(root, [io], [mc], max_steps=2)
        trainer.fit(WideModel(), StepBatches(n=2, dim=8))
        trainer.save_checkpoint(d / "final.ckpt")
        del trainer, mc, io
        gc.collect()
        seconds.append(time.perf_counter() - t0)
        threads.append(sum(t.name.startswith("stagesave") for t in threading.enumerate()))
        rss.append(rss_bytes())
    print(json.dumps({"io": a.io, "state_bytes": STATE_BYTES, "threads": threads, "rss": rss,
                      "seconds": seconds}))


if __name__ == "__main__":
    main()
