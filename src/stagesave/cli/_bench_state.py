"""What ``stagesave bench`` saves and what it trains meanwhile: a synthetic transformer-like
training state (fp32 weights and two Adam moments per parameter, by layer) and a small CPU
training loop whose slowdown while a write runs is the training time a save costs beyond its
blocking time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ._units import fmt_bytes

__all__ = ["TrainLoop", "state_bytes", "state_tensors", "synthetic_state"]


def synthetic_state(size_bytes: float, *, seed: int = 0) -> dict[str, Any]:
    """A training state of about ``size_bytes``: fp32 weights and Adam moments by layer."""
    if size_bytes < 1e5:
        raise ValueError(
            f"the benchmark state must be at least 100 kB, got {fmt_bytes(size_bytes)}"
        )
    # A layer holds ~12 h^2 parameters, each with weight + 2 moments in fp32 (144 h^2 bytes):
    # pick the widest power of two that still gives at least 4 layers.
    hidden = 16
    while hidden < 2048 and 144 * (2 * hidden) ** 2 * 4 <= size_bytes:
        hidden *= 2
    shapes = {
        "attn.qkv.weight": (3 * hidden, hidden), "attn.out.weight": (hidden, hidden),
        "mlp.up.weight": (4 * hidden, hidden), "mlp.down.weight": (hidden, 4 * hidden),
        "norm1.weight": (hidden,), "norm2.weight": (hidden,),
    }
    per_layer = (
        3 * 4 * sum(torch.Size(s).numel() for s in shapes.values())
    )  # weights + 2 moments, fp32
    layers = max(1, round(size_bytes / per_layer))
    g = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    opt_state: dict[int, dict[str, Any]] = {}
    for layer in range(layers):
        for name, shape in shapes.items():
            i = len(model)
            model[f"layers.{layer}.{name}"] = torch.randn(shape, generator=g)
            opt_state[i] = {
                "step": torch.tensor(100.0),
                "exp_avg": torch.randn(shape, generator=g) * 1e-3,
                "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6,
            }
    return {
        "model": model,
        "optimizer": {
            "state": opt_state,
            "param_groups": [{"lr": 1e-4, "params": list(opt_state)}],
        },
        "step": 100,
    }



class TrainLoop:
    """A small CPU training step (MLP forward, backward, SGD) on torch's default threads."""

    def __init__(self, hidden: int = 512, batch: int = 128) -> None:
        g = torch.Generator().manual_seed(0)
        self.weights = [
            torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden**0.5)
            for _ in range(3)
        ]
        self.opt = torch.optim.SGD(self.weights, lr=1e-4)
        self.x = torch.randn(batch, hidden, generator=g)

    def step(self) -> float:
        """One step; its seconds."""
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        h = self.x
        for w in self.weights:
            h = torch.nn.functional.gelu(h @ w)
        torch.autograd.backward(h.square().mean())
        self.opt.step()
        return time.perf_counter() - t0

    def baseline(self, seconds: float = 0.5) -> float:
        """Median step time over ``seconds`` of steps with nothing else running."""
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 3:
            times.append(self.step())
        return statistics.median(times)




def state_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a :func:`synthetic_state`: weights, then the optimizer's moments."""
    tensors: list[torch.Tensor] = list(state["model"].values())
    for s in state["optimizer"]["state"].values():
        tensors += list(s.values())
    return tensors


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of tensor data in a :func:`synthetic_state`."""
    return sum(int(t.numel()) * int(t.element_size()) for t in state_tensors(state))
