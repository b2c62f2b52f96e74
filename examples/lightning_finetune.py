"""Fine-tune a small transformer language model with PyTorch Lightning and asynchronous checkpoints.

Everything is local: a character-level decoder-only transformer built here, trained on the text
in ``examples/data/corpus.txt``; nothing is downloaded. Checkpointing is Lightning's own
``ModelCheckpoint``; the only stagesave lines are the plugin and the resume helper::

    trainer = Trainer(plugins=[StagedCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, data, ckpt_path=stagesave.lightning.latest(dirpath))

Run it, crash it, run it again::

    # SIGKILL itself right after the checkpoint of step 60 was submitted
    python examples/lightning_finetune.py --dir runs/lm --crash-after-step 60
    # the same command without --crash-after-step resumes from the newest valid checkpoint
    python examples/lightning_finetune.py --dir runs/lm

At the kill, the checkpoint of that step was staged but maybe not committed yet. stagesave's
writer agent (the default ``writer="process"``, another process) finishes and commits it anyway,
so the next run resumes from that very step (from the agent's copy still in memory when it can).
With ``writer="thread"`` it dies with the trainer, is never seen, and the run resumes from the
one before and replays the lost steps. Either way the run ends with exactly the weights of a run
that never crashed (data order, dropout and optimizer state are all restored).
The last line prints the SHA-256 of the final weights so that runs can be compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from stagesave.lightning import StagedCheckpointIO, latest
from torch import nn

import stagesave
from stagesave import SaveTelemetry

DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"

# Lightning's own advice (dataloader workers, deprecations) would bury the story; stagesave's
# warnings (a skipped corrupt checkpoint, for one) stay visible.
warnings.filterwarnings("ignore", module=r"lightning\.")
warnings.filterwarnings("ignore", category=DeprecationWarning)

# ----------------------------------------------------------------------------- data


class TextWindows:
    """Random windows of the corpus, ``batches_per_epoch`` batches per epoch, resumable.

    Batch ``i`` of epoch ``e`` depends only on (seed, e, i), and Lightning saves and restores the
    position through ``state_dict``, so a resumed run sees exactly the batches it would have seen.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int, batch_size: int, batches_per_epoch: int, seed: int) -> None:
        self.ids, self.seq_len, self.batch_size = ids, seq_len, batch_size
        self.batches_per_epoch, self.seed = batches_per_epoch, seed
        self.epoch, self.pos = 0, 0

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.pos >= self.batches_per_epoch:
            self.epoch, self.pos = self.epoch + 1, 0
        while self.pos < self.batches_per_epoch:
            rng = np.random.default_rng([self.seed, self.epoch, self.pos])
            self.pos += 1
            starts = torch.from_numpy(rng.integers(0, len(self.ids) - self.seq_len - 1, self.batch_size))
            idx = starts[:, None] + torch.arange(self.seq_len + 1)
            window = self.ids[idx]
            yield window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


# ----------------------------------------------------------------------------- model


class CharLM(LightningModule):
    """A pre-norm, decoder-only transformer over characters, output head tied to the embedding."""

    def __init__(self, vocab: str, seq_len: int = 64, d_model: int = 96, n_layers: int = 2,
                 n_heads: int = 4, dropout: float = 0.1, lr: float = 3e-3, max_steps: int = 100) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(len(vocab), d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, len(vocab), bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)
        # Characters seen so far: a numpy array updated in place, as many users keep statistics.
        self.char_counts = np.zeros(len(vocab), dtype=np.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=x.device)
        h = self.blocks(self.tok(x) + self.pos[:n], mask=mask, is_causal=True)
        return self.head(self.ln(h))  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        np.add.at(self.char_counts, x.flatten().numpy(), 1)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.01)
        warmup, total = 10, max(self.hparams["max_steps"], 11)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning does not save RNG states; dropout needs them for an exact resume.
        checkpoint["rng"] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
        checkpoint["char_counts"] = self.char_counts

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        torch.set_rng_state(checkpoint["rng"]["torch"])
        np.random.set_state(checkpoint["rng"]["numpy"])
        self.char_counts = np.array(checkpoint["char_counts"])

    @torch.no_grad()
    def sample(self, prompt: str, n: int, seed: int = 0) -> str:
        vocab: str = self.hparams["vocab"]
        index = {c: i for i, c in enumerate(vocab)}
        ids = torch.tensor([[index.get(c, 0) for c in prompt]])
        g = torch.Generator().manual_seed(seed)
        self.eval()
        for _ in range(n):
            logits = self(ids[:, -self.hparams["seq_len"] :])[0, -1] / 0.8
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=g)[None]], dim=1)
        self.train()
        return "".join(vocab[i] for i in ids[0].tolist())


# ----------------------------------------------------------------------------- callbacks


class Progress(Callback):
    """One line every ``every`` steps: loss and what the last checkpoint save cost."""

    def __init__(self, every: int, saves: list[SaveTelemetry]) -> None:
        self.every, self.saves, self.t0 = every, saves, time.perf_counter()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        print(f"  starting at step {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step % self.every == 0:
            loss = float(trainer.callback_metrics.get("loss", float("nan")))
            done = f", {len(self.saves)} checkpoints committed" if self.saves else ""
            print(f"  step {step:4d}  loss {loss:.3f}  ({time.perf_counter() - self.t0:.1f} s{done})", flush=True)


class CrashAfter(Callback):
    """Simulates a crash: SIGKILL right after the checkpoint of step ``step`` was submitted."""

    def __init__(self, step: int, plugin: StagedCheckpointIO) -> None:
        self.step, self.plugin = step, plugin

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        # ModelCheckpoint runs last in each batch end, so here the step-N save was submitted.
        if trainer.global_step >= self.step:
            print(f"\n*** simulated crash: SIGKILL after step {trainer.global_step} with "
                  f"{self.plugin.pending()} checkpoint write(s) still in flight ***", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------- main


def weights_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def describe_directory(dirpath: str) -> None:
    """What a restart finds: committed checkpoints, and leftovers of an interrupted write."""
    found = stagesave.list_checkpoints(dirpath)
    if not found:
        print(f"  {dirpath}: no checkpoints")
    for c in found:
        # A listing reads each file's summary only; its proof (with the step) is read to verify it.
        checked = stagesave.verify(c.path) if c.valid else c
        step = checked.manifest.metadata.get("global_step") if checked.manifest else None
        print(f"  {checked.status:11s} {os.path.basename(c.path):28s} step {step}")
    if "://" not in dirpath and os.path.isdir(dirpath):
        for leftover in sorted(n for n in os.listdir(dirpath) if stagesave.is_temporary(n)):
            print(f"  {'torn':11s} {leftover}  (interrupted write: never committed, ignored)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=os.environ.get("STAGESAVE_DEMO_DIR", "runs/lightning-finetune"),
                   help="checkpoint directory: a local path or a URL such as s3://bucket/run")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--save-top-k", type=int, default=3)
    p.add_argument("--crash-after-step", type=int, default=None,
                   help="SIGKILL the process right after the checkpoint of this step was submitted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--sample", type=int, default=160, help="characters to generate at the end (0: none)")
    p.add_argument("--no-telemetry", action="store_true",
                   help="do not append save telemetry to stagesave-telemetry.jsonl in a local --dir")
    args = p.parse_args(argv)

    seed_everything(args.seed, workers=True, verbose=False)
    text = args.data.read_text(encoding="utf-8")
    vocab = "".join(sorted(set(text)))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    data = TextWindows(ids, args.seq_len, args.batch_size, batches_per_epoch=50, seed=args.seed)
    model = CharLM(vocab, args.seq_len, args.d_model, args.layers, lr=args.lr, max_steps=args.max_steps)

    saves: list[SaveTelemetry] = []
    # telemetry_jsonl=True: one JSON line per save in stagesave-telemetry.jsonl beside the
    # checkpoints (local directories only), which `stagesave report DIR` summarizes and draws.
    plugin = StagedCheckpointIO(telemetry_callback=saves.append, telemetry_jsonl=not args.no_telemetry)
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=args.dir, filename="{step:05d}", every_n_train_steps=args.every,
                        save_top_k=args.save_top_k, monitor="step", mode="max", save_last=True),
        Progress(max(1, args.every // 2), saves),
    ]
    if args.crash_after_step is not None:
        callbacks.append(CrashAfter(args.crash_after_step, plugin))
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=args.max_steps, plugins=[plugin], callbacks=callbacks,
        logger=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        default_root_dir=args.dir if "://" not in args.dir else None,
    )

    print(f"checkpoint directory {args.dir}:")
    describe_directory(args.dir)
    resume = latest(args.dir)  # newest valid checkpoint; torn or corrupt ones are skipped
    print("-> no valid checkpoint: training from scratch" if resume is None else f"-> resuming from {resume}")
    n_params = sum(t.numel() for t in model.parameters())
    print(f"training a {n_params / 1e6:.2f}M-parameter character transformer to step {args.max_steps}, "
          f"checkpoint every {args.every} steps")
    t0 = time.perf_counter()
    trainer.fit(model, data, ckpt_path=resume)
    wall = time.perf_counter() - t0

    if saves:
        blocking = sorted(s.blocking_s for s in saves)
        commit = sorted(s.time_to_commit_s for s in saves)
        print(f"{len(saves)} checkpoints of {saves[-1].bytes / 2**20:.1f} MiB: training waited "
              f"{1000 * blocking[len(blocking) // 2]:.1f} ms per save (median), the background "
              f"committed each in {1000 * commit[len(commit) // 2]:.0f} ms")
    if saves and not args.no_telemetry and "://" not in args.dir:
        print(f"telemetry of every save: stagesave report {args.dir}")
    if args.sample:
        print("sample:", repr(model.sample("The keeper ", args.sample, seed=args.seed)))
    result = {"start": resume, "final_step": trainer.global_step, "wall_s": round(wall, 2),
              "weights_sha256": weights_sha256(model)}
    print(f"result: {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
