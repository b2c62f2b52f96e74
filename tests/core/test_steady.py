"""A reused plan (the steady state) writes what a plan from scratch would, after any change.

The oracle is ``torch.save``'s own layout (:func:`stagesave.saving.plan.plan_torch_file`) and a
load of the written file: after a first save makes the template, the state is changed in one of
many ways (leaf values and their types, tensors moved to new storages, aliasing made or broken,
shapes, dtypes, keys, shared containers, a storage that shrank under the same address) and
saved again by the same Checkpointer; the image must hold torch's bytes and the file must load
to the changed state: values, types (``-0.0``, ``True`` against ``1``), shapes, strides, storage
offsets and which tensors share a storage. The plan cache is a Checkpointer part (public inside
the package); the tests read it to tell a reuse from a new plan.
"""

from __future__ import annotations

import collections
import copy
import io
import math
import os
import struct
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagesave
from stagesave.formats import Safetensors
from stagesave.saving import fastplan, tensor_guard
from stagesave.saving.plan import plan_torch_file
from stagesave.saving.splice import encode
from stagesave.saving.steady import PlanCache


# ---------------------------------------------------------------------------- the oracle
def _flat(obj: Any, out: list[Any]) -> list[Any]:
    """Every node in pickle-independent order: containers by type and keys, leaves exactly."""
    kind = type(obj)
    if kind in (dict, collections.OrderedDict):
        out.append((kind, [(type(k), k) for k in obj]))
        for v in obj.values():
            _flat(v, out)
    elif kind in (list, tuple):
        out.append((kind, len(obj)))
        for v in obj:
            _flat(v, out)
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif kind is float:
        out.append((float, struct.pack("<d", obj)))  # -0.0 and NaN payloads too
    else:
        out.append((kind, obj))
    return out


def assert_same_state(got: Any, want: Any) -> None:
    a, b = _flat(got, []), _flat(want, [])
    assert len(a) == len(b)
    groups: list[dict[int, int]] = [{}, {}]
    pattern: list[list[int]] = [[], []]
    for x, y in zip(a, b):
        if isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor)
            assert type(x) is type(y)
            assert (x.dtype, x.shape, x.stride(), x.storage_offset(), x.requires_grad) == (
                y.dtype, y.shape, y.stride(), y.storage_offset(), y.requires_grad)
            assert torch.equal(x.detach(), y.detach())
            for side, t in enumerate((x, y)):
                key = t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else -id(t)
                pattern[side].append(groups[side].setdefault(key, len(groups[side])))
        else:
            assert x == y
    assert pattern[0] == pattern[1], "tensors share storages differently"


def _blank_id(data: bytearray) -> bytearray:
    """``data`` (a torch file's bytes) with its serialization id and that record's CRC zeroed."""
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(".data/serialization_id"))
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    at = info.header_offset + 30 + name_len + extra_len
    data[at : at + info.file_size] = bytes(info.file_size)
    data[at + info.file_size + 4 : at + info.file_size + 8] = bytes(4)  # its descriptor's CRC
    return data


def torch_save_bytes(state: Any) -> bytes:
    """``torch.save``'s bytes of ``state`` with stagesave's page alignment."""
    from torch.utils.serialization import config

    out = io.BytesIO()
    with config.patch({"save.storage_alignment": 4096}):
        torch.save(state, out)
    return out.getvalue()


def assert_file_is_what_torch_save_writes(path: Any, state: Any, *,
                                          theirs_bytes: bytes | None = None) -> None:
    """The checkpoint's bytes up to torch's central directory are ``torch.save``'s (with
    stagesave's page alignment), serialization ids aside: every header, the pickle, every
    storage's bytes and every CRC. ``theirs_bytes``: ``torch.save``'s bytes taken before."""
    theirs = bytearray(torch_save_bytes(state) if theirs_bytes is None else theirs_bytes)
    with zipfile.ZipFile(io.BytesIO(bytes(theirs))) as z:
        cd_start = z.start_dir
    with open(path, "rb") as f:
        ours = bytearray(f.read(cd_start))
    assert _blank_id(ours + theirs[cd_start:])[:cd_start] == _blank_id(theirs)[:cd_start]


def _tensor_bytes_equal(ck: stagesave.Checkpointer, state: Any) -> None:
    """The next save reuses nothing wrongly: its image has torch's layout."""
    image = ck.plans.plan(state)
    assert fastplan.same_layout(image, plan_torch_file(state))


# ---------------------------------------------------------------------------- changes
def _tensors(obj: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """(container, key) of every tensor."""
    if type(obj) in (dict, collections.OrderedDict):
        for k, v in obj.items():
            if isinstance(v, torch.Tensor):
                out.append((obj, k))
            else:
                _tensors(v, out)
    elif type(obj) is list:
        for i, v in enumerate(obj):
            if isinstance(v, torch.Tensor):
                out.append((obj, i))
            else:
                _tensors(v, out)
    return out


def base_state() -> dict[str, Any]:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    flat = torch.arange(10, dtype=torch.float64)
    return {
        "model": collections.OrderedDict(
            [("w", w), ("w_view", w[1:]), ("b", torch.ones(4)), ("p", torch.nn.Parameter(
                torch.zeros(2)))]),
        "flat": flat,
        "slice": flat[2:5],
        "opt": {"state": {0: {"m": torch.zeros(3, 4), "step": torch.tensor(5.0)},
                          1: {"m": torch.zeros(4), "step": torch.tensor(5.0)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1],
                                  "nesterov": False, "foreach": None}]},
        "global_step": 7,
        "epoch": 0,
        "name": "run",
        "history": [0.5, 0.25, 2**40, -3],
        "raw": b"\x00\x01",
        "empty": torch.empty(0),
        "empty_view": flat[3:3],
        "odd_keys": {(0, "a"): 1, 0.0: 2, "s": 3},
    }


class _Name(str):
    """A ``str`` subclass (pickled by reference to this module)."""


def _rekey(s: dict[str, Any], old: str, new: str) -> None:
    """``s`` with the key ``old`` replaced by ``new``, in its place."""
    items = list(s.items())
    s.clear()
    s.update((new if k == old else k, v) for k, v in items)


def _move(s: dict[str, Any]) -> None:  # every tensor onto a new storage, aliasing kept
    w = s["model"]["w"].clone()
    s["model"]["w"], s["model"]["w_view"] = w, w[1:]
    s["model"]["b"] = s["model"]["b"].clone()
    flat = s["flat"].clone()
    s["flat"], s["slice"], s["empty_view"] = flat, flat[2:5], flat[3:3]


def _unshare(s: dict[str, Any]) -> None:
    s["model"]["w_view"] = s["model"]["w_view"].clone()


def _share(s: dict[str, Any]) -> None:  # b becomes a view of w's storage with b's shape
    s["model"]["b"] = s["model"]["w"].reshape(-1)[:4]


def _same_object(s: dict[str, Any]) -> None:  # two equal step tensors become one object
    s["opt"]["state"][1]["step"] = s["opt"]["state"][0]["step"]


def _shared_container(s: dict[str, Any]) -> None:
    group = s["opt"]["param_groups"][0]
    s["opt"]["param_groups"] = [group, group]


def _equal_containers(s: dict[str, Any]) -> None:
    group = s["opt"]["param_groups"][0]
    s["opt"]["param_groups"] = [group, copy.copy(group)]


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "nothing": lambda s: None,
    "leaf values": lambda s: s.update(global_step=70_000, epoch=1, history=[-0.0, math.nan,
                                                                             2**70, -(2**33)]),
    "leaf types": lambda s: s.update(global_step=True, epoch=0.0, history=[None, 1, 2**40, -3.0]),
    "negative zero": lambda s: s["opt"]["param_groups"][0].update(lr=-0.0),
    "float objects": lambda s: s["opt"]["param_groups"][0].update(lr=float("0.1")),
    "tensor values in place": lambda s: s["model"]["w"].add_(1),
    "moved": _move,
    "unshared": _unshare,
    "shared": _share,
    "same object twice": _same_object,
    "two equal storages become one": lambda s: s["opt"]["state"][1].update(
        step=s["opt"]["state"][0]["step"].view(())),
    "unshared, same offsets": lambda s: s.update(
        slice=torch.arange(10, dtype=torch.float64)[2:5]),
    "reshaped": lambda s: s["model"].update(b=torch.ones(2, 2)),
    "resized in place": lambda s: s["model"]["b"].resize_(5),
    "transposed in place": lambda s: s["opt"]["state"][0]["m"].t_(),
    "dtype": lambda s: s["model"].update(b=torch.ones(4, dtype=torch.float16)),
    "requires_grad": lambda s: s["model"]["b"].requires_grad_(True),
    "parameter": lambda s: s["model"].update(b=torch.nn.Parameter(s["model"]["b"])),
    "tensor to parameter type only": lambda s: s["model"].update(
        p=s["model"]["p"].detach()),
    "key added": lambda s: s.update(extra=1),
    "key renamed": lambda s: s.update(name2=s.pop("name")),
    "int key to bool key": lambda s: s["opt"].update(state={True if k == 1 else k: v for k, v in
                                                            s["opt"]["state"].items()}),
    "string": lambda s: s.update(name="run-2"),
    "bytes": lambda s: s.update(raw=b"\x00\x02"),
    "shared container": _shared_container,
    "equal containers": _equal_containers,
    "metadata of a state_dict": lambda s: setattr(s["model"], "_metadata", {"": {"version": 2}}),
    "tuple to list": lambda s: s["opt"]["param_groups"][0].update(betas=[0.9, 0.999]),
    "nested deeper": lambda s: s.update(history=[s["history"]]),
    # a tensor of no elements has data_ptr() 0 whatever storage it views
    "an empty tensor becomes a view of another's storage": lambda s: s.update(
        empty=s["model"]["b"][:0]),
    "an empty view becomes a tensor of its own": lambda s: s.update(
        empty_view=torch.empty(0, dtype=torch.float64)),
    # keys equal in value, not in what they pickle to
    "a tuple key's members of other types": lambda s: s.update(
        odd_keys={(False, "a"): 1, 0.0: 2, "s": 3}),
    "a float key's sign": lambda s: s.update(odd_keys={(0, "a"): 1, -0.0: 2, "s": 3}),
    "a str key to numpy's str": lambda s: s.update(
        odd_keys={(0, "a"): 1, 0.0: 2, np.str_("s"): 3}),
    "an int key to numpy's int": lambda s: s["opt"].update(
        state={np.int64(k) if k == 1 else k: v for k, v in s["opt"]["state"].items()}),
    "a str key to an equal str of a subclass": lambda s: _rekey(s, "epoch", _Name("epoch")),
}


@pytest.fixture(params=["torch's check", "python"])
def facts_checked_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tensors' facts compared by torch's compiled check (:mod:`.tensor_guard`, where this
    torch has it) or read in Python (where it has not)."""
    if request.param == "python":
        monkeypatch.setattr(tensor_guard, "_usable", False)
    else:
        assert tensor_guard.usable(), "torch's compiled tensor check failed its self-test"
    return str(request.param)


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_after_a_planned_save_saves_what_torch_would(
        change: str, ckpt_dir: Any, facts_checked_by: str) -> None:
    state = base_state()
    with stagesave.Checkpointer(ckpt_dir, keep_last=None) as ck:
        ck.save(state, "a.pt").result()
        assert ck.plans._template is not None  # the first save made a template
        assert (ck.plans._template.guard is None) == (facts_checked_by == "python")
        ck.save(state, "b.pt").result()
        CHANGES[change](state)
        _tensor_bytes_equal(ck, state)
        ck.save(state, "c.pt").result()
        ck.save(state, "d.pt").result()  # and once more, reusing whatever the change left
        ck.verify("d.pt")
    for name in ("c.pt", "d.pt"):
        got = torch.load(os.path.join(ckpt_dir, name), weights_only=False)
        assert_same_state(got, state)
        assert_file_is_what_torch_save_writes(os.path.join(ckpt_dir, name), state)


def test_an_unchanged_structure_reuses_the_plan_and_a_moved_one_keeps_it(ckpt_dir: Any) -> None:
    state = base_state()
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save(state, "a.pt").result()
        template = ck.plans._template
        state["global_step"] += 1
        ck.save(state, "b.pt").result()
        assert ck.plans._template is template
        _move(state)
        ck.save(state, "c.pt").result()
        assert ck.plans._template is template  # new storages, same structure and sizes
        state["model"]["b"] = torch.ones(5)
        ck.save(state, "d.pt").result()
        assert ck.plans._template is not template
    assert_same_state(torch.load(os.path.join(ckpt_dir, "d.pt"), weights_only=False), state)


def test_a_storage_that_shrank_under_the_same_address_is_planned_again(ckpt_dir: Any) -> None:
    memory = bytearray(400)
    big = torch.frombuffer(memory, dtype=torch.float32)  # a 400-byte storage
    state = {"t": big[:5]}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save(state, "a.pt").result()
        small = torch.frombuffer(memory, dtype=torch.float32, count=10)  # 40 bytes, same address
        state = {"t": small[:5]}
        assert state["t"].data_ptr() == big.data_ptr()
        ck.save(state, "b.pt").result()
    got = torch.load(os.path.join(ckpt_dir, "b.pt"), weights_only=True)
    assert got["t"].untyped_storage().nbytes() == 40
    assert_same_state(got, state)


@pytest.mark.parametrize("two_first", [True, False])
def test_one_memory_as_one_storage_or_two_is_planned_again(ckpt_dir: Any, two_first: bool,
                                                          facts_checked_by: str) -> None:
    """Two storages over one memory (``from_numpy`` twice) and one storage viewed twice have
    the same data addresses: only the storages' own objects tell them apart."""
    arr = np.arange(10.0)
    one = torch.from_numpy(arr)
    states = [{"a": torch.from_numpy(arr)[:5], "b": torch.from_numpy(arr)[5:]},
              {"a": one[:5], "b": one[5:]}]
    if not two_first:
        states.reverse()
    with stagesave.Checkpointer(ckpt_dir, keep_last=None) as ck:
        for i, state in enumerate([states[0], states[0], states[1], states[1]]):
            ck.save(state, f"{i}.pt").result()
            # every byte torch.save writes (its pickle names the storages it keeps apart)
            assert_file_is_what_torch_save_writes(os.path.join(ckpt_dir, f"{i}.pt"), state)
            got = torch.load(os.path.join(ckpt_dir, f"{i}.pt"), weights_only=False)
            assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"])


def test_a_buffer_reused_by_other_files_between_two_steady_saves(ckpt_dir: Any) -> None:
    """One staging buffer; a steady save skips the headers the buffer still holds only when
    nothing else was staged into it since (here: another structure, a folder, a safetensors)."""
    a, b = base_state(), {"x": torch.ones(3000), "y": [torch.zeros(7), 3]}
    with stagesave.Checkpointer(ckpt_dir, max_pending=1, keep_last=None) as ck:
        for i, step in enumerate(["a", "a", "b", "a", "dir", "a", "st", "a", "a"]):
            if step == "a":
                a["global_step"] = i
                a["model"]["w"].add_(1)
                ck.save(a, f"{i}.pt").result()
            elif step == "b":
                ck.save(b, f"{i}.pt").result()
            elif step == "dir":
                ck.save_dir({"m.pt": b, "n.pt": {"k": torch.ones(9)}}, f"{i}").result()
            else:
                ck.save_dir({"model.safetensors": Safetensors({"z": torch.ones(5)}),
                             "o.pt": {"v": 1}}, f"{i}").result()
            if step == "a":
                ck.verify(f"{i}.pt")
                assert_same_state(torch.load(os.path.join(ckpt_dir, f"{i}.pt"),
                                             weights_only=False), a)
                assert_file_is_what_torch_save_writes(os.path.join(ckpt_dir, f"{i}.pt"), a)


def test_equal_containers_that_become_one_are_pickled_as_one(ckpt_dir: Any) -> None:
    state: dict[str, Any] = {"a": {"lr": 0.1}, "b": {"lr": 0.1}, "w": torch.ones(2)}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save(state, "a.pt").result()
        state["b"] = state["a"]
        ck.save(state, "b.pt").result()
        state["b"] = dict(state["a"])
        ck.save(state, "c.pt").result()
    b = torch.load(os.path.join(ckpt_dir, "b.pt"), weights_only=True)
    c = torch.load(os.path.join(ckpt_dir, "c.pt"), weights_only=True)
    assert b["a"] is b["b"]
    assert c["a"] is not c["b"] and c["a"] == c["b"]


@st.composite
def _states_and_leaves(draw: Any) -> tuple[Any, Any]:
    leaf = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.booleans(),
                     st.none())
    n = draw(st.integers(1, 40))
    tensors = {f"t{i}": torch.full((draw(st.integers(0, 3)),), float(i)) for i in range(3)}
    first = [draw(leaf) for _ in range(n)]
    second = [draw(leaf) for _ in range(n)]
    return ({"t": tensors, "leaves": first, "nested": {"x": tuple(first[:3])}},
            {"t": tensors, "leaves": second, "nested": {"x": tuple(second[:3])}})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(_states_and_leaves())
def test_spliced_leaves_are_pickled_as_pickle_does(pair: tuple[Any, Any]) -> None:
    first, second = pair
    cache = PlanCache()
    for state in (first, second, first):
        image = cache.plan(state)
        assert fastplan.same_layout(image, plan_torch_file(state))


@given(st.one_of(st.integers(-(2**80), 2**80), st.floats(allow_nan=True), st.booleans(),
                 st.none(), st.text(), st.text(alphabet=st.characters(codec="utf-8"))))
def test_a_leaf_is_encoded_as_pickle_protocol_2_encodes_it(value: Any) -> None:
    import pickle

    want = pickle.dumps(value, 2)[2:-1]
    if type(value) is str:
        assert want[-2:] == b"q\x00"  # BINPUT 0: the template keeps the memo entry
        want = want[:-2]
    assert encode(value) == want


class Config:
    def __init__(self, lr: float) -> None:
        self.lr = lr


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=300), st.integers(-5, 5)), min_size=1, max_size=12),
       st.lists(st.one_of(st.text(max_size=300), st.integers(-5, 5)), min_size=1, max_size=12))
def test_string_values_are_spliced_in_and_load_as_they_were(
        tmp_path_factory: Any, first: list[Any], second: list[Any]) -> None:
    """Strings are volatile leaves too (a checkpoint's path changes at every save). The file
    loads to the state's values and types; where no string is the very object of another, it
    is byte for byte ``torch.save``'s (``torch.save`` writes a shared string once)."""
    second = second[: len(first)] + first[len(second):]
    second = [b if type(b) is type(a) else a for a, b in zip(first, second)]  # same structure
    root = tmp_path_factory.mktemp("strings")
    with stagesave.Checkpointer(root, keep_last=None) as ck:
        for i, values in enumerate((first, second, first)):
            state = {"w": torch.ones(2), "values": [copy.copy(v) for v in values],
                     "paths": {"best": f"/ckpt/epoch={i}.ckpt"}}
            ck.save(state, f"{i}.pt").result()
            path = os.path.join(root, f"{i}.pt")
            assert_same_state(torch.load(path, weights_only=True), state)
            texts = [v for v in state["values"] if type(v) is str] + [state["paths"]["best"]]
            if len({id(t) for t in texts}) == len(texts):  # no string object twice
                assert_file_is_what_torch_save_writes(path, state)
        assert ck.plans._template is not None


def test_what_no_template_stands_for_is_planned_from_scratch_at_every_save(
        ckpt_dir: Any) -> None:
    state: dict[str, Any] = {"w": torch.ones(3), "cfg": Config(0.1)}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save(state, "a.pt").result()
        assert ck.plans._template is not None  # an object compared by its pickle
        state["cfg"].lr = 0.2  # changed inside: its pickle differs
        ck.save(state, "b.pt").result()
        state["w"].foo = "attribute"  # torch.save pickles tensors with attributes differently
        ck.save(state, "c.pt").result()
        assert ck.plans._template is None
    assert torch.load(os.path.join(ckpt_dir, "b.pt"), weights_only=False)["cfg"].lr == 0.2
    got = torch.load(os.path.join(ckpt_dir, "c.pt"), weights_only=False)
    assert got["w"].foo == "attribute"


def test_the_files_of_folder_checkpoints_reuse_their_plans_by_name(ckpt_dir: Any) -> None:
    state = base_state()
    weights = {"w": torch.randn(4, 4)}
    with stagesave.Checkpointer(ckpt_dir, keep_last=None) as ck:
        for i in range(4):
            state["global_step"] = i
            state["model"]["w"].add_(1)
            if i == 3:
                _move(state)
            ck.save_dir({"model.safetensors": Safetensors(weights), "optimizer.bin": state,
                         "rng.pkl": {"step": i}}, f"ckpt-{i}").result()
            if i == 0:
                template = ck.plans.of("optimizer.bin")._template
                assert template is not None
            assert ck.plans.of("optimizer.bin")._template is template
            ck.verify(f"ckpt-{i}")
            path = os.path.join(ckpt_dir, f"ckpt-{i}", "optimizer.bin")
            assert_same_state(torch.load(path, weights_only=False), state)
            assert_file_is_what_torch_save_writes(path, state)
            got = torch.load(os.path.join(ckpt_dir, f"ckpt-{i}", "rng.pkl"), weights_only=True)
            assert got == {"step": i}
    # closed: no template (no address, no view of host memory) is kept
    assert ck.plans._template is None and not ck.plans._files


def test_a_large_object_the_walk_does_not_look_into_is_not_pickled_twice(ckpt_dir: Any) -> None:
    """A numpy array of 1 MiB (or any object pickling to more than 64 KiB) is not compared by
    its pickle at every save: the state is planned from scratch each time, and saved right."""
    import numpy as np

    state: dict[str, Any] = {"w": torch.ones(3), "metrics": np.arange(1 << 17, dtype=np.float64),
                             "notes": Config(0.5)}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        for i in range(3):
            state["metrics"][0] = i
            ck.save(state, f"{i}.pt").result()
            assert ck.plans._template is None
            got = torch.load(os.path.join(ckpt_dir, f"{i}.pt"), weights_only=False)
            assert got["metrics"][0] == i and got["metrics"].shape == (1 << 17,)
        state["metrics"] = np.arange(10.0)  # small: compared by its pickle
        ck.save(state, "3.pt").result()
        assert ck.plans._template is not None
        state["metrics"][0] = 42.0
        ck.save(state, "4.pt").result()
    assert torch.load(os.path.join(ckpt_dir, "4.pt"), weights_only=False)["metrics"][0] == 42.0


def test_one_tensor_object_named_twice_keeps_the_plan_and_a_change_of_it_is_seen(
        ckpt_dir: Any) -> None:
    """Lightning's checkpoint names the monitored score tensor in two places: the template
    keeps that one object once; two objects over the same storage instead (same address, same
    shape) plan again, and back."""
    score = torch.tensor(0.5)
    state: dict[str, Any] = {"best": score, "top": {"a": score}, "w": torch.ones(3), "step": 0}
    with stagesave.Checkpointer(ckpt_dir, keep_last=None) as ck:
        ck.save(state, "a.pt").result()
        template = ck.plans._template
        assert template is not None
        state["step"] = 1
        ck.save(state, "b.pt").result()
        assert ck.plans._template is template
        state["top"]["a"] = score.view(())  # another object, same storage and address
        ck.save(state, "c.pt").result()
        state["top"]["a"] = state["best"]
        ck.save(state, "d.pt").result()
        state["best"] = torch.tensor(0.25)  # moved: a new score tensor in one of the places
        ck.save(state, "e.pt").result()
    for name, same in (("b.pt", True), ("c.pt", False), ("d.pt", True), ("e.pt", False)):
        path = os.path.join(ckpt_dir, name)
        got = torch.load(path, weights_only=True)
        assert (got["best"] is got["top"]["a"]) is same, name
        assert got["best"].untyped_storage().data_ptr() == got["top"]["a"].untyped_storage(
        ).data_ptr() or name == "e.pt"
    want = {"best": torch.tensor(0.25), "top": {"a": score}, "w": torch.ones(3), "step": 1}
    assert_file_is_what_torch_save_writes(os.path.join(ckpt_dir, "e.pt"), want)
