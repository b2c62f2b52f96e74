"""The first pickle of a structure written from its walk (:mod:`stagesave.saving.first_pickle`)
is, byte for byte, the pickle :class:`TorchPickler` writes for the state's marked copy, cut at the
same places, with the same storages and tensor facts recorded; what it cannot write it declines.

The oracle is the pickler path a template used before (and still uses for what the writer
declines); that path is itself compared with ``torch.save`` by ``test_steady.py``.
"""

from __future__ import annotations

import collections
import io
import sys
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagesave
from stagesave.saving import steady
from stagesave.saving.first_pickle import _Unfit, _Writer, first_pickle
from stagesave.saving.splice import cut, marked
from stagesave.saving.torch_pickler import TorchPickler
from stagesave.saving.walk import walk


def _pickler_path(state: Any) -> tuple[list[bytes], list[int], TorchPickler]:
    walked = walk(state)
    buf = io.BytesIO()
    pickler = TorchPickler(buf)
    pickler.dump(marked(state))
    found = cut(buf.getvalue(), len(walked.leaves))
    assert found is not None
    return found[0], found[1], pickler


def _facts(recorder: Any, tensors: list[Any]) -> list[Any]:
    out = []
    for t in tensors:
        ident = id(recorder.param_data[id(t)]) if type(t) is torch.nn.Parameter else id(t)
        out.append(recorder.info[ident])
    return out


def assert_written_as_the_pickler_writes(state: Any) -> None:
    walked = walk(state)
    written = first_pickle(state, walked)
    assert written is not None
    pieces, order, facts = written
    want_pieces, want_order, pickler = _pickler_path(state)
    assert b"".join(pieces) == b"".join(want_pieces)
    assert (pieces, order) == (want_pieces, want_order)
    assert [s._cdata for s in facts.storages] == [s._cdata for s in pickler.storages]
    assert facts.addresses == pickler.addresses
    assert _facts(facts, walked.tensors) == _facts(pickler, walked.tensors)


# ---------------------------------------------------------------------------- generated states
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
_KEY_TEXTS = ["a", "exp_avg", "0", "7", "storage", "cpu", "é", "\ud800x"]


@st.composite
def _states(draw: Any) -> Any:
    base = [torch.arange(24, dtype=torch.float32).reshape(4, 6)]  # storages views may share
    made: list[Any] = []  # tensors and parameters, for "the same object again"

    def tensor() -> Any:
        choice = draw(st.integers(0, 5))
        if choice == 0 and made:
            return draw(st.sampled_from(made))  # one object named twice
        if choice == 1:
            t = base[0][draw(st.integers(0, 3))]  # a view of a shared storage
        elif choice == 2:
            t = base[0].t()[1:3]
        elif choice == 3:
            t = torch.nn.Parameter(torch.randn(draw(st.integers(0, 3)), 2),
                                   requires_grad=draw(st.booleans()))
        else:
            shape = tuple(draw(st.lists(st.integers(0, 3), max_size=5)))
            t = torch.zeros(shape, dtype=draw(st.sampled_from(_DTYPES)))
            if draw(st.booleans()) and t.is_floating_point():
                t.requires_grad_(True)
        made.append(t)
        return t

    keys = st.one_of(
        st.sampled_from([sys.intern(k) if k.isidentifier() else k for k in _KEY_TEXTS]),
        st.text(max_size=6), st.integers(-3, 300), st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False), st.booleans(), st.none(),
        st.tuples(st.text(max_size=3), st.integers(0, 3)),
    )
    leaves = st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.booleans(), st.none(),
                       st.text(max_size=8))
    plain_tuples: list[tuple[Any, ...]] = []  # value tuples of leaves: a later key may be one

    def key() -> Any:
        if plain_tuples and draw(st.integers(0, 3)) == 0:
            return draw(st.sampled_from(plain_tuples))
        return draw(keys)

    def node(depth: int) -> Any:
        kind = draw(st.integers(0, 7 if depth < 4 else 1))
        if kind == 0:
            return draw(leaves)
        if kind == 1:
            return tensor()
        n = draw(st.integers(0, 5))
        if kind in (2, 3):
            return {key(): node(depth + 1) for _ in range(n)}
        if kind == 4:
            od = collections.OrderedDict((key(), node(depth + 1)) for _ in range(n))
            if draw(st.booleans()):
                od._metadata = {"": {"version": draw(st.integers(0, 3))}}  # type: ignore[attr-defined]
            return od
        if kind == 5:
            return [node(depth + 1) for _ in range(n)]
        made_tuple = tuple(node(depth + 1) for _ in range(draw(st.integers(1, 5))))
        if all(type(v) in (int, bool, type(None), str) for v in made_tuple):
            plain_tuples.append(made_tuple)  # (no float: a NaN key is never found again)
        return made_tuple

    state = node(0)
    if draw(st.booleans()):  # past 256 memo entries: the writer's LONG_BINPUT path
        state = {"bulk": [tensor() for _ in range(draw(st.integers(60, 120)))], "state": state}
    return state


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(_states())
def test_generated_states_are_written_as_the_pickler_writes_them(state: Any) -> None:
    try:
        walked = walk(state)
    except Exception:  # noqa: BLE001 - a state no template stands for (e.g. shared containers)
        return
    try:
        _Writer(walked).value(state)
    except _Unfit as exc:
        # declined by design (the pickler writes it): one tuple object used as a dict key and
        # then again as a value (a generated key reused from an earlier value)
        if str(exc) == "a tuple that is a key too":
            return
    assert_written_as_the_pickler_writes(state)


# ---------------------------------------------------------------------------- batches and memo
@pytest.mark.parametrize("size", [0, 1, 2, 999, 1000, 1001, 2000, 2001])
def test_batches_of_a_thousand_as_pickle_writes_them(size: int) -> None:
    t = torch.ones(2)
    assert_written_as_the_pickler_writes({i: t if i % 2 else i for i in range(size)})
    assert_written_as_the_pickler_writes(collections.OrderedDict((i, t) for i in range(size)))
    assert_written_as_the_pickler_writes([torch.zeros(1) for _ in range(size)])


def test_interned_texts_shared_with_the_persistent_ids_are_referred_to() -> None:
    # "storage" and "cpu" as keys are the very strings torch's persistent ids hold, and "0"
    # the very string of the first storage's key: pickle memoises each once.
    t = torch.ones(3)
    assert_written_as_the_pickler_writes({"0": 1, "storage": t, "cpu": [t, "0"]})
    assert_written_as_the_pickler_writes({"storage": t, "0": t[1:], "cpu": 2})


def test_a_real_optimizer_state_is_written_as_the_pickler_writes_it() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(70)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert_written_as_the_pickler_writes({"model": model.state_dict(), "opt": opt.state_dict(),
                                          "params": list(model.parameters()), "step": 3})


# ---------------------------------------------------------------------------- what it declines
class _Opaque:
    def __init__(self) -> None:
        self.x = 1


def _quantized() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, still pickled
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)


@pytest.mark.parametrize("make", [
    lambda: {"a": _Opaque(), "t": torch.ones(1)},
    lambda: {"q": _quantized(), "t": torch.ones(1)},
    lambda: {frozenset({1}): torch.ones(1)},
], ids=["opaque-object", "quantized-tensor", "frozenset-key"])
def test_what_only_the_pickler_writes_is_declined(make: Any) -> None:
    state = make()
    assert first_pickle(state, walk(state)) is None


def test_two_dtypes_over_one_storage_are_declined() -> None:
    t = torch.ones(4)
    state = {"a": t, "b": t.view(torch.int32)}
    assert first_pickle(state, walk(state)) is None


def test_a_checkpointer_plans_its_first_save_with_it_and_falls_back(
        ckpt_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    real = steady.first_pickle

    def spy(state: Any, walked: Any) -> Any:
        got = real(state, walked)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(steady, "first_pickle", spy)
    plain = {"w": torch.arange(6.0), "step": 4, "name": "run"}
    with_object = {"w": torch.arange(6.0), "obj": _Opaque()}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save(plain, "a.ckpt").result()
        ck.save(with_object, "b.ckpt").result()
    assert calls == [True, False]
    a = torch.load(ckpt_dir / "a.ckpt", weights_only=True)
    assert torch.equal(a["w"], plain["w"]) and (a["step"], a["name"]) == (4, "run")
    b = torch.load(ckpt_dir / "b.ckpt", weights_only=False)
    assert torch.equal(b["w"], with_object["w"]) and b["obj"].x == 1


def test_a_state_that_is_not_the_walked_one_is_declined() -> None:
    # Another thread changing the state between the walk and the writing: the writer must not
    # pair one tensor with another's shape (it declines, the pickler path decides).
    state = {"a": torch.ones(2), "b": {"c": torch.ones(3)}}
    walked = walk(state)
    state["b"] = [1, 2]  # a list where the walk saw a dict of a tensor
    assert first_pickle(state, walked) is None
    state["b"] = {"c": torch.ones(3), "d": torch.ones(1)}  # one tensor more than walked
    assert first_pickle(state, walked) is None
    state["b"] = {}  # fewer values than walked
    assert first_pickle(state, walked) is None


def test_a_tuple_value_holding_a_leaf_is_not_the_key_that_names_it_again(
        ckpt_dir: Any) -> None:
    # The pickler pickles a marked copy: a tuple holding a leaf is a new tuple there, so a key
    # that is the same tuple object is written in full, not as a reference to the value. A
    # reference would make the next save's splice change the key along with the value.
    k = ("a", 1)
    inner = ("a",)
    leafless = ((),)  # no leaf inside: the very object in the marked copy, referred to again
    for state in ({"v": k, k: 0}, {"v": inner, (inner, 1): 0}, {"v": leafless, leafless: 0}):
        assert_written_as_the_pickler_writes(state)
    t = torch.ones(2)
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"w": t, "v": k, k: 0}, "a.ckpt").result()
        ck.save({"w": t, "v": ("b", 2), ("a", 1): 0}, "b.ckpt").result()  # the same structure
    got = torch.load(ckpt_dir / "b.ckpt", weights_only=True)
    assert got["v"] == ("b", 2) and got[("a", 1)] == 0 and ("b", 2) not in got


def test_a_state_nested_deeper_than_the_writer_recurses_is_declined(ckpt_dir: Any) -> None:
    state: Any = {"w": torch.ones(1), "x": 1}
    for _ in range(390):  # the walk takes up to 400 levels
        state = {"k": state}
    assert first_pickle(state, walk(state)) is None
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save(state, "deep.ckpt").result()
    got = torch.load(ckpt_dir / "deep.ckpt", weights_only=True)
    for _ in range(390):
        got = got["k"]
    assert torch.equal(got["w"], torch.ones(1)) and got["x"] == 1
