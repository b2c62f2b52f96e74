"""Shared parts of the Lightning tests: a tiny deterministic model, resumable data, a writer gate.

A module with a name of its own (not ``conftest``), so that the tests and the child processes
import it unambiguously when other test directories are collected in the same run.

Everything here is real: a real ``Trainer`` on the CPU, real files, and faults made by slowing
or breaking the real thing (a writer thread held by a slow telemetry consumer, a directory
swapped for a file), never by mocking stagesave or Lightning.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from stagesave import SaveTelemetry

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PYTHON = sys.executable


class StepBatches:
    """A resumable stream of batches: batch ``i`` of epoch ``e`` depends only on (seed, e, i).

    Lightning saves and restores its position (``state_dict``), so a run resumed mid-epoch sees
    exactly the batches an uninterrupted run would.
    """

    def __init__(self, n: int = 8, batch: int = 4, dim: int = 8, seed: int = 0) -> None:
        self.n, self.batch, self.dim, self.seed = n, batch, dim, seed
        self.epoch = 0
        self.pos = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.pos >= self.n:  # the previous epoch was consumed: start the next one
            self.epoch += 1
            self.pos = 0
        while self.pos < self.n:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 1009 + self.pos)
            self.pos += 1
            x = torch.randn(self.batch, self.dim, generator=g)
            yield x, x.sum(dim=1, keepdim=True).tanh()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


class TinyModel(LightningModule):
    """A small MLP with dropout; saves the torch RNG so a resumed run draws the same masks."""

    def __init__(
        self, dim: int = 8, hidden: int = 32, lr: float = 0.01, numpy_state: bool = False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1)
        )
        # A mutable non-tensor leaf (as many users keep): updated in place every step.
        self.seen = np.zeros(4, dtype=np.int64)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.seen += 1
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        return {
            "optimizer": opt,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9),
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["torch_rng"] = torch.get_rng_state()
        if self.hparams["numpy_state"]:
            checkpoint["seen"] = self.seen  # by reference, as users write it
            checkpoint["numpy_rng"] = np.random.get_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        torch.set_rng_state(checkpoint["torch_rng"])
        if "seen" in checkpoint:
            self.seen = np.array(checkpoint["seen"])


def make_trainer(
    root: Path, plugins: Sequence[Any] = (), callbacks: Sequence[Any] = (), **kw: Any
) -> Trainer:
    options: dict[str, Any] = {
        "default_root_dir": str(root),
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "deterministic": True,
    }
    options.update(kw)
    return Trainer(plugins=list(plugins) or None, callbacks=list(callbacks), **options)


class WriterGate:
    """A slow telemetry consumer: while closed, it holds stagesave's writer thread after the
    ``hold_after``-th committed save, so every later save and removal stays pending until
    ``open()``; ``entered`` is set once it holds."""

    def __init__(self, hold_after: int = 1) -> None:
        self._open = threading.Event()
        self.entered = threading.Event()
        self.hold_after = hold_after
        self.seen: list[SaveTelemetry] = []

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def __call__(self, tel: SaveTelemetry) -> None:
        self.seen.append(tel)
        if len(self.seen) < self.hold_after:
            return
        self.entered.set()
        if not self._open.wait(20):
            raise RuntimeError("WriterGate was never opened")


class HeldCheckpointIO(TorchCheckpointIO):
    """Lightning's own TorchCheckpointIO whose writes wait for ``release`` (for the
    AsyncCheckpointIO baseline: the same pending window the gate gives the plugin)."""

    def __init__(self, hold_after: int = 1, fail_at: int | None = None) -> None:
        super().__init__()
        self.release = threading.Event()
        self.hold_after = hold_after
        self.fail_at = fail_at
        self.calls = 0
        self.written: list[str] = []

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        self.calls += 1
        if self.calls > self.hold_after:
            self.release.wait(60)
        if self.fail_at is not None and self.calls == self.fail_at:
            raise OSError(28, f"No space left on device: {path}")
        super().save_checkpoint(checkpoint, path, storage_options)
        self.written.append(os.path.basename(path))


def run_python(args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 180,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a Python child process with the repository importable; output captured."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join([str(HERE), full_env.get("PYTHONPATH", "")])
    return subprocess.run([PYTHON, *args], env=full_env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        y = b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{k} differs"
