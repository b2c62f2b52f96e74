"""Small helpers shared by the fault tests: states, debris checks, the checkpoint a root offers."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

import stagesave
from stagesave.formats import Safetensors

__all__ = [
    "blocked_on_a_lock",
    "debris",
    "dir_state",
    "file_state",
    "latest_name",
    "lock_waiters",
    "tree",
]


def file_state(step: int, n: int = 4000) -> dict[str, Any]:
    return {"step": step, "w": torch.arange(n, dtype=torch.float32) + step}


def dir_state(step: int) -> dict[str, Any]:
    return {
        "model.safetensors": Safetensors({"w": torch.full((2500,), float(step))}),
        "optimizer.bin": {"step": step, "m": torch.arange(1500, dtype=torch.float64) * step},
    }


def tree(root: str | os.PathLike[str]) -> list[str]:
    """Every path under ``root`` (files, folders, links), relative, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for n in dirnames + filenames:
            out.append(os.path.normpath(os.path.join(rel, n)))
    return sorted(out)


def debris(root: str | os.PathLike[str]) -> list[str]:
    """Temporaries and folders moved aside left under ``root``."""
    return [p for p in tree(root) if ".stagesave-tmp" in p or ".stagesave-aside" in p]


def latest_name(root: str | os.PathLike[str]) -> tuple[str | None, Any]:
    """``(name, step)`` of what ``latest(verify=True)`` offers, loaded with verification."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with stagesave.Checkpointer(root) as ck:
            info = ck.latest(verify=True)
            if info is None:
                return None, None
            assert info.status == "verified", (info.name, info.status, info.problems)
            if info.is_dir:
                return info.name, ck.load(os.path.join(info.path, "optimizer.bin"))["step"]
            return info.name, ck.load(info.path)["step"]


def lock_waiters(pid: int) -> int:
    """How many waits for a file lock threads of ``pid`` are in (``->`` lines of /proc/locks)."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    n = 0
    for line in lines:
        fields = line.split()
        if "->" in fields:
            rest = fields[fields.index("->") + 1 :]
            if len(rest) > 3 and rest[3] == str(pid):
                n += 1
    return n


def blocked_on_a_lock(pid: int) -> bool:
    """Whether a thread of ``pid`` waits for a file lock."""
    return lock_waiters(pid) > 0
