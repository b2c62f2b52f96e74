"""Shared by the sharded-checkpoint tests: the model, bitwise comparison, reading a folder."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from stagesave import LocalStore
from stagesave.ondisk.manifest import Manifest
from stagesave.restore.proof import FileProof, read_proof

#: A small MLP whose first dimensions (48, 40, 10) shard unevenly over 4 ranks and over 2.
SIZES = (32, 48, 40, 10)


def build_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.ReLU(), nn.Linear(SIZES[1], SIZES[2]),
                         nn.ReLU(), nn.Linear(SIZES[2], SIZES[3]))


def train(model: nn.Module, opt: torch.optim.Optimizer, seed: int, steps: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, SIZES[0], generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def replicated_state() -> dict[str, Any]:
    """DDP-style state, identical on every rank: one large tensor and a few small ones."""
    g = torch.Generator().manual_seed(7)
    return {
        "emb": torch.randn(256, 1024, generator=g),  # 1 MiB
        "blocks": {f"w{i}": torch.randn(64, 64, generator=g) for i in range(4)},
        "bias": torch.randn(10, generator=g),
        "epoch": 3,
    }


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Same structure and values; tensors equal bit for bit (dtype and shape included)."""
    if isinstance(a, dict) and isinstance(b, dict):  # an OrderedDict state dict equals a dict one
        pass
    else:
        assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        if a.numel():
            av = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            bv = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(av, bv), f"{path}: tensor bytes differ"
    elif isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), (
            f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        )
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length differs"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def proof(path: str | os.PathLike[str]) -> FileProof:
    """The proof embedded in one file of a folder (read and checked by stagesave's reader)."""
    folder, leaf = os.path.split(os.fspath(path))
    with LocalStore(folder).open(leaf) as reader:
        return read_proof(reader, leaf)


def folder_proof(folder: str | os.PathLike[str]) -> Manifest:
    """The carrier's manifest of a committed sharded folder: ``.metadata``'s proof."""
    got = proof(os.path.join(os.fspath(folder), ".metadata"))
    assert got.manifest is not None and got.manifest.folder is not None, got.problems
    return got.manifest


def rank_file_sizes(folder: str) -> dict[int, int]:
    """Size of each rank's data bytes (before its proof), by rank, from the files' own proofs."""
    out = {}
    for member in folder_proof(folder).folder.members:  # type: ignore[union-attr]
        if member.name.endswith(".distcp"):
            out[int(member.name[2:].split("_")[0])] = (  # type: ignore[union-attr]
                proof(os.path.join(folder, member.name)).manifest.files[0].end
            )
    return out
