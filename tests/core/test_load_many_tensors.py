"""Loading files of many small tensors (issue 22): read once and verified as it lands like any
format-2 file, their storages packed into a buffer of their own (the file's page padding is not
kept alive), and the safe unpickler's tensors exactly torch.load's."""

from __future__ import annotations

import mmap

import pytest
import torch
from residency import resident_pages
from statecompare import same_state

import stagesave
from stagesave.restore import image_load
from stagesave.restore.verified_memo import forget_verified


def _many(n: int = 3000) -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(40, 30, generator=g)
    return {
        "moments": {f"m{i}": torch.randn(1 + i % 37, generator=g) for i in range(n)},
        "empty": torch.empty(0),
        "ints": torch.arange(10, dtype=torch.int16),
        "view_a": base,
        "view_b": base[5:, 3:].t(),  # shares base's storage, other offset and strides
        "grad": torch.ones(3, requires_grad=True),
        "conj": torch.complex(torch.ones(4), torch.arange(4.0)).conj(),
        "step": 12,
    }


@pytest.mark.parametrize(("verify", "after_verify"), [(True, False), (False, False), (True, True)])
def test_a_file_of_many_small_tensors_loads_into_a_packed_buffer(tmp_path, verify, after_verify):
    state = _many()
    path = str(tmp_path / "many.ckpt")
    with stagesave.Checkpointer(writer="thread") as ck:
        ck.save(state, path).result()
        entry = ck.verify(path).manifest.files[0]
        tensors = sum(r.nbytes for r in entry.storages)
        assert tensors < image_load.MIN_TENSOR_SHARE * entry.end  # padding dominates the file
        if not after_verify:
            forget_verified()  # else: the load follows a verification of the same file
        got = ck.load(path, verify=verify)
    same_state(state, got)
    same_state(torch.load(path, weights_only=True), got)  # the same objects as torch's own loader
    assert got["view_a"].untyped_storage().data_ptr() == got["view_b"].untyped_storage().data_ptr()
    # every storage in one buffer no larger than the tensors (each rounded to 64 bytes): the
    # file's padding to pages is not what the tensors keep
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*got["moments"].values(), got["ints"], got["view_a"], got["grad"]]}
    lo, hi = min(storages), max(p + n for p, n in storages.items())
    assert hi - lo <= sum((n + 63) // 64 * 64 for n in storages.values()) + 64 * len(storages)
    assert hi - lo < entry.end / 2
    # packed in place: the memory behind the rest of the file's buffer went back to the system
    page = mmap.PAGESIZE
    kept = (hi - lo + page - 1) // page * page
    assert resident_pages(lo, kept) > 0
    assert resident_pages(lo + kept, entry.end - kept) == 0


def test_a_flipped_byte_in_a_many_tensor_file_is_caught(tmp_path):
    path = str(tmp_path / "many.ckpt")
    with stagesave.Checkpointer(writer="thread") as ck:
        ck.save(_many(), path).result()
        record = ck.verify(path).manifest.files[0].storages[100]
    with open(path, "r+b") as f:
        f.seek(record.offset)
        b = f.read(1)
        f.seek(record.offset)
        f.write(bytes([b[0] ^ 1]))
    with stagesave.Checkpointer() as ck, pytest.raises(stagesave.IntegrityError,
                                                       match="checksum mismatch"):
        ck.load(path)


def test_under_a_fake_tensor_mode_the_load_makes_fake_tensors(tmp_path):
    """Inside a fake-tensor mode the load makes storage-less fake tensors, as torch.load does
    (no image is read; torch's own tensor rebuild runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    path = str(tmp_path / "small.ckpt")
    with stagesave.Checkpointer(writer="thread") as ck:
        ck.save({"w": torch.randn(8, 8)}, path).result()
        with FakeTensorMode():
            got = ck.load(path)
    assert type(got["w"]).__name__ == "FakeTensor" and got["w"].shape == (8, 8)


@pytest.mark.parametrize("early", [False, True], ids=["after-reads", "beside-reads"])
def test_whole_storage_tensors_and_their_near_misses_load_as_torch_loads_them(tmp_path, early):
    # A tensor that is its whole storage (1-D, contiguous, offset 0) is handed out as made over
    # the bytes, without setting its geometry; every near miss takes the rebuild as before.
    # ``early``: storages of >= 32 KiB, unpickled beside the reads (image_load's early path).
    n = 9000 if early else 5
    base = torch.arange(float(n * 4)).reshape(4, n)
    state = {
        "whole": torch.arange(float(n)),
        "grad": torch.ones(n, requires_grad=True),
        "one": torch.ones(1),
        "one_odd_stride": torch.ones(1, 7)[:, 3],  # size 1 at offset 3: not the whole
        "size1_stride5": torch.ones(5).as_strided((1,), (5,)),
        "head": torch.arange(float(n))[: n - 1],  # shorter than its storage
        "tail": torch.arange(float(n))[1:],  # offset 1
        "two_d": base,
        "row": base[1],
        "col": base[:, 2],
        "shared_a": base.view(-1),  # the whole of base's storage, after base took it
        "empty": torch.empty(0),
        "int8": torch.arange(n, dtype=torch.int8),
    }
    path = str(tmp_path / "geometry.ckpt")
    with stagesave.Checkpointer(writer="thread") as ck:
        ck.save(state, path).result()
        for verify in (True, False):
            forget_verified()
            ours = ck.load(path, verify=verify)
            theirs = torch.load(path, weights_only=True)
            same_state(ours, theirs)
            for k, t in ours.items():
                assert t._backward_hooks == theirs[k]._backward_hooks, k  # an empty OrderedDict
                assert t.untyped_storage().nbytes() == theirs[k].untyped_storage().nbytes(), k
            assert ours["shared_a"].untyped_storage().data_ptr() == (
                ours["two_d"].untyped_storage().data_ptr())
            ours["whole"][0] = 7.0  # writable, as torch's
