"""Chunk checksums.

A file is hashed in fixed-size chunks so that the hashing runs in parallel (in the same pass as
the staging copy, or in the writers, each hashing the slice it writes: ``checksum_in``) and a
corrupt byte can be located to its chunk.
All algorithms here release the GIL on large inputs.

The default is CRC-32 (the zip polynomial) through ISA-L, which runs at memory speed: the CRC of
a chunk's pieces, combined (:func:`crc32_combine`), gives both the chunk's checksum and the CRC of
every zip record, so one pass proves the file and makes it a valid zip. CRC-32 detects damage
(torn writes, bit rot, truncation), not tampering: ``blake3`` and ``sha256`` are the
cryptographic choices, and signed checkpoints require one of them.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from typing import Protocol

import blake3
import xxhash

_crc32: Callable[..., int]
_crc32_combine: Callable[[int, int, int], int] | None
try:  # ISA-L: CRC-32 at memory speed, GIL released
    from isal.isal_zlib import crc32 as _crc32
    from isal.isal_zlib import crc32_combine as _crc32_combine
except ImportError:  # pragma: no cover - platforms without an isal wheel: same values, slower
    _crc32 = zlib.crc32
    _crc32_combine = None

__all__ = [
    "ALGORITHMS", "CRYPTOGRAPHIC", "DEFAULT_ALGORITHM", "Hasher", "check_algorithm", "crc32",
    "crc32_combine", "crc32_patch", "digest", "hasher", "raw_crc32",
]

Buffer = bytes | bytearray | memoryview


class Hasher(Protocol):
    """An incremental hash: feeding a chunk in pieces gives the digest of the whole chunk."""

    def update(self, data: Buffer, /) -> object: ...

    def hexdigest(self) -> str: ...

DEFAULT_ALGORITHM = "crc32"
#: Algorithms that resist deliberate tampering (required to sign checkpoints).
CRYPTOGRAPHIC = frozenset({"blake3", "sha256"})


def crc32(data: Buffer, value: int = 0) -> int:
    """CRC-32 of ``data`` (zip's polynomial), continuing from ``value``."""
    return _crc32(data, value)


#: :func:`crc32` itself, ISA-L's (or zlib's) compiled function: for ``map`` over many buffers,
#: where a Python call per buffer would cost more than the hashing.
raw_crc32: Callable[..., int] = _crc32


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _combine_py(crc1: int, crc2: int, len2: int) -> int:  # pragma: no cover - zlib's algorithm
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << i for i in range(31)]
    even = [_gf2_times(odd, odd[i]) for i in range(32)]
    odd = [_gf2_times(even, even[i]) for i in range(32)]
    while True:
        even = [_gf2_times(odd, odd[i]) for i in range(32)]
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = [_gf2_times(even, even[i]) for i in range(32)]
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    if _crc32_combine is not None:
        return int(_crc32_combine(crc1, crc2, len2))
    return _combine_py(crc1, crc2, len2)


_ZEROS4 = crc32(bytes(4))


def crc32_patch(crc: int, length: int, at: int, old: bytes, new: bytes) -> int:
    """CRC-32 of a message of ``length`` bytes whose bytes at ``at`` changed from ``old`` to
    ``new``.

    CRC-32 is affine in the message, so the change costs a CRC of ``len(new)`` bytes and one
    shift, however long the message (used to fix a chunk's checksum after a zip CRC field in it
    was filled in).
    """
    delta = bytes(a ^ b for a, b in zip(old, new, strict=False))
    base = _ZEROS4 if len(delta) == 4 else crc32(bytes(len(delta)))
    return crc ^ crc32_combine(crc32(delta) ^ base, 0, length - at - len(delta))


def _crc32_hex(data: Buffer) -> str:
    return f"{crc32(data):08x}"


def _xxh3_128(data: Buffer) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _xxh3_64(data: Buffer) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _blake3(data: Buffer) -> str:
    # max_threads stays 1: the writer pool already hashes chunks in parallel.
    return blake3.blake3(data).hexdigest()


def _sha256(data: Buffer) -> str:
    return hashlib.sha256(data).hexdigest()


ALGORITHMS: dict[str, Callable[[Buffer], str]] = {
    "crc32": _crc32_hex,
    "xxh3_128": _xxh3_128,
    "xxh3_64": _xxh3_64,
    "blake3": _blake3,
    "sha256": _sha256,
}

#: Length of the hex digest of each algorithm (used to validate manifests).
DIGEST_HEX_LEN = {"crc32": 8, "xxh3_128": 32, "xxh3_64": 16, "blake3": 64, "sha256": 64}


def check_algorithm(name: str) -> str:
    """Return ``name`` if it is a supported algorithm.

    Raises:
        ValueError: the algorithm is unknown; the message lists the supported ones.
    """
    if name not in ALGORITHMS:
        raise ValueError(
            f"unknown checksum algorithm {name!r}; choose one of {sorted(ALGORITHMS)} "
            f"({DEFAULT_ALGORITHM!r} is the fastest, 'blake3' and 'sha256' are cryptographic)"
        )
    return name


def digest(algorithm: str, data: Buffer) -> str:
    """Hex digest of ``data`` with ``algorithm``."""
    return ALGORITHMS[algorithm](data)


class _Crc32Hasher:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Buffer, /) -> object:
        self.value = crc32(data, self.value)
        return None

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


_INCREMENTAL: dict[str, Callable[[], Hasher]] = {
    "crc32": _Crc32Hasher,
    "xxh3_128": xxhash.xxh3_128,
    "xxh3_64": xxhash.xxh3_64,
    "blake3": blake3.blake3,
    "sha256": hashlib.sha256,
}


def hasher(algorithm: str) -> Hasher:
    """A fresh incremental hasher whose ``hexdigest`` equals :func:`digest` of the bytes fed."""
    return _INCREMENTAL[algorithm]()
