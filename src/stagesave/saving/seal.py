"""Sealing a written file with its proof: a torch file's tail (index record, proof record,
central directory, summary), a trailer for DCP files, or the reserved place in a safetensors
header. Nothing of the proof can be written before every digest is known."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._crash import crash_point
from ..ondisk.checksum import crc32, digest
from ..ondisk.manifest import FileEntry, Manifest, Summary, dumps, proof_doc
from ..ondisk.names import INDEX_RECORD, PROOF_RECORD
from ..ondisk.signing import current as signing_keys
from ..ondisk.signing import sign_doc
from ..ondisk.torchzip import build_tail, footer
from ..stores.base import PendingWrite, Store
from .files import TRAILER_KINDS, FileToWrite, WriteStats
from .image import TensorEntry
from .index_json import encode_tensors, index_record

__all__ = ["Written", "blank_fill", "proof_value"]


def blank_fill(length: int) -> bytes:
    """What a reserved proof place holds while the chunks are hashed (and for verifying them)."""
    return b" " * length


def proof_value(proof: bytes, length: int) -> bytes:
    """The proof as a JSON string value, padded with spaces to exactly ``length`` bytes.

    Raises:
        ValueError: it does not fit (the reservation was computed too small: a bug).
    """
    value = json.dumps(proof.decode()).encode()[1:-1]  # escaped, without the quotes
    if len(value) > length:
        raise ValueError(f"the proof needs {len(value)} bytes, {length} were reserved")
    return value + b" " * (length - len(value))


class Written:
    """A file whose data is written and durable; :meth:`seal` adds its proof."""

    def __init__(
        self,
        store: Store,
        f: FileToWrite,
        pending: PendingWrite,
        entry: FileEntry,
        cd: bytes | None,
        write_late: Callable[[bytes], None],
        head: Callable[[], bytes],
    ) -> None:
        self.store = store
        self.name = f.name
        self.image = f.image
        self.pending = pending
        self.entry = entry
        self.cd = cd
        self._write_late = write_late
        self._head = head
        self.proof: bytes = b""
        self.length = entry.size
        #: Set by :meth:`seal`: the file's manifest as committed.
        self.manifest: Manifest | None = None

    @property
    def proof_crc(self) -> int:
        return crc32(self.proof)

    def seal(
        self, *, seq: int | None, created_ns: int, metadata: dict[str, Any],
        folder: dict[str, Any] | None = None, summary_folder: tuple[str, str] | None = None,
        tensors: Sequence[TensorEntry | dict[str, Any]] | None = None,
        telemetry: dict[str, Any] | None = None,
    ) -> Manifest:
        """Write the proof (never before every digest is known). Returns the file's manifest.

        Args:
            seq: The save's sequence number (``None`` for a folder's members: the carrier's counts).
            created_ns: Wall-clock time of the save, for display.
            metadata: The user's metadata.
            folder: The folder section of the proof (``None`` outside folders).
            summary_folder: ``(token, carrier name)`` for the summary of a folder's file.
            tensors: The tensor index (torch files; ``None``: the image's own, encoded once for
                every image of its plan). The returned manifest lists the entries given here,
                not the image's (they are in the file).
            telemetry: The save's telemetry so far (torch files).
        """
        kind = self.image.kind
        entry = self.entry
        crash_point("before_proof")
        if kind == "raw":
            self.manifest = Manifest(
                files=[entry], created_ns=created_ns, metadata=metadata, schema=2, seq=seq
            )
            return self.manifest
        zip_digests = None
        index = b""
        if kind == "torch":
            assert self.image.zip is not None and self.cd is not None
            encoded = (encode_tensors(tensors) if tensors is not None
                       else self.image.index_json.of(self.image.tensors)
                       if self.image.index_json is not None
                       else encode_tensors(self.image.tensors))
            index = index_record(encoded, telemetry or {})
            zip_digests = {
                "cd": digest(entry.algorithm, self.cd),
                "index": digest(entry.algorithm, index),
            }
        self.proof = dumps(
            sign_doc(
                proof_doc(
                    entry,
                    seq=seq,
                    created_ns=created_ns,
                    metadata=metadata,
                    folder=folder,
                    zip_digests=zip_digests,
                ),
                signing_keys(),
            )
        )
        token, carrier = summary_folder if summary_folder is not None else (None, None)

        def summary(proof_at: int) -> bytes:
            return Summary(
                kind, seq, created_ns, proof_at, len(self.proof), crc32(self.proof), token, carrier
            ).to_bytes()

        if kind == "torch":
            zip_ = self.image.zip
            assert zip_ is not None and self.cd is not None
            index_name = f"{zip_.prefix}/{INDEX_RECORD}".encode()
            proof_at = (
                zip_.cd_start
                + 30
                + len(index_name)
                + len(index)
                + 30
                + len(f"{zip_.prefix}/{PROOF_RECORD}")
            )
            tail, offsets = build_tail(
                zip_,
                self.cd,
                [(INDEX_RECORD, index), (PROOF_RECORD, self.proof)],
                summary(proof_at),
                crc32=crc32,
            )
            assert offsets[1] == proof_at
            self._tail(tail)
        elif kind in TRAILER_KINDS:
            s = summary(entry.end)
            self._tail(self.proof + s + footer(s, crc32))
        elif kind == "safetensors":
            assert self.image.blank is not None
            at, length = self.image.blank
            head = bytearray(self._head())
            head[at : at + length] = proof_value(self.proof, length)
            self._write_late(bytes(head))
        else:
            raise ValueError(f"no proof for files of kind {kind!r}")
        crash_point("after_proof")
        manifest = Manifest(
            files=[entry],
            created_ns=created_ns,
            tensors=[] if tensors is None else list(tensors),  # type: ignore[arg-type]
            metadata=metadata,
            telemetry=telemetry or {},
            schema=2,
            seq=seq,
        )
        self.manifest = manifest
        return manifest

    def _tail(self, tail: bytes) -> None:
        self.pending.write_tail(tail)
        self.length = self.entry.end + len(tail)

    def finish(self, stats: WriteStats) -> None:
        """Make the proof durable (the data already is)."""
        f0 = time.perf_counter()
        self.pending.finish()
        stats.fsync_s += time.perf_counter() - f0

    def publish(self) -> None:
        self.pending.publish()

    def abort(self) -> None:
        self.pending.abort()


