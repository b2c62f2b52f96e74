"""Hostile format-2 files whose proof is consistent (an attacker without a signing key recomputes
every digest): each passes ``verify`` as the bytes its proof describes, and the load must still
refuse what it would make of them (a review's reproductions, 2026-12-06), on every load path."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from pickleasm import (
    BUILD,
    EMPTY_TUPLE,
    FALSE,
    MARK,
    NONE,
    REDUCE,
    TRUE,
    TUPLE,
    TUPLE1,
    TUPLE2,
    TUPLE3,
    glob,
    num,
    raw,
    text,
    tup,
)
from proofkit import rewrite_pickle, rewrite_proof

import stagesave
from stagesave.restore.verified_memo import forget_verified

PATHS = {"image": {}, "unverified": {"verify": False}, "mmap": {"mmap": True},
         "no mmap": {"mmap": False}}


def _base(tmp_path, state: dict[str, object] | None = None) -> str:
    """A real checkpoint with room in its pickle (a long string) for a hostile one."""
    path = str(tmp_path / "x.ckpt")
    if state is None:
        state = {"pad": "A" * 6000, "w": torch.arange(8, dtype=torch.float32)}
    with stagesave.Checkpointer(writer="thread") as ck:
        ck.save(state, path).result()
    return path


def _load(path: str, how: str) -> object:
    forget_verified()  # as in a fresh process: the load reads and checks the file itself
    with stagesave.Checkpointer(writer="thread") as ck:
        return ck.load(path, **PATHS[how])


def _pid(key: str, kind: str, numel: int, location: str = "cpu") -> bytes:
    return tup(text("storage"), glob("torch", kind), text(key), text(location), num(numel)) + b"Q"


def _rebuild(storage: bytes, size: int) -> bytes:
    return glob("torch._utils", "_rebuild_tensor_v2") + tup(
        storage, num(0), num(size) + TUPLE1, num(1) + TUPLE1, FALSE,
        glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE) + REDUCE


def _program(value: bytes) -> bytes:
    return b"\x80\x02" + value + b"."


@pytest.mark.parametrize("how", list(PATHS))
def test_a_storage_of_no_bytes_is_not_grown_to_the_geometry_the_pickle_gives(tmp_path, how):
    # set_() would resize the empty storage: memory never written (the heap's old bytes), of
    # any size the pickle says
    path = _base(tmp_path)
    rewrite_pickle(path, _program(tup(_rebuild(_pid("0", "ByteStorage", 0), 4096),
                                      _rebuild(_pid("1", "FloatStorage", 0), 2**31 - 1))))
    assert stagesave.verify(path).status == "verified"
    # stagesave's check where the storage is its own; torch's where torch read the storage
    with pytest.raises(stagesave.IntegrityError, match=r"damaged \((?:a tensor of size \(4096,\) "
                       r"at offset 0 reaches past its storage of 0 bytes|.*not resizable|"
                       r"record size)"):
        _load(path, how)


def test_a_tensor_given_as_the_offset_does_not_get_past_the_check(tmp_path):
    # the offset of a tensor over a storage of no bytes is itself a 0-d int64 tensor (value 0)
    hooks = glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE
    rebuild = glob("torch._utils", "_rebuild_tensor_v2")
    zero_d = rebuild + tup(_pid("0", "LongStorage", 8), num(0), EMPTY_TUPLE, EMPTY_TUPLE, FALSE,
                           hooks) + REDUCE
    grown = rebuild + tup(_pid("1", "ByteStorage", 0), zero_d, num(4096) + TUPLE1,
                          num(1) + TUPLE1, FALSE, hooks) + REDUCE
    path = _base(tmp_path, {"pad": "A" * 6000, "w": torch.arange(8), "b": torch.ones(4)})
    rewrite_pickle(path, _program(grown))
    with pytest.raises(stagesave.IntegrityError, match=r"reaches past its storage of 0 bytes"):
        _load(path, "image")


@pytest.mark.parametrize("rebuild", ["_rebuild_tensor", "_rebuild_tensor_v3"])
def test_no_rebuild_of_torch_s_allow_list_grows_a_storage_of_no_bytes(tmp_path, rebuild):
    storage, size, stride = _pid("0", "ByteStorage", 0), num(4096) + TUPLE1, num(1) + TUPLE1
    hooks = glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE
    extra = FALSE + hooks + glob("torch", "uint8") if rebuild.endswith("v3") else b""
    path = _base(tmp_path)
    rewrite_pickle(path, _program(glob("torch._utils", rebuild) + tup(
        storage, num(0), size, stride, *([extra] if extra else [])) + REDUCE))
    with pytest.raises(stagesave.IntegrityError, match=r"reaches past its storage of 0 bytes"):
        _load(path, "image")


@pytest.mark.parametrize("how", ["image", "mmap"])
def test_a_sparse_tensor_whose_indices_leave_its_size_is_refused(tmp_path, how):
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 1 << 40]]), torch.tensor([1.0, 2.0]), (4,),
                                  check_invariants=False)
    path = _base(tmp_path, {"s": bad})  # stagesave saves it as torch.save would
    assert stagesave.verify(path).status == "verified"
    with pytest.raises(stagesave.IntegrityError,
                       match=r"a sparse tensor is not valid: .*found index 1099511627776"):
        _load(path, how)  # (its first use, to_dense(), wrote out of bounds)


@pytest.mark.parametrize("how", ["image", "mmap"])
def test_a_valid_sparse_tensor_still_loads(tmp_path, how):
    good = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([1.0, 2.0]), (4,))
    got = _load(_base(tmp_path, {"s": good}), how)
    assert torch.equal(got["s"].to_dense(), good.to_dense())


@pytest.mark.parametrize("fast", ["1", "0"])
def test_a_legacy_tensor_type_called_with_a_size_is_refused(tmp_path, monkeypatch, fast):
    monkeypatch.setenv("STAGESAVE_FAST_UNPICKLE", fast)
    path = _base(tmp_path)
    rewrite_pickle(path, _program(glob("torch", "ByteTensor") + tup(num(256)) + REDUCE))
    with pytest.raises(stagesave.UnsafeCheckpointError,
                       match=r"calls torch\.ByteTensor with \[.int.\] \(only data.*a size makes"):
        _load(path, "image")


def test_a_legacy_tensor_type_called_with_a_numpy_integer_is_refused(tmp_path):
    # numpy's scalar route admits np.int64(3): still a size to a legacy type
    path = _base(tmp_path)
    scalar = (glob("numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray",
                   "scalar")
              + glob("numpy", "dtype") + text("i8") + FALSE + TRUE + TUPLE3 + REDUCE
              + tup(num(3), text("<"), NONE, NONE, NONE, num(-1), num(-1), num(0)) + BUILD
              + raw((65536).to_bytes(8, "little")) + TUPLE2 + REDUCE)
    rewrite_pickle(path, _program(glob("torch", "ByteTensor") + tup(scalar) + REDUCE))
    with pytest.raises(stagesave.UnsafeCheckpointError,
                       match=r"it calls torch\.ByteTensor with \['int64'\]"):
        _load(path, "image")


def test_a_legacy_tensor_type_called_with_data_still_loads(tmp_path):
    path = _base(tmp_path)
    data = b"]" + b"(" + b"".join(b"G" + __import__("struct").pack(">d", x)
                                  for x in (1.5, -2.0)) + b"e"
    rewrite_pickle(path, _program(glob("torch", "FloatTensor") + data + TUPLE1 + REDUCE))
    got = _load(path, "image")
    assert torch.equal(got, torch.tensor([1.5, -2.0]))


@pytest.mark.parametrize("how", list(PATHS))
def test_a_storage_at_an_unknown_location_is_a_damaged_file(tmp_path, how):
    path = _base(tmp_path)
    rewrite_pickle(path, _program(_rebuild(_pid("0", "FloatStorage", 8, location="bogus"), 8)))
    with pytest.raises(stagesave.IntegrityError, match=r"its storages name a location this "
                       r"torch cannot restore \(don't know how to restore data location.*bogus.*"
                       r"map_location='cpu'"):
        _load(path, how)


def test_a_storage_key_recorded_twice_is_refused(tmp_path):
    path = _base(tmp_path, {"w": torch.arange(8.0), "b": torch.full((8,), 7.0)})

    def twice(doc):
        (k0, _, _), (_, o1, _) = doc["storages"]
        doc["storages"].append([k0, o1 + 48, 32])

    rewrite_proof(path, twice)
    info = stagesave.verify(path)
    assert info.status == "corrupt"
    assert any("storage 0 is recorded twice" in p for p in info.problems), info.problems
    with pytest.raises(stagesave.IntegrityError, match="recorded twice"):
        _load(path, "image")


def _tiny_records(path: str, n: int, before_key: str) -> None:
    """Add ``n`` one-byte storage records (disjoint, inside the proven bytes) just before
    storage ``before_key``'s: closer together than packing's alignment."""

    def add(doc):
        at = next(o for k, o, _ in doc["storages"] if k == before_key)
        doc["storages"] += [[f"t{i}", at - n + i, 1] for i in range(n)]

    rewrite_proof(path, add)


def test_records_too_close_to_pack_in_place_are_loaded_unpacked(tmp_path):
    # packing moved each record to the next multiple of 64 after the one before: 400 one-byte
    # records made it overwrite storage 0 before moving it (a wrong value, no error)
    path = _base(tmp_path, {"w": torch.full((8,), 1.1), "pad": "A" * 6000})
    _tiny_records(path, 400, "0")
    assert stagesave.verify(path).status == "verified"
    for how in ("image", "unverified", "mmap"):
        assert torch.equal(_load(path, how)["w"], torch.full((8,), 1.1)), how


def test_records_that_would_pack_past_the_buffer_do_not_crash_the_load(tmp_path):
    # 16,384 one-byte records: packing in place wrote ~1 MB past a ~40 KB buffer (SIGSEGV); the
    # load runs in a child, a crash is this test's failure and not pytest's death
    path = _base(tmp_path, {"w": torch.full((8,), 1.1), "pad": "A" * 6000})
    _tiny_records(path, 16_384, "0")
    child = textwrap.dedent(f"""
        import stagesave, torch
        try:
            with stagesave.Checkpointer(writer="thread") as ck:
                w = ck.load({path!r})["w"]
            print("loaded", torch.equal(w, torch.full((8,), 1.1)))
        except stagesave.IntegrityError as exc:  # (the records cut the pickle short)
            print("refused", "damaged" in str(exc))
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=False,
                         timeout=120, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() in (["loaded", "True"], ["refused", "True"])


def _ints(*xs: int) -> bytes:
    return tup(*[num(x) for x in xs])


def _geometry(storage: bytes, offset: int, size: bytes, stride: bytes) -> bytes:
    return glob("torch._utils", "_rebuild_tensor_v2") + tup(
        storage, num(offset), size, stride, FALSE,
        glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE) + REDUCE


@pytest.mark.parametrize("fast", ["1", "0"])
@pytest.mark.parametrize("how", list(PATHS))
def test_a_build_growing_a_storage_of_no_bytes_is_refused(tmp_path, how, fast, monkeypatch):
    # (review of 2026-12-07, older than it) BUILD of a tensor is torch's legacy set_(source,
    # offset, size, stride): over a storage of no bytes (resizable) it grew it to 1 MiB of the
    # heap's old bytes, verified file, every load path but mmap
    monkeypatch.setenv("STAGESAVE_FAST_UNPICKLE", fast)
    path = _base(tmp_path)
    empty = _geometry(_pid("0", "ByteStorage", 0), 0, _ints(0), _ints(1)) + b"q\x00"
    rewrite_pickle(path, _program(empty + tup(b"h\x00", num(0), _ints(1 << 20), _ints(1))
                                  + BUILD))
    assert stagesave.verify(path).status == "verified"
    with pytest.raises(stagesave.IntegrityError, match=r"damaged \((?:a tensor of size "
                       r"\(1048576,\) at offset 0 reaches past its storage of 0 bytes|"
                       r".*not resizable|record size)"):
        _load(path, how)


@pytest.mark.parametrize("fast", ["1", "0"])
def test_a_tensor_re_pointed_by_a_build_leaves_the_next_tensor_of_its_storage_alone(
        tmp_path, fast, monkeypatch):
    # (review of 881a94d) a storage's object was asked of its first tensor when a second tensor
    # needed it: a BUILD re-pointing the first put the second over another storage (a), or over
    # a storage of no bytes that set_ then grew to 4 MiB of the heap's old bytes (b)
    monkeypatch.setenv("STAGESAVE_FAST_UNPICKLE", fast)
    path = _base(tmp_path, {"pad": "A" * 6000, "w": torch.arange(8.0), "b": torch.full((8,), 7.0)})
    first = _geometry(_pid("0", "FloatStorage", 8), 0, _ints(8), _ints(1))
    other = _geometry(_pid("1", "FloatStorage", 8), 0, _ints(8), _ints(1)) + b"q\x01"
    second = _geometry(_pid("0", "FloatStorage", 8), 0, _ints(4), _ints(1))
    rewrite_pickle(path, _program(MARK + first + tup(other, num(0), _ints(8), _ints(1)) + BUILD
                                  + b"h\x01" + second + TUPLE))
    theirs = torch.load(path, weights_only=True)
    ours = _load(path, "image")
    assert ours[2].tolist() == theirs[2].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert ours[0].tolist() == theirs[0].tolist() == [7.0] * 8

    n = 1 << 20
    path = _base(tmp_path, {"pad": "A" * 6000, "w": torch.ones(n), "b": torch.ones(4)})
    empty = _geometry(_pid("1", "FloatStorage", 0), 0, _ints(0), _ints(1))
    first = _geometry(_pid("0", "FloatStorage", n), 0, _ints(n), _ints(1))
    second = _geometry(_pid("0", "FloatStorage", n), 0, _ints(n // 2, 2), _ints(2, 1))
    rewrite_pickle(path, _program(MARK + first + tup(empty, num(0), _ints(0), _ints(1)) + BUILD
                                  + second + TUPLE))
    loaded = _load(path, "image")[1]
    assert loaded.untyped_storage().nbytes() == 4 * n and bool((loaded == 1).all())


@pytest.mark.parametrize("fast", ["1", "0"])
@pytest.mark.parametrize("state", ["five", "three"])
def test_legacy_builds_of_a_tensor_get_one_verdict_with_or_without_the_c_unpickler(
        tmp_path, fast, state, monkeypatch):
    # (second review) the C unpickler ran torch's Tensor.__setstate__, which takes 3- and
    # 5-tuples (another tensor's data, requires_grad True); the loop and torch.load refuse them
    monkeypatch.setenv("STAGESAVE_FAST_UNPICKLE", fast)
    hooks = glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE
    w = _geometry(_pid("0", "FloatStorage", 8), 0, _ints(8), _ints(1))
    other = _geometry(_pid("1", "FloatStorage", 8), 0, _ints(8), _ints(1))
    args = (tup(other, num(0), _ints(8), TRUE, hooks) if state == "five"
            else tup(TRUE, NONE, hooks))
    path = _base(tmp_path, {"pad": "A" * 6000, "w": torch.arange(8.0), "b": torch.ones(8)})
    rewrite_pickle(path, _program(w + args + BUILD))
    with pytest.raises((pickle.UnpicklingError, RuntimeError, TypeError)):
        torch.load(path, weights_only=True)
    for how in PATHS:
        with pytest.raises(stagesave.IntegrityError, match="damaged"):
            _load(path, how)
