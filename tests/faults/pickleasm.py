"""Pickle programs written opcode by opcode (the way an attacker with write access to a
checkpoint would), shared by the safe-load tests."""

from __future__ import annotations

import struct


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(b)) + b


def num(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def raw(data: bytes) -> bytes:
    """bytes, as protocol 2 writes them: ``_codecs.encode(latin-1 text, 'latin1')``."""
    return glob("_codecs", "encode") + text(data.decode("latin1")) + text("latin1") + b"\x86R"


NONE, TRUE, FALSE, MARK, TUPLE, REDUCE, BUILD = b"N", b"\x88", b"\x89", b"(", b"t", b"R", b"b"
TUPLE1, TUPLE2, TUPLE3, EMPTY_TUPLE = b"\x85", b"\x86", b"\x87", b")"


def tup(*items: bytes) -> bytes:
    return MARK + b"".join(items) + TUPLE
