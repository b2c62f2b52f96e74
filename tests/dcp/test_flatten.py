"""The steady planner's own flattening and lookups give DCP's answers
(:mod:`stagesave.dcp._flatten`)."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import stagesave.dcp as sdcp
from stagesave.dcp import _flatten
from stagesave.dcp._flatten import fast_flatten_usable, flatten
from stagesave.dcp._steady_planner import SteadySavePlanner


class _Frozen(Mapping[Any, Any]):
    """A mapping that is not a dict (walked through the abstract-class check)."""

    def __init__(self, items: dict[Any, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class _Box(list):  # type: ignore[type-arg]
    """A list subclass (DCP walks it like a list)."""


_TENSORS = [torch.zeros(2), torch.ones(3), torch.nn.Parameter(torch.zeros(1)), torch.zeros(0)]
_keys = st.one_of(st.sampled_from(["a", "b", "a.b", "0", "x"]), st.integers(0, 3),
                  st.just((1, 2)), st.just(1.0), st.just(True))
_leaves = st.one_of(st.sampled_from(_TENSORS), st.integers(-3, 3), st.none(), st.text(max_size=3),
                    st.floats(allow_nan=False), st.just(b"x"), st.booleans())


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.dictionaries(_keys, children, max_size=4),
        st.dictionaries(_keys, children, max_size=3).map(collections.OrderedDict),
        st.dictionaries(_keys, children, max_size=3).map(_Frozen),
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(_Box),
        st.lists(children, max_size=3).map(tuple),
    )


_states = st.dictionaries(_keys, st.recursive(_leaves, _containers, max_leaves=25), max_size=5)


@settings(max_examples=400, deadline=None)
@given(_states)
def test_flatten_gives_dcps_flat_state_and_mappings(state):
    try:
        theirs = flatten_state_dict(state)
    except ValueError as exc:  # two paths joined to one key
        assert "duplicated flatten key" in str(exc)
        assert flatten(state) is None
        return
    ours = flatten(state)
    assert ours is not None
    flat, paths, sharded = ours
    assert list(flat) == list(theirs[0])  # the same keys in the same order
    assert all(flat[k] is theirs[0][k] for k in flat)  # the very same objects
    assert paths == theirs[1]
    assert [type(p) for path in paths.values() for p in path] == [
        type(p) for path in theirs[1].values() for p in path]
    assert sharded is False


def test_a_state_dcp_lays_out_as_torch_2_3_did_is_flattened_by_dcp(monkeypatch):
    state = {"a": {"b": [torch.zeros(1), 1]}, "c": {"x": 1, "y": [2]}}
    assert fast_flatten_usable()
    monkeypatch.setattr(_version, "_derived_version", "2_3")
    assert not fast_flatten_usable()
    planner = SteadySavePlanner()
    planner.set_up_planner(state, None, True)
    expected = flatten_state_dict(state)  # DCP's older walk: a dict without tensors is one value
    assert list(planner.state_dict) == list(expected[0]) == ["a.b.0", "a.b.1", "c"]
    assert planner.mappings == expected[1]


def test_the_planners_set_up_equals_dcps_default(tmp_path):
    layers = [{"b": torch.zeros(2)}, {"b": torch.ones(2)}]
    state = {"model": {"w": torch.randn(3, 2), "layers": layers},
             "optimizer": {"state": {0: {"exp_avg": torch.zeros(2), "step": torch.tensor(3.0)}},
                           "param_groups": [{"lr": 0.1, "params": [0]}]},
             "epoch": 2, "names": ["x", "y"]}
    ours, theirs = SteadySavePlanner(), DefaultSavePlanner()
    ours.set_up_planner(state, None, True)
    theirs.set_up_planner(state, None, True)
    assert list(ours.state_dict) == list(theirs.state_dict)
    assert all(ours.state_dict[k] is theirs.state_dict[k] for k in ours.state_dict)
    assert ours.mappings == theirs.mappings
    assert ours.flatten_state_dict and ours.flatten_sharded_tensors  # flags as they were
    plan, expected_plan = ours.create_local_plan(), theirs.create_local_plan()
    assert plan.items == expected_plan.items
    assert plan.planner_data == expected_plan.planner_data == theirs.mappings
    # each item resolves to what DCP's default resolves it to (the tensor itself, or the same
    # pickled bytes for the other values)
    in_one_call = ours.resolve_items(plan.items)
    for item, together in zip(plan.items, in_one_call, strict=True):
        mine, dcps = ours.resolve_data(item), theirs.resolve_data(item)
        if isinstance(dcps, torch.Tensor):
            assert mine is dcps and together is dcps
        else:
            assert mine.getvalue() == dcps.getvalue() == together.getvalue()


def test_a_subclass_that_looks_objects_up_itself_is_asked(tmp_path):
    asked = []

    class Scaling(SteadySavePlanner):
        def lookup_object(self, index):
            asked.append(index.fqn)
            obj = super().lookup_object(index)
            return obj * 2 if isinstance(obj, torch.Tensor) else obj

    state = {"w": torch.ones(4), "step": 3}
    with sdcp.StagedStorageWriter(root=tmp_path, commit_timeout=60) as writer:
        sdcp.save(state, "one", writer=writer, planner=Scaling()).result(60)
    target = {"w": torch.zeros(4), "step": 0}
    sdcp.load(target, tmp_path / "one")
    assert torch.equal(target["w"], torch.full((4,), 2.0))
    assert "w" in asked


def test_a_subclass_that_resolves_items_itself_is_asked_for_each(tmp_path):
    class Doubling(SteadySavePlanner):
        def resolve_data(self, write_item):
            obj = super().resolve_data(write_item)
            return obj * 2 if isinstance(obj, torch.Tensor) else obj

    state = {"w": torch.ones(4), "v": torch.arange(3.0), "step": 3}
    with sdcp.StagedStorageWriter(root=tmp_path, commit_timeout=60) as writer:
        sdcp.save(state, "one", writer=writer, planner=Doubling()).result(60)
    target = {"w": torch.zeros(4), "v": torch.zeros(3), "step": 0}
    sdcp.load(target, tmp_path / "one")
    assert torch.equal(target["w"], torch.full((4,), 2.0))
    assert torch.equal(target["v"], torch.tensor([0.0, 2.0, 4.0]))
    assert target["step"] == 3


def test_a_plain_tensor_item_at_a_wrong_offset_is_refused_as_dcp_refuses_it():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    planner = SteadySavePlanner()
    planner.set_up_planner({"w": torch.zeros(4, 2)}, None, True)
    item = WriteItem(index=MetadataIndex("w", [2, 0]), type=WriteItemType.TENSOR)
    with pytest.raises(ValueError, match="is not a ShardedTensor, can't find by offset"):
        planner.resolve_data(item)
    whole = WriteItem(index=MetadataIndex("w", [0, 0]), type=WriteItemType.TENSOR)
    assert planner.resolve_data(whole) is planner.state_dict["w"]


def test_duplicate_keys_raise_dcps_error():
    state = {"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        SteadySavePlanner().set_up_planner(state, None, True)


def test_a_state_holding_a_sharded_tensor_is_flattened_for_it(monkeypatch):
    """A flat state with a ShardedTensor among its values runs DCP's second flattening; one
    without does not (a ShardedTensor needs a process group to make: its type is swapped)."""
    calls = []
    real = _flatten._SHARDED

    class Marker(torch.Tensor):
        pass

    import torch.distributed.checkpoint.default_planner as dp
    monkeypatch.setattr(dp, "_flatten_sharded_tensors",
                        lambda sd: calls.append(list(sd)) or sd)
    SteadySavePlanner().set_up_planner({"a": {"b": torch.zeros(1)}}, None, True)
    assert calls == []
    monkeypatch.setattr(_flatten, "_SHARDED", Marker)
    marked = torch.zeros(1).as_subclass(Marker)
    SteadySavePlanner().set_up_planner({"a": {"b": marked, "c": 1}}, None, True)
    assert calls == [["a.b", "a.c"]]
    assert real is not None


# -- the outline a steady save compares instead of flattening (stagesave.dcp._flatten.outline)

_SAME_KIND = {torch.Tensor: lambda v: torch.full_like(v, 7.0), int: lambda v: v + 1,
              float: lambda v: v * 2 + 1, str: lambda v: v + "!", bool: lambda v: not v,
              bytes: lambda v: v + b"!", type(None): lambda v: None,
              torch.nn.Parameter: lambda v: torch.nn.Parameter(torch.ones_like(v))}


def _with_new_leaves(obj: Any) -> Any:
    """A copy of ``obj`` with the same containers and keys, every leaf another value of its
    exact type (lists and tuples copied as they are when they hold no tensor)."""
    kind = type(obj)
    if kind in _SAME_KIND:
        return _SAME_KIND[kind](obj)
    if kind is _Frozen:
        return _Frozen({k: _with_new_leaves(v) for k, v in obj.items()})
    if isinstance(obj, dict):
        return kind((k, _with_new_leaves(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return kind(_with_new_leaves(v) for v in obj)
    return obj


def _flat_from_outline(kept: Any, state: Any) -> Any:
    """What the steady planner makes of ``state`` from ``kept``'s flattening (``None``: the
    outlines differ, or there is none)."""
    a, b = _flatten.outline(kept), _flatten.outline(state)
    if a is None or b is None or a[0] != b[0]:
        return None
    flat = flatten(kept)
    assert flat is not None
    return dict(zip(list(flat[0]), b[1])), flat[1]


@settings(max_examples=400, deadline=None)
@given(_states)
def test_an_outline_equal_to_a_kept_one_gives_the_flattening_of_the_state(state):
    """The same structure with every leaf replaced: the outline matches, and the kept keys
    paired with the new leaves are exactly DCP's flattening of the new state."""
    try:
        theirs = flatten_state_dict(state)
    except ValueError:
        return
    again = _with_new_leaves(state)
    expected = flatten_state_dict(again)
    shape = _flatten.outline(state)
    outlined = all(type(k) in (str, int) for k in _all_keys(state)) and all(
        type(m) in (dict, collections.OrderedDict) for m in _mappings(state))
    assert (shape is not None) == outlined
    if shape is None:
        return
    assert len(shape[1]) == len(theirs[0])
    assert all(a is b for a, b in zip(shape[1], theirs[0].values()))  # the leaves, in order
    made = _flat_from_outline(state, again)
    assert made is not None
    flat, mappings = made
    assert list(flat) == list(expected[0])
    assert all(flat[k] is expected[0][k] for k in flat)
    assert mappings == expected[1]


def _mappings(obj: Any) -> list[Any]:
    if isinstance(obj, Mapping):
        return [obj, *[m for v in obj.values() for m in _mappings(v)]]
    if isinstance(obj, list):
        return [m for v in obj for m in _mappings(v)]
    return []


def _all_keys(obj: Any) -> list[Any]:
    if isinstance(obj, Mapping):
        return [*obj, *[k for v in obj.values() for k in _all_keys(v)]]
    if isinstance(obj, list):
        return [k for v in obj for k in _all_keys(v)]
    return []


@settings(max_examples=400, deadline=None)
@given(_states, _states)
def test_equal_outlines_always_flatten_alike(one, other):
    """Whatever two states are, equal outlines mean the same flat keys and mappings."""
    try:
        expected = flatten_state_dict(other)
        flatten_state_dict(one)
    except ValueError:
        return
    made = _flat_from_outline(one, other)
    if made is not None:
        assert list(made[0]) == list(expected[0])
        assert all(made[0][k] is expected[0][k] for k in made[0])
        assert made[1] == expected[1]


_T = torch.zeros(2)


@pytest.mark.parametrize(("kept", "changed"), [
    ({"a": [1, 2]}, {"a": [1, _T]}),  # a list DCP now walks into
    ({"a": [_T, 2]}, {"a": [_T, 2, 3]}),  # one more entry
    ({"a": {"b": _T}}, {"a": {"c": _T}}),  # another key
    ({"a": {0: _T}}, {"a": {"0": _T}}),  # the same flat key from a key of another type
    ({"a": {"b": _T, "c": 1}}, {"a": {"c": 1, "b": _T}}),  # another order
    ({"a": {"b": 1}}, {"a": {"b": {}}}),  # a leaf became an empty mapping
    ({"a": (1, 2)}, {"a": [1, 2]}),  # a tuple became a list (both one value)
    ({"a": {"b": _T}}, {"a": collections.OrderedDict(b=_T)}),  # another mapping type
    ({"a": [[_T]]}, {"a": [[_T], []]}),
    ({"a": 1, "b": {}}, {"a": 1}),  # an empty mapping (no flat key) gone
])
def test_any_change_of_structure_changes_the_outline(kept, changed):
    assert _flatten.outline(kept)[0] != _flatten.outline(changed)[0]


def test_keys_of_other_types_and_sharded_tensors_have_no_outline(monkeypatch):
    assert _flatten.outline({"a": {1.0: _T}}) is None
    assert _flatten.outline({"a": {True: _T}}) is None
    assert _flatten.outline({(1, 2): _T}) is None

    class Marker(torch.Tensor):
        pass

    monkeypatch.setattr(_flatten, "_SHARDED", Marker)
    assert _flatten.outline({"a": {"b": torch.zeros(1).as_subclass(Marker)}}) is None


def test_the_planner_pairs_a_kept_flattening_with_the_leaves_of_the_same_structure():
    """The steady planner flattens a new structure once; the next state of that structure gets
    the kept keys (the very string objects) and its own leaves, equal to DCP's flattening."""
    planner = SteadySavePlanner()
    state = {"model": {"w": torch.zeros(3)}, "opt": {"state": {0: {"m": torch.ones(3)}},
                                                     "param_groups": [{"lr": 0.1, "params": [0]}]}}
    planner.set_up_planner(state, None, True)
    first_keys = list(planner.state_dict)
    state2 = _with_new_leaves(state)
    planner.set_up_planner(state2, None, True)
    expected = flatten_state_dict(state2)
    assert list(planner.state_dict) == list(expected[0])
    assert all(a is b for a, b in zip(planner.state_dict, first_keys))  # kept key objects
    assert all(planner.state_dict[k] is expected[0][k] for k in planner.state_dict)
    assert planner.mappings == expected[1]
    changed = {**state2, "extra": torch.zeros(1)}
    planner.set_up_planner(changed, None, True)
    assert list(planner.state_dict) == list(flatten_state_dict(changed)[0])
    assert not all(a is b for a, b in zip(planner.state_dict, first_keys))


class _Flip(_Frozen):
    """A mapping whose ``items()`` answers in another order at every call (a view whose order
    is not stable): the outline and DCP's flattening of one save would see two orders."""

    def __init__(self, items: dict[Any, Any]) -> None:
        super().__init__(items)
        self.calls = 0

    def items(self) -> Any:  # type: ignore[override]
        self.calls += 1
        pairs = list(self._items.items())
        return pairs if self.calls % 2 else pairs[::-1]


def test_a_mapping_other_than_a_dict_is_flattened_at_every_save():
    """Only a dict and an OrderedDict have an outline: another mapping's items() may answer
    differently from one call to the next, and each save pairs every key with its own
    tensor, as DCP does."""
    a, b = torch.zeros(2), torch.ones(3)
    view = _Flip({"a": a, "b": b})
    assert _flatten.outline({"m": view}) is None
    planner = SteadySavePlanner()
    for _ in range(4):
        planner.set_up_planner({"m": view}, None, True)
        assert planner.state_dict["m.a"] is a and planner.state_dict["m.b"] is b


def test_a_subclass_that_changes_its_mappings_in_place_gets_fresh_ones_at_every_save():
    """A subclass may edit ``self.mappings`` after the set-up (here: a compiled model's prefix
    dropped from the keys); the next save of the same structure starts from DCP's mappings."""

    class Strip(SteadySavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            for key in [k for k in self.state_dict if "_orig_mod." in k]:
                new = key.replace("_orig_mod.", "")
                self.state_dict[new] = self.state_dict.pop(key)
                self.mappings[new] = tuple(p for p in self.mappings.pop(key) if p != "_orig_mod")

    planner = Strip()
    for _ in range(3):
        w = torch.zeros(2)
        planner.set_up_planner({"model": {"_orig_mod.w": w}}, None, True)
        assert list(planner.state_dict) == ["model.w"] and planner.state_dict["model.w"] is w
        assert planner.mappings == {"model.w": ("model", "_orig_mod.w")}
