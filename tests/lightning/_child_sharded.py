"""Child: sharded checkpoints with two processes on the CPU (gloo), through stagesave.

Usage: ``python _child_sharded.py ROOT KIND [KIND ...]`` with kinds ``fsdp``,
``model_parallel``, ``fsdp-cuda``, each run in ``ROOT/<kind>``, one after the other in the same
two processes (starting them is most of the cost). Lightning re-launches this script for rank 1.
On the CPU the model shards itself in ``configure_model`` (FSDP1 with ``device_id=cpu``, or
FSDP2's ``fully_shard`` on the ModelParallel data-parallel mesh), which is
how Lightning's FSDP runs on a CPU at all; ``fsdp-cuda`` leaves the wrapping to Lightning (an
auto-wrap policy) on up to two GPUs. Phases, each a ``Trainer.fit`` in the same processes:

1. train 4 steps with the staged strategy, checkpoints every 2 steps (top-1, ``save_last``
   "link" for FSDP, ``True`` for ModelParallel); then two manual saves after the fit, each
   committed when ``save_checkpoint`` returns, on every rank;
2. resume with ``ckpt_path="last"`` and the staged strategy;
3. resume from the step-4 folder with Lightning's own strategy (the folder is Lightning's layout)
   and save a plain Lightning folder at step 6;
4. resume from that plain folder with the staged strategy;
5. flip one byte of a staged folder and try to resume from it;
6. (ModelParallel) ``save_distributed_checkpoint=False``: a full checkpoint file through the
   plugin, and a resume from it.

Phase 1 also tries a save whose ``meta.pt`` cannot be written (a lambda in the checkpoint).

Each rank writes ``ROOT/<kind>/rank<N>.json``: fingerprints (sha256 of its shards of the model and
optimizer state) at the end of a run and after each restore, the steps, what ``latest()`` found.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning_helpers import StepBatches
from stagesave.lightning import (
    StagedFSDPStrategy,
    StagedModelParallelStrategy,
    find_plugin,
    latest,
)
from torch import nn

import stagesave
from stagesave.dcp import _rankjob  # a rank file's write is slowed there


class ShardedModel(LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1)
        )

    def configure_model(self) -> None:
        if self.kind == "fsdp-cuda":
            return  # Lightning wraps the model itself (auto_wrap_policy)
        if self.kind == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            if not isinstance(self.net, FSDP):
                self.net = FSDP(self.net, device_id=torch.device("cpu"), use_orig_params=True)
        else:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if getattr(self, "unsaveable", False):
            checkpoint["hook"] = lambda: None  # a value meta.pt cannot hold

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def fingerprint(trainer: Trainer) -> str:
    """sha256 of this rank's shards of the model and optimizer state (every rank calls it).

    Sharded state, not the gathered one: FSDP1 cannot gather a full state dict on a CPU."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    model_sd, optim_sd = get_state_dict(trainer.strategy.model, trainer.optimizers)
    h = hashlib.sha256()

    def feed(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                feed(f"{prefix}.{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                feed(f"{prefix}.{i}", v)
        elif isinstance(value, ShardedTensor):
            for i, shard in enumerate(value.local_shards()):
                feed(f"{prefix}.shard{i}", shard.tensor)
        elif isinstance(value, DTensor):
            feed(prefix, value.to_local())
        elif isinstance(value, torch.Tensor):
            h.update(prefix.encode())
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={value!r}".encode())

    feed("model", model_sd)
    feed("optim", optim_sd)
    return h.hexdigest()


class Record(Callback):
    def __init__(self, out: dict[str, Any], phase: str) -> None:
        self.out, self.phase = out, phase

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.out[f"{self.phase}_start"] = [trainer.global_step, fingerprint(trainer)]

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.out[f"{self.phase}_end"] = [trainer.global_step, fingerprint(trainer)]
        shards = getattr(trainer.strategy, "_shards", None)
        writer = shards._writer if shards is not None else None
        plugin = find_plugin(trainer)
        # the fit's sharded saves: through one writer on the plugin's checkpointer (a top-k
        # removal queued behind them, not run at once with a checkpointer closed and made again),
        # and how many of them exchanged plan names
        self.out[f"{self.phase}_writer"] = None if writer is None else [
            writer.checkpointer is plugin.checkpointer, writer.exchanged.saves]


class PlainFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy unchanged: a subclass only because Lightning refuses the plain
    class without a GPU (the model wraps itself for the CPU in ``configure_model``)."""


def trainer(kind: str, root: Path, staged: bool, max_steps: int, *callbacks: Any) -> Trainer:
    strategy: Any
    accelerator, devices = "cpu", 2
    if kind == "model_parallel_full":  # full (gathered) checkpoints: single files via the plugin
        strategy = StagedModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                               save_distributed_checkpoint=False)
    elif kind == "fsdp":
        strategy = (StagedFSDPStrategy if staged else PlainFSDPStrategy)(state_dict_type="sharded")
    elif kind == "fsdp-cuda":
        strategy = (StagedFSDPStrategy if staged else FSDPStrategy)(state_dict_type="sharded",
                                                                      auto_wrap_policy={nn.Linear})
        accelerator, devices = "cuda", min(2, torch.cuda.device_count())
    else:
        strategy = (StagedModelParallelStrategy if staged else ModelParallelStrategy)(
            data_parallel_size=2, tensor_parallel_size=1)
    return Trainer(strategy=strategy, accelerator=accelerator, devices=devices, max_steps=max_steps,
                   callbacks=list(callbacks),
                   default_root_dir=str(root), logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0)


def run(kind: str, root: Path) -> None:
    ckpt = root / "ckpt"
    out: dict[str, Any] = {}
    save_last: Any = True if kind == "model_parallel" else "link"

    # 1. train with the staged strategy
    mc = ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2, save_top_k=1, save_last=save_last)
    first = trainer(kind, root, True, 4, mc, Record(out, "run1"))
    first.fit(ShardedModel(kind), StepBatches())
    rank = first.global_rank
    out["files"] = sorted(p.name for p in ckpt.iterdir())
    out["latest"] = latest(ckpt)

    plugin = find_plugin(first)
    assert plugin is not None
    # Outside fit a sharded save returns committed, on every rank, as a single file does
    # (each rank file written slowly: returning staged would find no folder yet).
    real_write = _rankjob.write_rank

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return real_write(*args, **kwargs)

    _rankjob.write_rank = slow_write  # type: ignore[assignment]
    try:
        first.save_checkpoint(root / "manual-a.ckpt")
        out["a_on_return"] = (root / "manual-a.ckpt").exists()  # the filesystem, not stagesave
        first.save_checkpoint(root / "manual-b.ckpt")
        out["b_on_return"] = (root / "manual-b.ckpt").exists()
        out["pending_after_b"] = plugin.pending()
        out["b_status"] = stagesave.verify(str(root / "manual-b.ckpt")).status
    finally:
        _rankjob.write_rank = real_write  # type: ignore[assignment]
    first.strategy.barrier()

    # A save whose meta.pt cannot be written fails on every rank before anything is staged.
    first.lightning_module.unsaveable = True  # type: ignore[attr-defined]
    try:
        first.save_checkpoint(root / "manual-c.ckpt")
        out["c_error"] = None
    except Exception as exc:  # noqa: BLE001, RUF100 - recorded for the test
        out["c_error"] = [type(exc).__name__, str(exc)[:400]]
    first.lightning_module.unsaveable = False  # type: ignore[attr-defined]
    plugin.teardown()

    # 2. resume with ckpt_path="last"
    second = trainer(
        kind, root, True, 6, ModelCheckpoint(dirpath=ckpt, save_last=save_last), Record(out, "run2")
    )
    second.fit(ShardedModel(kind), StepBatches(), ckpt_path="last")

    # 3. Lightning's own strategy reads the staged folder, and writes a plain one at step 6
    plain_dir = root / "plain"
    third = trainer(kind, root, False, 6, ModelCheckpoint(dirpath=plain_dir, every_n_train_steps=6),
                    Record(out, "run3"))
    third.fit(ShardedModel(kind), StepBatches(), ckpt_path=ckpt / "epoch=0-step=4.ckpt")

    # 4. the staged strategy reads the plain folder
    fourth = trainer(kind, root, True, 7, Record(out, "run4"))
    fourth.fit(ShardedModel(kind), StepBatches(), ckpt_path=plain_dir / "epoch=0-step=6.ckpt")

    # 5. one flipped byte in a staged folder: loading refuses it on every rank
    bad = root / "manual-b.ckpt" / f"__{first.world_size - 1}_0.distcp"  # the last rank's file
    if rank == 0:
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside the shards' bytes (the file ends with its proof)
        bad.write_bytes(bytes(data))
    torch.distributed.barrier()
    try:
        trainer(kind, root, True, 8).fit(
            ShardedModel(kind), StepBatches(), ckpt_path=root / "manual-b.ckpt"
        )
        out["corrupt_error"] = None
    except Exception as exc:  # noqa: BLE001, RUF100 - recorded for the test
        out["corrupt_error"] = [type(exc).__name__, str(exc)[:400]]

    if kind == "model_parallel":
        # 6. the same strategy with full checkpoints: one file, written by rank 0's plugin
        full = root / "full"
        trainer(
            "model_parallel_full",
            full,
            True,
            2,
            ModelCheckpoint(dirpath=full, every_n_train_steps=2),
            Record(out, "full1"),
        ).fit(ShardedModel(kind), StepBatches())
        trainer("model_parallel_full", full, True, 3, Record(out, "full2")).fit(
            ShardedModel(kind), StepBatches(), ckpt_path=full / "epoch=0-step=2.ckpt")

    (root / f"rank{rank}.json").write_text(json.dumps(out))


def main() -> None:
    base = Path(sys.argv[1])
    for kind in sys.argv[2:]:
        run(kind, base / kind)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
