"""Round trips: every dtype, shape, stride and aliasing pattern comes back bitwise equal."""

from __future__ import annotations

import collections
import dataclasses
import io
import os
from typing import NamedTuple

import numpy as np
import pytest
import torch
from helpers import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagesave

SERIALIZABLE_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
] + [
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
    if hasattr(torch, n)
]


class Point(NamedTuple):
    x: torch.Tensor
    label: str


@dataclasses.dataclass
class Config:
    lr: float
    layers: list[int]
    weight: torch.Tensor


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0,
        256,
        (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=g,
    )
    t = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        t = raw.reshape(shape) % 2 == 1 if raw.numel() else torch.empty(shape, dtype=torch.bool)
    return t


@pytest.mark.parametrize("dtype", SERIALIZABLE_DTYPES, ids=str)
def test_every_dtype_round_trips_bitwise(ckpt_dir, dtype):
    t = _tensor(dtype, (3, 5), seed=1)
    state = {"t": t, "scalar": _tensor(dtype, (), seed=2), "empty": torch.empty(0, dtype=dtype)}
    stagesave.save(state, ckpt_dir / "d.ckpt")
    assert_same(stagesave.load(ckpt_dir / "d.ckpt"), state)
    assert_same(torch.load(ckpt_dir / "d.ckpt", weights_only=True), state)


def test_structures_and_python_values_round_trip(ckpt_dir):
    w = torch.randn(4, 4)
    state = {
        "od": collections.OrderedDict(a=w, b=[1, 2.5, "x", None, True]),
        "tuple": (w[0], {"nested": {"deep": [w.t()]}}),
        "numpy": np.arange(12, dtype=np.float32).reshape(3, 4),
        "np_scalar": np.float64(1.5),
        "rng": np.random.default_rng(3).bit_generator.state,
        "legacy_rng": np.random.RandomState(4).get_state(),
        "torch_rng": torch.get_rng_state(),
        "ints": {1: "one", 2: "two"},
        "big_int": 2**70,
        "bytes": b"\x00\x01",
        "param": torch.nn.Parameter(torch.ones(2)),
        "set": {1, 2, 3},
    }
    stagesave.save(state, ckpt_dir / "s.ckpt")
    assert_same(stagesave.load(ckpt_dir / "s.ckpt"), state)


def test_namedtuple_and_dataclass_load_once_allow_listed(ckpt_dir):
    state = {"p": Point(torch.ones(2), "a"), "cfg": Config(0.1, [1, 2], torch.zeros(3))}
    stagesave.save(state, ckpt_dir / "nt.ckpt")
    with pytest.raises(stagesave.UnsafeCheckpointError, match="Point|Config"):
        stagesave.load(ckpt_dir / "nt.ckpt")
    loaded = stagesave.load(ckpt_dir / "nt.ckpt", safe_globals=[Point, Config])
    assert_same(loaded, state)


def test_tied_weights_and_views_keep_sharing(ckpt_dir):
    emb = torch.randn(10, 4)
    state = {"embed": emb, "lm_head": emb, "row": emb[3], "t": emb.t(), "strided": emb[::2, 1:]}
    stagesave.save(state, ckpt_dir / "tied.ckpt")
    for loaded in (
        stagesave.load(ckpt_dir / "tied.ckpt"),
        stagesave.load(ckpt_dir / "tied.ckpt", mmap=False),
    ):
        assert_same(loaded, state)
        ptr = loaded["embed"].untyped_storage().data_ptr()
        for k in ("lm_head", "row", "t", "strided"):
            assert loaded[k].untyped_storage().data_ptr() == ptr, k
        loaded["embed"][3, 0] = 123.0
        assert loaded["row"][0].item() == 123.0 and loaded["lm_head"][3, 0].item() == 123.0


def test_bytes_equal_to_what_torch_save_loads(ckpt_dir):
    state = {"a": torch.randn(100, 7), "b": torch.arange(5)}
    stagesave.save(state, ckpt_dir / "x.ckpt")
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert_same(
        torch.load(ckpt_dir / "x.ckpt", weights_only=True), torch.load(buf, weights_only=True)
    )


def test_load_to_requested_device_and_meta(ckpt_dir):
    state = {"a": torch.randn(3)}
    stagesave.save(state, ckpt_dir / "x.ckpt")
    out = stagesave.load(ckpt_dir / "x.ckpt", map_location="meta")
    assert out["a"].device.type == "meta" and out["a"].shape == (3,)
    out = stagesave.load(ckpt_dir / "x.ckpt", map_location=torch.device("cpu"))
    assert torch.equal(out["a"], state["a"])


# ----------------------------------------------------------------------------- property test
dtypes = st.sampled_from(
    [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.float16]
)
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw):
    base = _tensor(draw(dtypes), draw(shapes), draw(st.integers(0, 10_000)))
    kind = draw(st.sampled_from(["plain", "t", "slice", "view"]))
    if kind == "t" and base.dim() == 2:
        return base.t()
    if kind == "slice" and base.dim() >= 1 and base.shape[0] > 1:
        return base[1:]
    if kind == "view" and base.dim() >= 1 and base.shape[-1] > 1:
        return base[..., ::2]
    return base


leaves = st.one_of(
    tensors(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
    st.builds(lambda n: np.arange(n, dtype=np.int32), st.integers(0, 6)),
)
states = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(min_size=1, max_size=5), children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
    ),
    max_leaves=12,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(state=states, alias=st.booleans())
def test_property_random_states_round_trip(tmp_path, state, alias):
    if alias:  # add aliases of the first tensor found
        found = [
            v
            for v in (state.values() if isinstance(state, dict) else [state])
            if isinstance(v, torch.Tensor)
        ]
        state = {
            "s": state,
            "alias": found[0] if found else torch.ones(1),
            "again": found[0] if found else None,
        }
    path = tmp_path / f"p{os.getpid()}.ckpt"
    with stagesave.Checkpointer() as ck:
        ck.save(state, path).result()
        assert_same(ck.load(path), state)
        assert_same(ck.load(path, mmap=False), state)


def test_an_unverified_load_reads_the_whole_file_and_skips_only_the_checks(ckpt_dir):
    """``verify=False`` prefetches the file with the same parallel chunked reads as a verified
    load (many chunks here) and returns the same state; a flipped data byte then goes unnoticed,
    which a verified load refuses."""
    state = {"w": torch.randn(300_000), "b": torch.arange(70_000), "step": 5}
    with stagesave.Checkpointer(ckpt_dir, chunk_bytes=64 << 10) as ck:
        ck.save(state, "a.ckpt").result()
        assert_same(ck.load("a.ckpt", verify=False), state)
        path = os.path.join(ckpt_dir, "a.ckpt")
        with open(path, "r+b") as f:
            data = f.read()
            offset = data.find(state["w"].numpy().tobytes()[:64]) + 100
            assert offset > 100
            f.seek(offset)
            f.write(bytes([data[offset] ^ 0xFF]))
        got = ck.load("a.ckpt", verify=False)
        assert not torch.equal(got["w"], state["w"])
        with pytest.raises(stagesave.IntegrityError):
            ck.load("a.ckpt")


def test_a_verified_local_load_reads_the_file_once_into_the_memory_its_tensors_keep(ckpt_dir):
    """The tensors of a verified load of a file of large tensors are views of one buffer the
    file was read into (their distance in memory is their distance in the file), they are
    writable, shared storages stay shared, and a flipped byte is still refused."""
    w = torch.randn(512, 512)
    state = {"w": w, "w_t": w.t(), "b": torch.arange(300_000, dtype=torch.int64),
             "opt": {"lr": 0.5, "name": "adam"}}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save(state, "a.ckpt").result()
        got = ck.load("a.ckpt")
        assert_same(got, state)
        assert got["w"].untyped_storage().data_ptr() == got["w_t"].untyped_storage().data_ptr()
        path = os.path.join(ckpt_dir, "a.ckpt")
        with open(path, "rb") as f:
            data = f.read()
        at_w = data.find(w.numpy().tobytes()[:64])
        at_b = data.find(state["b"].numpy().tobytes()[:64])
        assert got["b"].data_ptr() - got["w"].data_ptr() == at_b - at_w
        got["w"].add_(1)  # writable, and private to this load
        assert torch.equal(ck.load("a.ckpt")["w"], w)
        with open(path, "r+b") as f:
            f.seek(at_b + 8)
            f.write(b"\xff")
        with pytest.raises(stagesave.IntegrityError, match="checksum mismatch"):
            ck.load("a.ckpt")


@pytest.mark.parametrize("tamper", ["unknown storage key", "storage larger than its record"])
def test_a_pickle_naming_storages_its_proof_does_not_hold_is_refused_as_damaged(
        ckpt_dir, tamper):
    """The one-read load hands out storages over its buffer only as the file's proof lays them
    out: an unverified load of a pickle whose persistent id names another key, or more bytes
    than the record holds, is an IntegrityError (never a read past the record)."""
    state = {"w": torch.ones(262_144)}  # 1 MiB: the file is mostly tensor bytes
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save(state, "a.ckpt").result()
        path = os.path.join(ckpt_dir, "a.ckpt")
        with open(path, "rb") as f:
            data = bytearray(f.read())
        if tamper == "unknown storage key":
            old, new = b"X\x01\x00\x00\x000", b"X\x01\x00\x00\x00Z"
        else:  # the numel after the location "cpu"
            old = b"X\x03\x00\x00\x00cpuq\x06J" + (262_144).to_bytes(4, "little")
            new = old[:-4] + (262_145).to_bytes(4, "little")
        at = data.find(old)
        assert at > 0, data[:400]
        data[at : at + len(old)] = new
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(stagesave.IntegrityError, match="proof, or larger"):
            ck.load("a.ckpt", verify=False)


@pytest.mark.parametrize("numel", [262_145, -1, (1 << 31) - 1])
def test_a_later_storage_of_a_known_type_is_checked_against_its_record_too(ckpt_dir, numel):
    """The storages after the first of their dtype take the load's short path: a pickle that
    gives the second storage more elements than its record holds, or a negative or huge count,
    is refused as damaged all the same (never a view past the record)."""
    state = {"a": torch.ones(262_144), "b": torch.ones(262_144)}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save(state, "a.ckpt").result()
        path = os.path.join(ckpt_dir, "a.ckpt")
        with open(path, "rb") as f:
            data = bytearray(f.read())
        # the second storage's id: key "1", then the memoised "cpu" (BINGET), then its count
        at = data.find(b"X\x01\x00\x00\x001q\x0fh\x06J")
        assert at > 0, data[:600]
        at += 11  # the count after its BININT opcode
        data[at : at + 4] = numel.to_bytes(4, "little", signed=True)
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(stagesave.IntegrityError, match="proof, or larger"):
            ck.load("a.ckpt", verify=False)


def test_a_filesystem_refusing_direct_reads_still_loads_through_buffered_reads(
        ckpt_dir, monkeypatch):
    """tmpfs and some network filesystems refuse O_DIRECT reads (EINVAL); that cannot be caused
    on this disk, so ``os.preadv`` is made to refuse: the one-read load reads buffered instead
    and still checks every chunk (a flipped byte is refused)."""
    import errno
    import fcntl

    preadv = os.preadv

    def refuse(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return preadv(fd, buffers, offset)

    state = {"w": torch.randn(262_144)}
    with stagesave.Checkpointer(ckpt_dir, chunk_bytes=64 << 10) as ck:
        ck.save(state, "a.ckpt").result()
        monkeypatch.setattr(os, "preadv", refuse)
        assert_same(ck.load("a.ckpt"), state)
        path = os.path.join(ckpt_dir, "a.ckpt")
        with open(path, "r+b") as f:
            data = f.read()
            at = data.find(state["w"].numpy().tobytes()[:64]) + 200_000
            f.seek(at)
            f.write(bytes([data[at] ^ 1]))
        with pytest.raises(stagesave.IntegrityError, match="checksum mismatch"):
            ck.load("a.ckpt")


def _empty_past_storage() -> dict[str, torch.Tensor]:
    at5 = torch.empty(0, dtype=torch.float64)
    at5.set_(torch.UntypedStorage(16), 5, (0, 3), (3, 1))  # no elements, past its 16 bytes
    return {"row": torch.zeros(2, 0)[1:], "rows": torch.zeros(3, 0, 4)[2:],
            "int": torch.zeros(4, 0, dtype=torch.int64)[3:], "at5": at5,
            "full": torch.arange(6.0)}


@pytest.mark.parametrize("mmap", [False, True])
def test_tensors_of_no_elements_past_their_storage_load_as_torch_loads_them(tmp_path, mmap):
    """``x[1:]`` of a ``(2, 0)`` tensor sits at offset 1 of a storage of no bytes: torch saves
    and loads it, and so must a verified load (the safe loader refused it as damage, found by
    ``test_property_random_states_round_trip``)."""
    state = _empty_past_storage()
    path = tmp_path / "e.ckpt"
    with stagesave.Checkpointer(writer="thread") as ck:
        ck.save(state, path).result()
        got = ck.load(path, mmap=mmap)
    theirs = tmp_path / "e.pt"
    torch.save(state, theirs)
    want = torch.load(theirs, weights_only=True)
    for key, t in want.items():
        assert (got[key].shape, got[key].stride(), got[key].storage_offset(), got[key].dtype) == (
            t.shape, t.stride(), t.storage_offset(), t.dtype), key
        assert torch.equal(got[key], t)


def _quantized_and_nested() -> dict[str, object]:
    g = torch.Generator().manual_seed(5)
    return {
        "q": torch.quantize_per_tensor(torch.rand(6, generator=g), 0.05, 3, torch.quint8),
        "qc": torch.quantize_per_channel(torch.rand(2, 4, generator=g), torch.tensor([0.1, 0.2]),
                                         torch.tensor([1, 2]), 0, torch.qint8),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)]),
        "w": torch.randn(4, generator=g),
    }


def _assert_quantized_and_nested(loaded, state):
    for k in ("q", "qc"):
        assert loaded[k].qscheme() == state[k].qscheme() and loaded[k].dtype == state[k].dtype
        assert torch.equal(loaded[k].int_repr(), state[k].int_repr())
        assert torch.equal(loaded[k].dequantize(), state[k].dequantize())
    assert [t.tolist() for t in loaded["nested"].unbind()] == [
        t.tolist() for t in state["nested"].unbind()]
    assert torch.equal(loaded["w"], state["w"])


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_quantized_and_nested_tensors_save_as_torch_saves_them(tmp_path, shm, writer):
    # torch lays them out only with their bytes (not under skip_data): stagesave refused them
    # with torch's "file an issue" message, though torch.save and torch.load(weights_only) take
    # them. Now the plan holds their bytes, copied at save() as staging would.
    from test_steady import assert_file_is_what_torch_save_writes

    state = _quantized_and_nested()
    with stagesave.Checkpointer(tmp_path / "ck", writer=writer) as ck:
        for step in range(3):  # the first plan, then the saves after it, each a new value
            state["w"].add_(1.0)
            state["q"] = torch.quantize_per_tensor(state["w"], 0.05, step, torch.quint8)
            handle = ck.save(state, f"s{step}.ckpt")
            saved = {k: (v.clone() if k in ("w", "q") else v) for k, v in state.items()}
            state["w"].add_(100.0)  # after save(): not in the checkpoint
            handle.result()
            path = tmp_path / "ck" / f"s{step}.ckpt"
            assert_file_is_what_torch_save_writes(path, saved)
            _assert_quantized_and_nested(ck.load(f"s{step}.ckpt"), saved)
            _assert_quantized_and_nested(torch.load(path, weights_only=True), saved)
        # among many small tensors (a first save that plan_behind would hold with writer="thread")
        many = {**{f"t{i}": torch.full((3,), float(i)) for i in range(2500)}, **saved}
        ck.save(many, "many.ckpt").result()
        loaded = ck.load("many.ckpt")
    _assert_quantized_and_nested(loaded, saved)
    assert all(torch.equal(loaded[f"t{i}"], many[f"t{i}"]) for i in range(2500))


@pytest.mark.parametrize("dtype", [torch.quint4x2, torch.quint2x4], ids=str)
def test_quantized_tensors_of_less_than_a_byte_load_on_every_path(tmp_path, dtype):
    # (review of 486be70) the safe loader's bound check counted a byte per element: a file
    # stagesave saved and torch.load reads was refused as "damaged"
    q = torch.quantize_per_tensor(torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]), 0.1, 0, dtype)
    assert q.untyped_storage().nbytes() < q.numel()  # packed
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.save({"q": q, "w": torch.ones(3)}, "x.ckpt").result()
        for options in ({}, {"verify": False}, {"mmap": True}, {"mmap": False}):
            loaded = ck.load("x.ckpt", **options)["q"]
            assert loaded.dtype == dtype and loaded.q_scale() == q.q_scale(), options
            assert torch.equal(loaded.int_repr(), q.int_repr()), options
