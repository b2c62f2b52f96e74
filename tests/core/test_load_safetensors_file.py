"""``Checkpointer.load`` of a safetensors file: what ``safetensors.torch.load_file`` returns,
checked against the file's proof where it has one; never called damaged when it is intact."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import stagesave
from stagesave.errors import IntegrityError, UsageError
from stagesave.formats import Safetensors


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(64, 33),
        "b": torch.arange(7, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4, dtype=torch.int16),
    }


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k, want in b.items():
        assert a[k].dtype == want.dtype and a[k].shape == want.shape, k
        assert torch.equal(a[k], want), k


def test_a_folder_member_loads_as_load_file_reads_it(tmp_path):
    with stagesave.Checkpointer(tmp_path) as ck:
        ck.save_dir({"model.safetensors": Safetensors(_state()), "optimizer.bin": {"step": 1}},
                    "ckpt").result()
        path = os.path.join(tmp_path, "ckpt", "model.safetensors")
        got = ck.load(path)
        _equal(got, load_file(path))
        _equal(got, _state())
        got["w"].add_(1)  # its own memory: the file is not touched
        _equal(ck.load(path, verify=False), _state())
        _equal(ck.load(path, map_location="cpu"), _state())
        _equal(ck.load(path, map_location={"cpu": "cpu"}), _state())


def test_a_plain_safetensors_file_loads(tmp_path):
    path = os.path.join(tmp_path, "adapter.safetensors")
    save_file(_state(), path, metadata={"format": "pt"})
    with stagesave.Checkpointer(tmp_path) as ck:
        _equal(ck.load(path), load_file(path))


def test_a_damaged_member_is_refused_by_its_proof(tmp_path):
    with stagesave.Checkpointer(tmp_path) as ck:
        ck.save_dir({"model.safetensors": Safetensors(_state()), "optimizer.bin": {"step": 1}},
                    "ckpt").result()
        path = os.path.join(tmp_path, "ckpt", "model.safetensors")
        size = os.path.getsize(path)
        with open(path, "r+b") as f:  # one byte of tensor data
            f.seek(size - 5)
            byte = f.read(1)
            f.seek(size - 5)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(IntegrityError, match=r"is corrupt: .*model\.safetensors: checksum "
                           r"mismatch in bytes"):
            ck.load(path)


def test_a_plain_file_with_a_broken_header_says_what_it_is(tmp_path):
    path = os.path.join(tmp_path, "adapter.safetensors")
    save_file(_state(), path)
    with open(path, "r+b") as f:
        f.seek(12)
        f.write(b"zzzz")
    with stagesave.Checkpointer(tmp_path) as ck, pytest.raises(
        IntegrityError, match=r"adapter\.safetensors: the file is damaged \(not a safetensors "
        r"file: "
    ):
        ck.load(path)


def test_a_map_location_function_is_refused_with_the_remedy(tmp_path):
    path = os.path.join(tmp_path, "adapter.safetensors")
    save_file(_state(), path)
    with stagesave.Checkpointer(tmp_path) as ck, pytest.raises(
        UsageError, match=r"a safetensors file's tensors are read on the CPU; give a device"
    ):
        ck.load(path, map_location=lambda storage, location: storage)
