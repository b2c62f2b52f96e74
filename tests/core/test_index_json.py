"""The tensor index's JSON: msgspec's bytes are ``json.dumps``'s, and a plan's images share one
encoding that is made again whenever the entries are not the ones it encoded."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stagesave
from stagesave.saving import index_json
from stagesave.saving.image import TensorEntry
from stagesave.saving.index_json import IndexJson, encode_tensors, index_record


def _json(entries: list[TensorEntry]) -> bytes:
    return json.dumps(
        [{"name": e.name, "storage": e.storage_key, "dtype": e.dtype, "shape": list(e.shape),
          "stride": list(e.stride), "storage_offset": e.storage_offset} for e in entries],
        separators=(",", ":"), allow_nan=False).encode()


_ints = st.tuples() | st.lists(st.integers(0, 1 << 70), max_size=4).map(tuple)
_entries = st.lists(st.builds(
    TensorEntry,
    st.text(max_size=12) | st.sampled_from(
        ["null", "a:null", "x,null", "[null]", "w\u00e9", "\udc80", "\x00\x1f\x7f\"\\"]),
    st.text(alphabet="0123456789", min_size=1, max_size=3),
    st.sampled_from(["float32", "bfloat16", "int64"]), _ints, _ints, st.integers(0, 1 << 64),
), max_size=12)


@settings(max_examples=1500, deadline=None)
@given(_entries)
def test_the_entries_are_the_bytes_json_dumps_writes(entries):
    # (the entries a loader reads: numbers over 2**62 are left out since 2026-12-07)
    assert encode_tensors(entries) == _json(index_json.indexable(entries))
    telemetry = {"stage_s": 0.25, "note": "\u00e9"}
    assert index_record(encode_tensors(entries), telemetry) == json.dumps(
        {"tensors": json.loads(_json(index_json.indexable(entries))), "telemetry": telemetry},
        separators=(",", ":"), allow_nan=False).encode()


def test_dict_entries_and_values_json_refuses_are_json_dumps_own():
    entries = [{"name": "w", "dtype": "float32", "shape": [2]}]
    assert encode_tensors(entries) == json.dumps(entries, separators=(",", ":")).encode()
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        encode_tensors([TensorEntry("w", "0", "float32", (math.nan,), (1,), 0)])
    with pytest.raises(TypeError, match="not JSON serializable"):
        encode_tensors([TensorEntry("w", "0", "float32", (object(),), (1,), 0)])


def test_a_box_encodes_again_when_an_entry_is_another_object(monkeypatch):
    calls = []
    real = index_json.encode_tensors
    monkeypatch.setattr(index_json, "encode_tensors", lambda e: calls.append(1) or real(e))
    a = TensorEntry("a", "0", "float32", (2,), (1,), 0)
    box = IndexJson()
    first = box.of([a])
    assert box.of([a]) is first and len(calls) == 1  # the very same entries: kept
    changed = box.of([TensorEntry("a", "0", "float32", (3,), (1,), 0)])
    assert changed == _json([TensorEntry("a", "0", "float32", (3,), (1,), 0)])
    assert box.of([a, a]) == _json([a, a]) and len(calls) == 3


def _index_of(path) -> list[dict]:
    return stagesave.verify(path).manifest.tensors


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_every_save_writes_the_index_of_its_own_structure(tmp_path, writer):
    """Steady saves reuse their plan's encoded index; a changed structure (a renamed key, a new
    shape, a view) writes its own, for both writers."""
    state = {"w": torch.ones(4, 2), "m": {"v": torch.zeros(3)}, "step": 0}
    states = [
        state,
        {**state, "step": 1},                                     # steady: same index
        {"w2": torch.ones(4, 2), "m": {"v": torch.zeros(3)}, "step": 2},  # a name changed
        {"w2": torch.ones(2, 4), "m": {"v": torch.zeros(3)}, "step": 3},  # a shape changed
        {"w2": torch.ones(4, 2).t(), "m": {"v": torch.zeros(3)}, "step": 4},  # a stride
        {"w2": torch.ones(4, 2).t(), "m": {"v": torch.zeros(3)}, "step": 5},  # steady again
    ]
    with stagesave.Checkpointer(tmp_path, writer=writer) as ck:
        for i, s in enumerate(states):
            ck.save(s, f"s{i}.ckpt").result()
    for i, s in enumerate(states):
        expected = [
            (name, list(t.shape), list(t.stride()))
            for name, t in (("w" if "w" in s else "w2", s.get("w", s.get("w2"))),
                            ("m.v", s["m"]["v"]))
        ]
        got = [(t["name"], t["shape"], t["stride"]) for t in _index_of(tmp_path / f"s{i}.ckpt")]
        assert got == expected, i
