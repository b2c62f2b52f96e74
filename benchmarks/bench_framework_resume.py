"""A resume through the frameworks: from the call to training restarted, stagesave beside their IO.

Usage::

    python benchmarks/bench_framework_resume.py --dir /work --layers 8 --rounds 3

One model (``--layers`` linear layers of ``--width`` x ``--width`` fp32 parameters, trained with
Adam: the checkpoint holds about 3x the parameter bytes) is trained for two steps and saved, once
per variant, in its own folder:

- ``lightning TorchCheckpointIO``: a ``Trainer`` with ``ModelCheckpoint(save_last=True)``;
- ``lightning StagedCheckpointIO``: the same with ``plugins=[StagedCheckpointIO()]``;
- ``accelerate``: ``Accelerator.save_state()`` under automatic checkpoint naming;
- ``accelerate + stagesave``: the same after ``stagesave.accelerate.enable(accelerator)``.

Then, in rounds (rotating order), each variant resumes in a fresh process, after the page cache
was dropped (root only; otherwise the figures are warm and say so): the model, the ``Trainer``
or ``Accelerator`` are built and torch, Lightning and Accelerate imported before the clock
starts; it stops when the first training step after the resume begins
(``trainer.fit(model, ckpt_path="last")`` to ``on_train_batch_start``; ``accelerator.load_state()``
to the step after it). Each resumed model is checked equal to the saved one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402, RUF100 - after the sys.path insertion

VARIANTS = ("lightning TorchCheckpointIO", "lightning StagedCheckpointIO", "accelerate",
            "accelerate + stagesave")


def _model(width: int, layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _checksum(model: Any) -> float:
    return float(sum(float(p.double().sum()) for p in model.parameters()))


def _lightning(folder: str, width: int, layers: int, staged: bool, resume: bool) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = _model(width, layers)

        def training_step(self, batch: Any, _: int) -> Any:
            return self.body(batch).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return DataLoader(torch.randn(64, width), batch_size=8)  # type: ignore[arg-type]

    marks: dict[str, float] = {}

    class Mark(Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, *_: Any) -> None:
            if "first" not in marks:
                marks["first"] = time.perf_counter()
                marks["sum"] = _checksum(module.body)
                trainer.should_stop = True

    plugins: list[Any] = []
    if staged:
        from stagesave.lightning import StagedCheckpointIO

        plugins.append(StagedCheckpointIO())
    net = Net()
    trainer = pl.Trainer(
        max_steps=3 if resume else 2, plugins=plugins, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1,
        # a resume saves nothing (the next round resumes from the same step); its ModelCheckpoint
        # is there for ckpt_path="last" to find last.ckpt
        callbacks=[ModelCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=2)
                   if not resume else ModelCheckpoint(dirpath=folder, save_top_k=0),
                   *([Mark()] if resume else [])],
    )
    if not resume:
        trainer.fit(net)
        return {"sum": _checksum(net.body)}
    t0 = time.perf_counter()
    trainer.fit(net, ckpt_path="last")
    return {"seconds": marks["first"] - t0, "sum": marks["sum"]}


def _accelerate(folder: str, width: int, layers: int, staged: bool,
                resume: bool) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=folder, automatic_checkpoint_naming=True))
    model = _model(width, layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    if staged:
        import stagesave.accelerate

        stagesave.accelerate.enable(acc)

    def step() -> None:
        acc.backward(model(torch.randn(8, width)).pow(2).mean())
        opt.step()
        opt.zero_grad()

    if not resume:
        step()
        step()
        acc.save_state()
        acc.end_training()
        return {"sum": _checksum(model)}
    t0 = time.perf_counter()
    acc.load_state()
    seconds = time.perf_counter() - t0
    got = _checksum(model)
    step()
    acc.end_training()
    return {"seconds": seconds, "sum": got}


def child(args: argparse.Namespace) -> None:
    staged = args.variant.endswith(("StagedCheckpointIO", "stagesave"))
    run = _lightning if args.variant.startswith("lightning") else _accelerate
    out = run(args.folder, args.width, args.layers, staged, args.phase == "resume")
    print("RESULT " + json.dumps(out), flush=True)


def _spawn(variant: str, folder: str, args: argparse.Namespace, phase: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--folder", folder,
           "--phase", phase, "--width", str(args.width), "--layers", str(args.layers)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    raise RuntimeError(f"{variant} {phase} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _size(variant: str, folder: str) -> int:
    """Bytes of what the resume reads: Lightning's ``last.ckpt``, Accelerate's folder."""
    if variant.startswith("lightning"):
        return os.path.getsize(os.path.join(folder, "last.ckpt"))
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    root = tempfile.mkdtemp(prefix="stagesave-resume-", dir=args.dir)
    try:
        folders = {v: os.path.join(root, f"v{i}") for i, v in enumerate(variants)}
        saved = {v: _spawn(v, folders[v], args, "save")["sum"] for v in variants}
        sizes = {v: _size(v, folders[v]) for v in variants}
        results: dict[str, list[float]] = {v: [] for v in variants}
        cold = True
        for r in range(args.rounds):
            for v in variants[r % len(variants):] + variants[: r % len(variants)]:
                cold = common.drop_caches() and cold
                got = _spawn(v, folders[v], args, "resume")
                if abs(got["sum"] - saved[v]) > 1e-6 * max(1.0, abs(saved[v])):
                    raise AssertionError(f"{v} resumed other weights: {got['sum']} != {saved[v]}")
                results[v].append(got["seconds"])
                print(f"round {r} {v}: {got['seconds']:.2f} s", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = args.width * (args.width + 1) * args.layers * 4
    print(f"\n{args.layers} x Linear({args.width}, {args.width}) with Adam: "
          f"{params / 2**30:.2f} GiB of parameters; page cache "
          f"{'dropped before each resume' if cold else 'NOT dropped (not root): warm figures'}; "
          f"medians (min–max) of {args.rounds}\n")
    print("| resume | checkpoint read | call → training restarted, s | × the framework's own |")
    print("|---|---|---|---|")
    for v in variants:
        xs = results[v]
        base = "lightning TorchCheckpointIO" if v.startswith("lightning") else "accelerate"
        ratio = (f"{statistics.median(xs) / statistics.median(results[base]):.2f}"
                 if base in results else "")
        print(f"| {v} | {sizes[v] / 2**30:.2f} GiB | {statistics.median(xs):.2f} "
              f"({min(xs):.2f}–{max(xs):.2f}) | {ratio} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "cold": cold, "sizes": sizes, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
