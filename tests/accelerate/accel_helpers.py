"""Small real training set-ups for the Accelerate adapter tests, and exact state comparisons."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

if TYPE_CHECKING:
    from typing_extensions import Self

#: The key of ``__metadata__`` where a safetensors file written by stagesave carries its proof.
PROOF_KEY = "stagesave.proof"


class TinyNet(torch.nn.Module):
    """Two layers with a tied pair (shared storage), like an LM's embedding and head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, width, bias=False)
        self.out.weight = self.inp.weight  # tied
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.out(torch.relu(self.inp(x)))))


class Counter:
    """A custom checkpointed object (``register_for_checkpointing``): a tensor and an int."""

    def __init__(self) -> None:
        self.count = 0
        self.history = torch.zeros(4)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "history": self.history.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.history = state["history"].clone()


def build(accelerator: Any, *, width: int = 16, n_models: int = 1, seed: int = 0) -> dict[str, Any]:
    """Prepared models, AdamW optimizers, StepLR schedulers, a shuffling dataloader, 2 counters."""
    torch.manual_seed(seed)
    models = [TinyNet(width) for _ in range(n_models)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    data = TensorDataset(torch.randn(64, width), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    prepared = accelerator.prepare(*models, *opts, *scheds, loader)
    models = list(prepared[:n_models])
    opts = list(prepared[n_models : 2 * n_models])
    scheds = list(prepared[2 * n_models : 3 * n_models])
    counters = [Counter(), Counter()]
    accelerator.register_for_checkpointing(*counters)
    return {
        "models": models,
        "opts": opts,
        "scheds": scheds,
        "loader": prepared[-1],
        "counters": counters,
    }


def train(accelerator: Any, run: dict[str, Any], steps: int) -> None:
    """``steps`` optimizer steps; also consumes Python, numpy and torch RNG like real loops do."""
    it = iter(run["loader"])
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(run["loader"])
            x, y = next(it)
        x = x + 0.01 * torch.randn_like(x) + random.random() + float(np.random.rand())
        loss = sum(torch.nn.functional.mse_loss(m(x), y) for m in run["models"])
        accelerator.backward(loss)
        for o, s in zip(run["opts"], run["scheds"], strict=False):
            o.step()
            s.step()
            o.zero_grad()
        for c in run["counters"]:
            c.count += 1
            # the same on every process, as Accelerate expects
            c.history = c.history * 0.5 + float(c.count)


def snapshot(accelerator: Any, run: dict[str, Any]) -> dict[str, Any]:
    """Deep copies of everything a checkpoint must restore."""
    return clone(
        {
            "models": [m.state_dict() for m in run["models"]],
            "opts": [o.state_dict() for o in run["opts"]],
            "scheds": [s.state_dict() for s in run["scheds"]],
            "counters": [c.state_dict() for c in run["counters"]],
            "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
            "torch_rng": torch.get_rng_state(),
            "step": accelerator.step,
        }
    )


def clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, Mapping):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    return obj


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Bitwise equality of nested states (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a.cpu(), b.cpu()), f"{where}: tensor values differ"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, f"{where}: ndarray mismatch"
        assert np.array_equal(a, b), f"{where}: array values differ"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping), f"{where}: mapping vs {type(b).__name__}"
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: sequence mismatch"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def load_file_content(path: str) -> Any:
    """What a file of an Accelerate folder holds (safetensors: tensors + metadata, without the
    stagesave proof, the one key stagesave adds; every other key must be Accelerate's)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        meta = safetensors_metadata(path)
        meta.pop(PROOF_KEY, None)
        return {"tensors": load_file(path), "metadata": meta}
    return torch.load(path, weights_only=False)


def safetensors_metadata(path: str) -> dict[str, str]:
    """A safetensors file's ``__metadata__``, as the safetensors library reads it."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return dict(f.metadata() or {})


def tree(folder: str) -> list[str]:
    """Every file and folder under ``folder`` (hidden ones included), relative, folders with a
    trailing ``/``."""
    out = []
    for top, dirs, names in os.walk(folder):
        rel = os.path.relpath(top, folder)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        out += [f"{prefix}{d}/" for d in dirs] + [f"{prefix}{n}" for n in names]
    return sorted(out)


def assert_real_zips(folder: str) -> list[str]:
    """Every torch file under ``folder`` is a zip whose records all carry their real CRC-32
    (``zipfile.ZipFile.testzip() is None``); returns the torch files checked (relative).

    Torch files are the non-safetensors files of an Accelerate folder: ``*.bin``, ``*.pkl``,
    ``*.pt`` (and DCP's are not zips at all: ``*.distcp`` and ``.metadata`` are skipped)."""
    import zipfile

    checked = []
    for rel in tree(folder):
        if rel.endswith("/") or not rel.endswith((".bin", ".pkl", ".pt")):
            continue
        path = os.path.join(folder, rel)
        assert zipfile.is_zipfile(path), f"{rel} is not a zip file"
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None, f"{rel}: a record fails its CRC-32"
        checked.append(rel)
    return checked


def visible(folder: str) -> list[str]:
    """Entries of a folder as Accelerate's own listing sees them, minus stagesave's hidden
    temporaries."""
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


class ListingWatcher:
    """Lists a folder over and over from a thread (as Accelerate's ``total_limit`` pass and its
    automatic ``load_state`` would), recording every name it ever saw there."""

    def __init__(self, folder: Any) -> None:
        import threading

        self.folder = folder
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                self.seen.update(os.listdir(self.folder))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
