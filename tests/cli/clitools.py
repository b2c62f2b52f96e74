"""Helpers of the CLI tests: real checkpoints written by the core, and an S3 adapter."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import stagesave
from stagesave.formats import Safetensors


@dataclass
class CliRun:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def small_state(step: int, width: int = 64) -> dict[str, Any]:
    """A real little training state: model, Adam state, step, numpy RNG state."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,
        "rng": np.random.RandomState(step).get_state(),
    }


def write_checkpoints(root: os.PathLike[str] | str, steps: tuple[int, ...] = (10, 20, 30), **options: Any) -> list[str]:
    """Committed stagesave checkpoints ``step=<n>.ckpt`` in ``root``, oldest first; their paths."""
    paths = []
    with stagesave.Checkpointer(root, **options) as ck:
        for step in steps:
            ck.save(small_state(step), f"step={step}.ckpt", metadata={"step": step}).result()
            paths.append(os.path.join(str(root), f"step={step}.ckpt"))
    return paths


def write_dir_checkpoint(root: os.PathLike[str] | str, name: str = "checkpoint_3", step: int = 3, **options: Any) -> str:
    """An Accelerate-layout folder committed by stagesave (model.safetensors, optimizer.bin, ...)."""
    state = small_state(step)
    with stagesave.Checkpointer(root, **options) as ck:
        ck.save_dir(
            {
                "model.safetensors": Safetensors({k: v.contiguous() for k, v in state["model"].items()}),
                "optimizer.bin": state["optimizer"],
                "random_states_0.pkl": {"step": step, "numpy_random_seed": state["rng"]},
            },
            name,
            metadata={"step": step},
        ).result()
    return os.path.join(str(root), name)


def flip_byte(path: str, offset: int) -> None:
    """Corrupt one byte of a file in place (a real bit rot, not a mock)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


_CRASH_CHILD = textwrap.dedent(
    """
    import sys, torch, stagesave
    root, name = sys.argv[1], sys.argv[2]
    with stagesave.Checkpointer(root, chunk_bytes=1 << 20) as ck:
        ck.save({"w": torch.arange(600_000, dtype=torch.float32)}, name).result()
    """
)


def crash_save(root: os.PathLike[str] | str, name: str, point: str) -> subprocess.CompletedProcess[str]:
    """A real child process saves ``name`` and SIGKILLs itself at crash point ``point``."""
    env = {**os.environ, "STAGESAVE_CRASH_AT": point}
    return subprocess.run([sys.executable, "-c", _CRASH_CHILD, str(root), name], env=env,
                          capture_output=True, text=True, timeout=120)


def s3_options(server: Any, test_name: str) -> tuple[str, list[str], dict[str, Any]]:
    """``(url prefix, CLI options, storage_options)`` from the shared S3 fixture object."""
    storage: dict[str, Any] = dict(getattr(server, "storage_options", None) or {})
    endpoint = getattr(server, "endpoint_url", None) or getattr(server, "endpoint", None)
    if endpoint is None:
        endpoint = storage.get("endpoint_url") or storage.get("client_kwargs", {}).get("endpoint_url")
    if endpoint is not None:
        storage.setdefault("endpoint_url", endpoint)
    bucket = getattr(server, "bucket", None) or "stagesave-test"
    base = getattr(server, "url", None) or f"s3://{bucket}"
    prefix = f"{str(base).rstrip('/')}/cli-{re.sub(r'[^A-Za-z0-9]+', '-', test_name)[:60]}-{os.getpid()}"
    opts: list[str] = []
    for k, v in storage.items():
        if k == "endpoint_url":
            opts += ["--endpoint-url", str(v)]
        else:
            opts += ["-o", f"{k}={json.dumps(v)}"]
    return prefix, opts, storage
