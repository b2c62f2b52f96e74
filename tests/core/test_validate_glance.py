"""The tensor index's and storage records' checks at a glance (the common entry) admit nothing
that the field-by-field checks refuse."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagesave.errors import ManifestError
from stagesave.ondisk import validate

_INT = st.one_of(st.integers(-2, 2**64), st.booleans(), st.floats(allow_nan=True), st.none(),
                 st.text(max_size=3))
_TEXT = st.one_of(st.text(max_size=70), st.integers(), st.none(), st.lists(st.text(), max_size=1))
_DIMS = st.one_of(st.lists(_INT, max_size=5), st.lists(st.integers(0, 2**40), max_size=5),
                  _INT)
_VALID = st.integers(0, 4).flatmap(lambda rank: st.fixed_dictionaries({
    "name": st.text(max_size=8), "dtype": st.sampled_from(["float32", "bfloat16"]),
    "shape": st.lists(st.integers(0, 2**62), min_size=rank, max_size=rank),
    "stride": st.lists(st.integers(0, 2**62), min_size=rank, max_size=rank),
    "storage_offset": st.integers(0, 2**62), "storage": st.text(max_size=3)}))
_ENTRY = st.one_of(_VALID, st.fixed_dictionaries(
    {"name": _TEXT, "dtype": _TEXT, "shape": _DIMS, "stride": _DIMS, "storage_offset": _INT,
     "storage": _TEXT},
    optional={"extra": st.integers()},
))


def _field_by_field(fn: Any, *args: Any) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(validate, "_plain_tensor", lambda t: False)
        try:
            return ("ok", fn(*args))
        except ManifestError as exc:
            return ("refused", str(exc))


@settings(max_examples=500, deadline=None)
@given(_ENTRY)
def test_an_entry_admitted_at_a_glance_passes_every_check(entry):
    slow = _field_by_field(validate._tensor, entry, 0, "probe")
    if validate._plain_tensor(entry):
        assert slow == ("ok", entry)
    try:
        fast: Any = ("ok", validate._tensor(entry, 0, "probe"))
    except ManifestError as exc:
        fast = ("refused", str(exc))
    assert fast == slow


@settings(max_examples=500, deadline=None)
@given(st.lists(st.lists(st.one_of(_TEXT, _INT), min_size=2, max_size=4), max_size=4),
       st.integers(0, 2**40))
def test_storage_records_admitted_at_a_glance_pass_every_check(raw, size):
    def run(check: Any) -> Any:
        try:
            return ("ok", check())
        except ManifestError as exc:
            return ("refused", str(exc))

    fast = run(lambda: validate.storages(raw, size, "probe", True))
    # the field-by-field check of each record, as objects (format 1's form of the same record)
    objects = [{"key": r[0], "offset": r[1], "nbytes": r[2]} if len(r) == 3 else r for r in raw]
    slow = run(lambda: validate.storages(objects, size, "probe", False))
    assert fast[0] == slow[0] or (fast[0] == "refused" and any(len(r) != 3 for r in raw))
    if fast[0] == "ok":
        assert fast == slow



def test_the_glance_admits_the_common_entry_and_nothing_unusual():
    entry = {"name": "w", "dtype": "float32", "shape": [2, 3], "stride": [3, 1],
             "storage_offset": 0, "storage": "0"}
    assert validate._plain_tensor(entry)
    for unusual in ({**entry, "x": 1}, {**entry, "stride": []}, {**entry, "shape": [True]},
                    {**entry, "shape": [2**62, 4]}, {**entry, "storage_offset": None}):
        assert not validate._plain_tensor(unusual), unusual
