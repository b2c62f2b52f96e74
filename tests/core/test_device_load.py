"""A load onto a device (issue 22): each chunk read into a slot of a small ring, checked there,
and copied into each storage's device memory while the next chunks are read
(``stagesave.restore.device_load``).

On this machine the ring runs with the CPU as its device (unpinned slots, synchronous copies):
the same reads, checks, slot reuse and copies of storages that span chunks, against real files.
The CUDA runs (pinned slots, a side stream, events) are the ``gpu`` tests at the end.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import pytest
import torch

import stagesave
from stagesave.restore import device_load, load
from stagesave.restore.verified_memo import forget_verified
from stagesave.safety import safe_torch_load
from stagesave.stores.local import LocalStore

CHUNK = 64 << 10  # small chunks: storages span them, and the ring's slots are reused


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(300, 200, generator=g)  # 234 KiB: spans four chunks
    return {
        "base": base,
        "view": base[10:, 5:].t(),  # shares base's storage
        "small": {f"m{i}": torch.randn(1 + i % 50, generator=g) for i in range(400)},
        "ints": torch.arange(7, dtype=torch.int16),
        "half": torch.randn(33, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0),
        "param": torch.nn.Parameter(torch.ones(3)),
        "grad": torch.ones(2, requires_grad=True),
        "step": 5,
    }


def _same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
        assert a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
        assert a.requires_grad == b.requires_grad and a.device == b.device
        assert torch.equal(a.detach(), b.detach())
    else:
        assert a == b


def _saved(tmp_path: Any) -> tuple[str, Any]:
    path = str(tmp_path / "d.ckpt")
    with stagesave.Checkpointer(writer="thread", chunk_bytes=CHUNK) as ck:
        ck.save(_state(), path).result()
        return path, ck.verify(path).manifest


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("check", [True, False])
def test_the_ring_brings_every_storage_whole_to_its_device(tmp_path, workers, check):
    path, manifest = _saved(tmp_path)
    assert len(manifest.files[0].chunks) > 8  # many chunks through a ring of few slots
    store = LocalStore(str(tmp_path))
    with store.open("d.ckpt") as reader, cf.ThreadPoolExecutor(workers) as pool:
        image, problems = device_load.read_to_device(
            reader, reader.fileno(), manifest, pool, "d.ckpt", torch.device("cpu"),
            check=check, workers=workers)
    assert problems == []
    assert image.memory is not None
    assert set(image.memory) == {s.key for s in manifest.files[0].storages}
    got = safe_torch_load(image, where="d.ckpt")
    _same(torch.load(path, weights_only=True), got)
    # the storages are the device memory the ring filled, shared as in the file
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    held = {t.data_ptr() for t in image.memory.values() if t.numel()}
    assert got["base"].untyped_storage().data_ptr() in held


def test_a_damaged_chunk_is_reported_and_never_copied(tmp_path, monkeypatch):
    path, manifest = _saved(tmp_path)
    entry = manifest.files[0]
    victim = max(entry.storages, key=lambda r: r.nbytes)  # base's storage
    at = victim.offset + CHUNK  # a byte in the storage's second chunk
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    copied: list[tuple[int, int]] = []
    real = device_load._Copier.copy

    def seen(self: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        copied.append((dst.data_ptr(), dst.numel()))
        real(self, dst, src)

    monkeypatch.setattr(device_load._Copier, "copy", seen)
    store = LocalStore(str(tmp_path))
    with store.open("d.ckpt") as reader, cf.ThreadPoolExecutor(2) as pool:
        image, problems = device_load.read_to_device(
            reader, reader.fileno(), manifest, pool, "d.ckpt", torch.device("cpu"), workers=2)
    lo = at // CHUNK * CHUNK
    assert problems == [
        f"d.ckpt: checksum mismatch in bytes [{lo}, {lo + CHUNK}) (chunk {lo // CHUNK})"]
    assert image.memory is not None
    where = image.memory[victim.key].data_ptr() + (at - victim.offset)
    assert copied and not any(p <= where < p + n for p, n in copied)
    # the load refuses the file in the words of any verified load
    with stagesave.Checkpointer(writer="thread") as ck, pytest.raises(
            stagesave.IntegrityError, match=r"checksum mismatch in bytes"):
        ck.load(path)


def test_only_one_cuda_device_takes_the_ring():
    for where in (None, "cpu", torch.device("cpu"), {"cuda:0": "cpu"}, lambda s, loc: s,
                  "not a device"):
        assert device_load.target_device(where) is None
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else None
    assert device_load.target_device("cuda:0") == expected


# ---------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
def test_a_load_onto_a_gpu_goes_through_pinned_slots(tmp_path, monkeypatch):
    path, _ = _saved(tmp_path)
    used: list[torch.device] = []
    real = device_load.read_to_device

    def counted(*args: Any, **kwargs: Any) -> Any:
        used.append(args[5])
        return real(*args, **kwargs)

    monkeypatch.setattr(device_load, "read_to_device", counted)
    forget_verified()  # else the load follows _saved's verification of the same file
    with stagesave.Checkpointer(writer="thread") as ck:
        got = ck.load(path, map_location="cuda")
        plain = ck.load(path, verify=False, map_location="cuda:0")
    assert used == [torch.device("cuda", 0)] * 2
    expected = torch.load(path, weights_only=True, map_location="cuda")
    _same(expected, got)
    _same(expected, plain)
    assert got["base"].is_cuda and got["small"]["m3"].is_cuda
    assert load.device_load is device_load


@pytest.mark.gpu
def test_the_pinned_ring_survives_a_state_larger_than_itself(tmp_path, monkeypatch):
    """More chunks than slots, slots reused only after their copies are done (events): a
    2 GiB-class pattern scaled down to a ring of two 64 KiB slots."""
    monkeypatch.setattr(device_load, "RING_BYTES", 2 * CHUNK)
    state = {f"w{i}": torch.randn(257, 129) for i in range(64)}  # ~8 MiB, 130 chunks
    path = str(tmp_path / "big.ckpt")
    with stagesave.Checkpointer(writer="thread", chunk_bytes=CHUNK) as ck:
        ck.save(state, path).result()
        forget_verified()
        got = ck.load(path, map_location="cuda")
    for k, v in state.items():
        assert got[k].is_cuda and torch.equal(got[k].cpu(), v)
