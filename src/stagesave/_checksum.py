"""Chunk checksums.

A file is hashed in fixed-size chunks so that the hashing runs in parallel (in the same pass as
the staging copy, or in the writers, each hashing the slice it writes: ``checksum_in``) and a corrupt
byte can be located to its chunk.
All algorithms here release the GIL on large inputs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import blake3
import xxhash

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "Hasher", "check_algorithm", "digest", "hasher"]

Buffer = bytes | bytearray | memoryview


class Hasher(Protocol):
    """An incremental hash: feeding a chunk in pieces gives the digest of the whole chunk."""

    def update(self, data: Buffer, /) -> object: ...

    def hexdigest(self) -> str: ...

DEFAULT_ALGORITHM = "xxh3_128"


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
    "xxh3_128": _xxh3_128,
    "xxh3_64": _xxh3_64,
    "blake3": _blake3,
    "sha256": _sha256,
}

#: Length of the hex digest of each algorithm (used to validate manifests).
DIGEST_HEX_LEN = {"xxh3_128": 32, "xxh3_64": 16, "blake3": 64, "sha256": 64}


def check_algorithm(name: str) -> str:
    """Return ``name`` if it is a supported algorithm.

    Raises:
        ValueError: the algorithm is unknown; the message lists the supported ones.
    """
    if name not in ALGORITHMS:
        raise ValueError(
            f"unknown checksum algorithm {name!r}; choose one of {sorted(ALGORITHMS)} "
            f"({DEFAULT_ALGORITHM!r} is fast, 'blake3' and 'sha256' are cryptographic)"
        )
    return name


def digest(algorithm: str, data: Buffer) -> str:
    """Hex digest of ``data`` with ``algorithm``."""
    return ALGORITHMS[algorithm](data)


_INCREMENTAL: dict[str, Callable[[], Hasher]] = {
    "xxh3_128": xxhash.xxh3_128,
    "xxh3_64": xxhash.xxh3_64,
    "blake3": blake3.blake3,
    "sha256": hashlib.sha256,
}


def hasher(algorithm: str) -> Hasher:
    """A fresh incremental hasher whose ``hexdigest`` equals :func:`digest` of the bytes fed."""
    return _INCREMENTAL[algorithm]()
