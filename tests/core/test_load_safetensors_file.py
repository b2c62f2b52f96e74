"""``Checkpointer.load`` of a safetensors file: what ``safetensors.torch.load_file`` returns,
checked against the file's proof where it has one; never called damaged when it is intact."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import stagesave
from stagesave.errors import IntegrityError, UnsupportedObjectError, UsageError
from stagesave.formats import Raw, Safetensors


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


def _overwrite(f, at: int, data: bytes) -> None:
    f.seek(at)
    f.write(data)


@pytest.mark.parametrize(("damage", "says"), [
    (lambda f: _overwrite(f, 12, b"zzzz"), r"not a safetensors file: "),
    (lambda f: f.truncate(40),
     r"a safetensors file cut short: its header says [0-9,]+ bytes, 32 follow\)"),
], ids=["broken header", "header cut short"])
def test_a_damaged_plain_file_says_what_it_is(tmp_path, damage, says):
    path = os.path.join(tmp_path, "adapter.safetensors")
    save_file(_state(), path)
    with open(path, "r+b") as f:
        damage(f)
    with stagesave.Checkpointer(tmp_path) as ck, pytest.raises(
        IntegrityError, match=r"adapter\.safetensors: the file is damaged \(" + says
    ):
        ck.load(path)


def test_what_load_file_reads_load_reads(tmp_path):
    """An empty file, an MX scale dtype; a dtype no reader knows is refused as damaged."""
    with stagesave.Checkpointer(tmp_path) as ck:
        empty = os.path.join(tmp_path, "empty.safetensors")
        save_file({}, empty)
        assert os.path.getsize(empty) < 64 and ck.load(empty) == {} == load_file(empty)
        if hasattr(torch, "float8_e8m0fnu"):
            mx = os.path.join(tmp_path, "mx.safetensors")
            scales = torch.tensor([1.0, 2.0, 0.5]).to(torch.float8_e8m0fnu)
            save_file({"s": scales}, mx)
            got = ck.load(mx)["s"]
            assert got.dtype == torch.float8_e8m0fnu
            assert torch.equal(got.view(torch.uint8), scales.view(torch.uint8))
        odd = os.path.join(tmp_path, "odd.safetensors")
        header = b'{"a":{"dtype":"F5","shape":[1],"data_offsets":[0,1]}}'
        with open(odd, "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header + b"\0")
        with pytest.raises(IntegrityError, match=r"the file is damaged \(not a safetensors file"):
            ck.load(odd)


def test_map_location_as_torch_load_takes_it(tmp_path):
    path = os.path.join(tmp_path, "adapter.safetensors")
    save_file(_state(), path)
    with stagesave.Checkpointer(tmp_path) as ck:
        _equal(ck.load(path, map_location=lambda storage, location: storage), _state())
        seen: list[tuple[int, str]] = []

        def copied(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
            seen.append((storage.nbytes(), location))
            return storage.clone()

        _equal(ck.load(path, map_location=copied), _state())  # each given its own storage
        assert sorted(seen) == sorted((t.nbytes, "cpu") for t in _state().values())
        assert {t.device.type for t in ck.load(path, map_location="meta").values()} == {"meta"}
        with pytest.raises(UsageError, match=r"map_location=0\.5 is not a device"):
            ck.load(path, map_location=0.5)
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match=r"cannot load .*adapter\.safetensors onto "
                               r"cuda:0: "):
                ck.load(path, map_location={"cpu": "cuda:0"})


def test_a_safetensors_value_inside_a_torch_state_is_refused_at_save(tmp_path):
    """Pickled into a torch file it could be loaded only by allowing a stagesave class."""
    with stagesave.Checkpointer(tmp_path) as ck:
        for state in (Safetensors(_state()), {"model": Safetensors(_state())},
                      {"config": Raw(b"{}")}):
            with pytest.raises(UnsupportedObjectError, match=r"(Safetensors|Raw)\(\.\.\.\) is a "
                               r"file of a folder checkpoint: give it to save_dir"):
                ck.save(state, "x.ckpt")
    assert sorted(os.listdir(tmp_path)) == []


def test_folder_files_copy_but_do_not_pickle():
    import copy
    import pickle

    files = {"model.safetensors": Safetensors(_state()), "config.json": Raw(b"{}")}
    deep = copy.deepcopy(files)
    _equal(deep["model.safetensors"].tensors, _state())
    assert deep["model.safetensors"].tensors["w"] is not files["model.safetensors"].tensors["w"]
    assert copy.copy(files["config.json"]) == Raw(b"{}")
    with pytest.raises(TypeError, match=r"Safetensors\(\.\.\.\) is a file of a folder"):
        pickle.dumps(files)


def test_a_map_location_function_giving_too_small_a_storage_is_refused(tmp_path):
    path = os.path.join(tmp_path, "adapter.safetensors")
    save_file(_state(), path)
    with stagesave.Checkpointer(tmp_path) as ck, pytest.raises(
        UsageError, match=r"map_location gave tensor '\w+' a storage of 1 bytes for its"
    ):
        ck.load(path, map_location=lambda storage, location: torch.UntypedStorage(1))
