"""Writing one file of format 2: its data, then its proof.

A staged image is written in two steps, so that the commit protocol (``commit.py``) can put the
proof in place at the right moment:

1. :func:`write_data` fills in the zip CRC of every storage record (computed while staging, or
   here from the buffer), updates the chunk checksums for those four-byte changes (CRC-32 is
   affine: no second pass), writes every chunk to an invisible temporary (hashing it as it goes
   when the algorithm is not CRC-32) and makes it durable;
2. :meth:`Written.seal` writes the proof: a torch file's tail (index record, proof record,
   central directory, summary), a trailer for DCP files, or the reserved place in a safetensors
   header (whose first pages are written only then). Nothing of the proof can be written
   before every digest is known.

Publishing (``finish`` + ``publish`` of the temporary) is the caller's: a file is committed iff
it exists under its final name, and every file carries everything needed to prove itself.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections.abc import Sequence
from typing import Any

from .._crash import crash_point
from ..ondisk.checksum import crc32_patch, digest
from ..ondisk.manifest import FileEntry, StorageRecord, dumps, proof_doc
from ..ondisk.names import ALIGNMENT
from ..ondisk.signing import current as signing_keys
from ..ondisk.signing import sign_doc
from ..stores.base import PendingWrite, Store
from .crc_pass import crc_image
from .files import TRAILER_KINDS, FileToWrite, ImageCrcs, WriteStats, run_all
from .image import FileImage
from .seal import Written, blank_fill, proof_value

__all__ = [
    "TRAILER_KINDS", "FileToWrite", "WriteStats", "Written", "blank_fill", "fill_crcs", "late_end",
    "proof_value", "run_all", "write_data",
]


def late_end(image: FileImage) -> int:
    """Bytes at the start of the file that can only be written with the proof (a safetensors
    header holding it), rounded up to whole pages for O_DIRECT."""
    if image.blank is None:
        return 0
    end = image.blank[0] + image.blank[1]
    return min(image.covered, (end + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)


def fill_crcs(image: FileImage, view: memoryview, crcs: ImageCrcs) -> list[tuple[int, bytes]]:
    """Write each storage record's CRC into its data descriptor in ``view``; update the chunk
    CRCs of ``crcs`` to match. Returns the ``(offset, bytes)`` written."""
    written = []
    cb = crcs.chunk_bytes
    for i, at in enumerate(image.crc_fields):
        if at < 0:
            continue
        new = crcs.slots[i].to_bytes(4, "little")
        old = bytes(view[at : at + 4])
        if old == new:
            continue
        view[at : at + 4] = new
        written.append((at, new))
        for b in range(4):  # a field may straddle two chunks: patch byte by byte where it does
            if (at + b) // cb != at // cb:
                break
        else:
            c = at // cb
            crcs.chunks[c] = crc32_patch(
                crcs.chunks[c], min(cb, image.covered - c * cb), at - c * cb, old, new
            )
            continue
        for b in range(4):
            c = (at + b) // cb
            crcs.chunks[c] = crc32_patch(crcs.chunks[c], min(cb, image.covered - c * cb),
                                         at + b - c * cb, old[b : b + 1], new[b : b + 1])
    return written


def flush_data(pending: PendingWrite, stats: WriteStats) -> None:
    """Make every chunk written so far durable (the end of step 1), timed into ``stats``."""
    crash_point("after_data")
    f0 = time.perf_counter()
    pending.flush()
    stats.fsync_s += time.perf_counter() - f0
    crash_point("after_data_fsync")


def entry_of(f: FileToWrite, algorithm: str, chunk_bytes: int, digests: Sequence[str]) -> FileEntry:
    image = f.image
    return FileEntry(
        name=f.entry_name or f.name.rsplit("/", 1)[-1],
        size=image.covered,
        algorithm=algorithm,
        chunk_bytes=chunk_bytes,
        chunks=tuple(digests),
        kind=image.kind,
        serialization_id=image.serialization_id or None,
        id_offset=image.id_offset if image.serialization_id else None,
        storages=tuple(StorageRecord(s.key, s.offset, s.nbytes) for s in image.slots),
        covered=image.covered,
        blank=image.blank,
    )


def write_data(
    store: Store,
    f: FileToWrite,
    *,
    algorithm: str,
    chunk_bytes: int,
    pool: cf.Executor,
    stats: WriteStats,
) -> Written:
    """Step 1 for a file staged in host memory: CRCs filled in, every chunk written and durable.

    Raises:
        Whatever the store raises; the temporary is removed first.
    """
    assert f.view is not None, "device images go through _device.write_device_data"
    t0 = time.perf_counter()
    image, view = f.image, f.view
    covered = image.covered
    crcs = f.crcs
    if crcs is None and (image.kind == "torch" or algorithm == "crc32"):
        h0 = time.perf_counter()
        crcs = crc_image(image, view, chunk_bytes=chunk_bytes, pool=pool)
        stats.checksum_s += time.perf_counter() - h0
    cd = None
    if image.kind == "torch":
        assert image.zip is not None and crcs is not None
        fill_crcs(image, view, crcs)
        cd = image.zip.with_crcs({f"{image.zip.prefix}/data/{s.key}": crcs.slots[i]
                                  for i, s in enumerate(image.slots)})
    pre = [f"{c:08x}" for c in crcs.chunks] if crcs is not None and algorithm == "crc32" else None
    late = late_end(image)
    crash_point("before_data")
    pending = store.begin_write(f.name, view, covered, tail=image.kind in ("torch", *TRAILER_KINDS))
    try:
        n_chunks = (covered + chunk_bytes - 1) // chunk_bytes
        hash_time = [0.0] * n_chunks

        def one(i: int) -> str:
            lo, hi = i * chunk_bytes, min(covered, (i + 1) * chunk_bytes)
            if pre is not None:
                d = pre[i]
            else:
                h0 = time.perf_counter()
                d = digest(algorithm, view[lo:hi])
                hash_time[i] = time.perf_counter() - h0
            if max(lo, late) < hi:
                pending.write_range(max(lo, late), hi)
            if i == 0 and n_chunks > 1:
                crash_point("mid_data")
            return d

        digests = run_all(pool, one, n_chunks)
        flush_data(pending, stats)
    except BaseException:
        pending.abort()
        raise
    stats.checksum_s += sum(hash_time)
    stats.write_s += time.perf_counter() - t0
    stats.direct_io = getattr(pending, "direct", None)

    def write_late(data: bytes) -> None:
        view[: len(data)] = data
        pending.write_range(0, len(data))

    def head() -> bytes:
        return bytes(view[:late])

    return Written(
        store, f, pending, entry_of(f, algorithm, chunk_bytes, digests), cd, write_late, head
    )


def proof_room(
    size: int, storages: Sequence[Sequence[object]], *, algorithm: str, chunk_bytes: int,
    metadata: dict[str, Any], folder: dict[str, Any] | None,
) -> int:
    """Bytes to reserve in a safetensors header for the proof of a ``size``-byte file.

    The proof is built with the widest value of every field (one chunk more than needed, the
    largest sequence number and times), escaped as a JSON string, plus a margin.
    """
    from ..ondisk.checksum import DIGEST_HEX_LEN

    n = (size + chunk_bytes - 1) // chunk_bytes + 1
    entry = FileEntry(
        name="x",
        size=size,
        algorithm=algorithm,
        chunk_bytes=chunk_bytes,
        chunks=("f" * DIGEST_HEX_LEN[algorithm],) * n,
        kind="safetensors",
        storages=tuple(StorageRecord(str(s[0]), size, size) for s in storages),
        covered=size,
        blank=(size, size),
    )
    doc = sign_doc(
        proof_doc(
            entry,
            seq=1 << 62,
            created_ns=1 << 64,
            metadata=metadata,
            folder=folder,
            zip_digests=None,
        ),
        signing_keys(),
    )
    return len(json.dumps(dumps(doc).decode())) - 2 + 64
