"""What the writer is handed and what it reports: one file to write (its image and where its
bytes are staged) and the figures of a write."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .image import FileImage

__all__ = ["TRAILER_KINDS", "FileToWrite", "ImageCrcs", "WriteStats", "run_all"]


T = TypeVar("T")

#: Kinds whose proof is a trailer after the data (their readers ignore trailing bytes).
TRAILER_KINDS = frozenset({"dcp", "dcp-metadata"})


@dataclass
class ImageCrcs:
    """CRC-32s of a staged image: of every slot (its zip record's CRC) and of every chunk.

    Chunk ``i`` covers ``[i * chunk_bytes, (i + 1) * chunk_bytes)`` of ``[0, image.covered)``, as
    staged: before the zip CRC fields are filled in (:func:`.write.fill_crcs` updates
    the chunk CRCs for them).
    """

    slots: list[int]
    chunks: list[int]
    chunk_bytes: int
    #: Seconds spent hashing (summed over the threads, divided by their number).
    seconds: float = 0.0


@dataclass
class FileToWrite:
    """A staged file: ``view`` holds the image (host memory) unless ``device_data`` does."""

    name: str
    image: FileImage
    view: memoryview | None
    crcs: ImageCrcs | None = None
    #: With device staging: the image in device memory (a uint8 tensor), instead of ``view``.
    device_data: Any = None
    #: Name inside its folder (default: the last part of ``name``).
    entry_name: str | None = None


@dataclass
class WriteStats:
    write_s: float = 0.0
    checksum_s: float = 0.0
    fsync_s: float = 0.0
    direct_io: bool | None = None


def run_all(pool: cf.Executor, fn: Callable[[int], T], n: int) -> list[T]:
    """``[fn(0), ..., fn(n - 1)]`` on ``pool``; on failure, raise the first error in order only
    after every call has ended (``Executor.map`` would leave started calls running behind the
    caller's cleanup: writes into a closed or reused descriptor)."""
    futures: list[cf.Future[T]] = []
    try:
        for i in range(n):
            futures.append(pool.submit(fn, i))
    except BaseException:  # e.g. the pool shut down meanwhile: let the submitted ones end first
        for f in futures:
            f.cancel()
        cf.wait(futures)
        raise
    done, _ = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
    if any(f.exception() is not None for f in done):
        for f in futures:
            f.cancel()  # those not started yet
        cf.wait(futures)
    return [f.result() for f in futures]


