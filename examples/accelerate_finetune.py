"""Fine-tune a small GPT-style language model with Accelerate and asynchronous stagesave checkpoints.

Everything is local: the model is built here (a character-level decoder-only transformer with
tied embeddings), the corpus is generated here, nothing is downloaded. The loop is a plain
Accelerate loop; the only stagesave line is ``stagesave.accelerate.enable(accelerator, ...)``.
Each save's telemetry goes to ``<output>/stagesave-telemetry.jsonl`` (``--no-telemetry`` turns it
off): ``stagesave report <output>`` draws the run's timeline.

Run it, crash it, run it again::

    # 1 CPU process; SIGKILL itself right after the save_state() of step 30 returned
    accelerate launch --cpu --num_processes 1 examples/accelerate_finetune.py --crash-after-step 30
    # the same command without --crash-after-step resumes from the newest valid checkpoint
    accelerate launch --cpu --num_processes 1 examples/accelerate_finetune.py

    # 2 CPU processes (gloo): --multi_gpu makes accelerate start torchrun, even without GPUs
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_finetune.py --crash-after-step 30

At the kill, the checkpoint of that step was staged but maybe not committed yet. stagesave's
writer agent (the default ``writer="process"``, another process) finishes and commits it anyway,
and the next run resumes from that very step; with ``writer="thread"`` it dies with the trainer,
never appears, and the next run resumes from the one before and replays the lost steps. Every
folder under ``<output>/checkpoints`` is complete and verified, and the run ends with exactly
the weights of a run that never crashed: the last line prints their SHA-256 so you can compare.

The ``save_state()`` calls inside the loop return once the state is staged; the run ends with
``accelerator.end_training()``, which commits what is still pending and gives stagesave's threads
and buffers back before Accelerate destroys the process group. The script then leaves through
normal interpreter shutdown, with one or several processes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any

import stagesave.accelerate
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader, Dataset

# ----------------------------------------------------------------------------- data

_SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "a small bird", "the old man", "our team"]
_VERBS = ["sees", "likes", "follows", "builds", "paints", "finds", "carries"]
_OBJECTS = ["a red ball", "the river", "two apples", "a wooden boat", "the green door", "some bread"]
_ENDINGS = [" today.", " again.", " at night.", " in the park.", " slowly.", "."]


def make_corpus(n_sentences: int, seed: int) -> str:
    """A reproducible toy corpus: simple sentences from fixed word lists."""
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
        for _ in range(n_sentences)
    )


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Next-character prediction windows over the corpus."""

    def __init__(self, text: str, vocab: str, seq_len: int) -> None:
        index = {c: i for i, c in enumerate(vocab)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = i * self.seq_len
        return self.ids[lo : lo + self.seq_len], self.ids[lo + 1 : lo + self.seq_len + 1]


# ----------------------------------------------------------------------------- model


@dataclass
class GPTConfig:
    vocab_size: int
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.1


class TinyGPT(nn.Module):
    """A pre-norm, decoder-only transformer over characters; the output head is tied to the
    token embedding (the same model family as examples/lightning_finetune.py)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, 4 * cfg.d_model, cfg.dropout,
                                           batch_first=True, norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        h = self.blocks(self.tok(ids) + self.pos[:n], mask=mask, is_causal=True)
        return self.head(self.ln(h))  # type: ignore[no-any-return]


class Progress:
    """Where the loop is; registered for checkpointing (saved as ``custom_checkpoint_0.pkl``)."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])


def warmup_cosine(warmup: int, total: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def weights_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="runs/accelerate_finetune", help="project_dir (checkpoints/ goes inside)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in total")
    p.add_argument("--save-every", type=int, default=10, help="save_state() every N steps")
    p.add_argument("--total-limit", type=int, default=3, help="checkpoints kept (ProjectConfiguration.total_limit)")
    p.add_argument("--crash-after-step", type=int, default=None,
                   help="SIGKILL every process right after this step's save_state() returned")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-telemetry", action="store_true",
                   help="do not record <output>/stagesave-telemetry.jsonl (read by `stagesave report <output>`)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        project_config=ProjectConfiguration(
            project_dir=args.output, automatic_checkpoint_naming=True, total_limit=args.total_limit
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    stagesave.accelerate.enable(accelerator, telemetry_jsonl=not args.no_telemetry)  # the one stagesave line
    set_seed(args.seed)

    text = make_corpus(3000, seed=1234)
    vocab = "".join(sorted(set(text)))
    cfg = GPTConfig(vocab_size=len(vocab))
    data = CharWindows(text, vocab, cfg.seq_len)
    # The loader draws its seeds from its own generator, not from the global RNG that dropout uses:
    # otherwise starting a fresh iterator after a resume would shift every dropout mask after it.
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed))
    model = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(5, args.steps))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    checkpoints = os.path.join(args.output, "checkpoints")
    if os.path.isdir(checkpoints) and any(not n.startswith(".") for n in os.listdir(checkpoints)):
        accelerator.load_state()  # the newest *valid* checkpoint; iteration continues after it
        accelerator.print(
            f"resumed at step {progress.step} (next checkpoint: checkpoint_"
            f"{accelerator.project_configuration.iteration})"
        )

    per_epoch = len(loader)
    loss_value = float("nan")
    while progress.step < args.steps:
        epoch, done_in_epoch = divmod(progress.step, per_epoch)
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done_in_epoch) if done_in_epoch else loader
        for ids, targets in batches:
            model.train()
            logits = model(ids)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            progress.tokens_seen += ids.numel() * accelerator.num_processes
            loss_value = loss.item()
            if progress.step % args.save_every == 0:
                t0 = time.perf_counter()
                where = accelerator.save_state()  # returns once staged; writes in the background
                blocked = time.perf_counter() - t0
                accelerator.print(f"step {progress.step:4d}  loss {loss_value:.4f}  save_state -> {where} "
                                  f"(blocked {blocked * 1e3:.1f} ms)")
            if args.crash_after_step is not None and progress.step == args.crash_after_step:
                accelerator.print(f"simulated crash: SIGKILL after step {progress.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if progress.step >= args.steps:
                break

    # Every checkpoint committed (a failed background save raises here), stagesave's threads and
    # buffers given back, then Accelerate's own end: trackers finished, process group destroyed.
    accelerator.end_training()
    digest = weights_sha256(accelerator.unwrap_model(model))
    if accelerator.is_main_process:
        result = {"step": progress.step, "loss": loss_value, "weights_sha256": digest,
                  "processes": accelerator.num_processes}
        with open(os.path.join(args.output, "result.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(f"done: step {progress.step} loss {loss_value:.4f} weights sha256 {digest}")
        if not args.no_telemetry:
            print(f"timeline of the saves: stagesave report {args.output}")


if __name__ == "__main__":
    main()
