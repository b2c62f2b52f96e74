"""Fuzzed safetensors files: a real file's header replaced, its length field changed, bits of
its header flipped or the file cut short (the security suite's and the kept image's tests)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

__all__ = ["fuzzed"]

_INT = st.integers(-(1 << 64), 1 << 65) | st.integers(0, 20000)
_ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F64", "I8", "BOOL", "U8", "F8_E4M3", "XX", ""])
        | st.integers(),
        "shape": st.lists(_INT, max_size=4) | st.just("x"),
        "data_offsets": st.lists(_INT, min_size=0, max_size=3),
    }
)
_HEADER = st.dictionaries(
    st.text(max_size=6), _ENTRY | st.none() | st.text(max_size=5), max_size=4
).map(lambda d: json.dumps(d).encode())


@st.composite
def fuzzed(draw, original: bytes) -> bytes:
    import struct

    n = struct.unpack("<Q", original[:8])[0]
    body = original[8 + n :]
    how = draw(st.sampled_from(["header", "length", "flip", "truncate"]))
    if how == "header":
        header = draw(_HEADER | st.binary(max_size=200))
        return struct.pack("<Q", len(header)) + header + body
    if how == "length":
        return struct.pack("<Q", draw(st.integers(0, (1 << 64) - 1))) + original[8:]
    if how == "flip":
        raw = bytearray(original)
        for _ in range(draw(st.integers(1, 8))):
            raw[draw(st.integers(0, 8 + n - 1))] ^= 1 << draw(st.integers(0, 7))
        return bytes(raw)
    return original[: draw(st.integers(0, len(original) - 1))]
