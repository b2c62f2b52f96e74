"""Assertions shared by the core tests: deep, bitwise equality of loaded states."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Same structure, same types, bitwise-equal tensors and arrays."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        assert a.stride() == b.stride(), f"{path}: stride {a.stride()} != {b.stride()}"
        assert a.device == b.device, f"{path}: device {a.device} != {b.device}"
        if a.numel():
            av = torch.empty(a.shape, dtype=a.dtype).copy_(a.detach()).reshape(-1).view(torch.uint8)
            bv = torch.empty(b.shape, dtype=b.dtype).copy_(b.detach()).reshape(-1).view(torch.uint8)
            assert torch.equal(av, bv), f"{path}: tensor bytes differ"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: numpy dtype/shape differ"
        assert a.tobytes() == b.tobytes(), f"{path}: numpy bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length differs"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, float) and a != a:  # noqa: PLR0124 - the NaN test
        assert b != b, f"{path}: NaN expected"  # noqa: PLR0124 - the NaN test
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


from proofkit import format1_checkpoint, rewrite_proof  # noqa: E402, F401, RUF100 - shared with other suites
