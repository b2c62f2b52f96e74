"""The compiled check of a tensor index says yes only where the Python parser does, and where it
does not know, the parser's verdict (its words) is the answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagesave.errors import ManifestError
from stagesave.ondisk import index_check_fast
from stagesave.ondisk.index_check_fast import check_index
from stagesave.ondisk.parse import parse_index
from stagesave.ondisk.validate import MAX_NUMEL, MAX_RANK


def _verdict(check, data: bytes) -> str | None:
    try:
        check(data, "f.ckpt")
    except ManifestError as exc:
        return str(exc)
    return None


def _entry(i: int) -> dict:
    return {"name": f"layer.{i}.w", "storage": str(i), "dtype": "float32", "shape": [2, 3],
            "stride": [3, 1], "storage_offset": 0}


_odd_values = st.sampled_from([
    None, True, False, -1, 0, 1, 1.0, 1.5, MAX_NUMEL, MAX_NUMEL + 1, 1 << 80, "", "x" * 65,
    "x" * 64, [], [1], [-1], [1.0], [True], [None], ["1"], [MAX_NUMEL, 2], [0] * (MAX_RANK + 1),
    {}, {"a": 1}, [[1]],
])
_DEEP = b"[" * 3000 + b"]" * 3000
_fields = st.sampled_from(["name", "storage", "dtype", "shape", "stride", "storage_offset", "x"])


@st.composite
def _documents(draw) -> bytes:
    entries = [_entry(i) for i in range(draw(st.integers(0, 4)))]
    for _ in range(draw(st.integers(0, 3))):
        if not entries:
            break
        e = entries[draw(st.integers(0, len(entries) - 1))]
        action = draw(st.sampled_from(["set", "delete"]))
        field = draw(_fields)
        if action == "set":
            e[field] = draw(_odd_values)
        else:
            e.pop(field, None)
    doc: dict = {"tensors": entries}
    tel = draw(st.sampled_from([None, {}, {"stage_s": 0.5}, {"stage_s": "x"}, [], 3,
                                {"blocking_s": 1 << 70}, {"note": "\u00e9"}, {"x": [1]},
                                {"x": {"y": 1}}, {"note": "{["}]))
    if tel is not None:
        doc["telemetry"] = tel
    if draw(st.booleans()):
        doc["other"] = draw(_odd_values)
    data = json.dumps(doc, separators=(",", ":")).encode()
    return draw(st.sampled_from([
        lambda d: d,
        lambda d: d.replace(b'"shape":[2,3]', b'"shape":[2,3],"shape":[-1]', 1),
        lambda d: d.replace(b'"shape":[2,3]', b'"shape":[-1],"shape":[2,3]', 1),
        lambda d: d.replace(b'"dtype":"float32"', b'"dtype":"\\ud800"', 1),
        lambda d: d.replace(b'"dtype":"float32"', b'"dtype":"\xff"', 1),
        lambda d: d.replace(b'"stage_s":0.5', b'"stage_s":NaN', 1),
        lambda d: d.replace(b'"stage_s":0.5', b'"stage_s":1e400', 1),
        lambda d: d.replace(b'"storage_offset":0', b'"storage_offset":0.0', 1),
        lambda d: d.replace(b'"storage_offset":0', b'"storage_offset":-0', 1),
        lambda d: d.replace(b'"storage_offset":0', b'"storage_offset":1e2', 1),
        lambda d: b"\xef\xbb\xbf" + d,
        lambda d: d.decode().encode("utf-16"),
        lambda d: d + b" x",
        lambda d: b"  " + d + b"\n",
        lambda d: b"[" + d + b"]",
        lambda d: d.replace(b'"tensors":', b'"deep":' + _DEEP + b',"tensors":', 1),
        lambda d: b"",
    ]))(data)


@settings(max_examples=3000, deadline=None)
@given(_documents())
def test_the_compiled_check_never_accepts_what_the_parser_refuses(data):
    theirs = _verdict(parse_index, data)
    assert _verdict(check_index, data) == theirs
    if index_check_fast._at_a_glance(data, "f.ckpt"):
        assert theirs is None


def test_a_common_index_is_accepted_without_the_parser(monkeypatch):
    monkeypatch.setattr(index_check_fast, "parse_index", None)  # called: a TypeError
    data = json.dumps({"tensors": [_entry(i) for i in range(1000)],
                       "telemetry": {"stage_s": 0.1}}).encode()
    check_index(data, "f.ckpt")


@pytest.mark.parametrize(("change", "words"), [
    ({"shape": [2, 3], "stride": [1]}, "stride must be a list as long as its shape"),
    ({"shape": [1 << 31, 1 << 31, 2], "stride": [2, 2, 1]}, "has more than"),
    ({"storage_offset": -1}, "storage_offset must be an integer"),
])
def test_an_entry_the_compiled_check_does_not_know_gets_the_parsers_words(change, words):
    data = json.dumps({"tensors": [_entry(0), {**_entry(1), **change}]}).encode()
    with pytest.raises(ManifestError, match=words):
        check_index(data, "f.ckpt")
