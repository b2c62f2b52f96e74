"""What a proof holds: the data model of a checkpoint's proof, and its JSON as written.

Format 2 (written by this version) keeps the proof *inside* each file: a zip record of torch
files, a ``__metadata__`` entry of safetensors files, a trailer of files whose readers ignore
trailing bytes (sharded DCP files). A small *summary* closes every file that has a footer (torch
and trailer files): the save's sequence number and where the proof is, so that listing a
directory reads a few hundred bytes per checkpoint. Format 1 (sidecar ``*.stagesave.json``
files) is still read; it is written only by ``stagesave adopt``.

Reading these back (untrusted input) is :mod:`stagesave.ondisk.parse`'s work.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from .names import FORMAT_TAG, SCHEMA_EMBEDDED, SCHEMA_VERSION

__all__ = [
    "FileEntry", "FolderProof", "Manifest", "Member", "StorageRecord", "Summary", "dumps",
    "entry_doc", "proof_doc",
]


class StorageRecord(NamedTuple):
    """Where a storage's bytes lie in its file (a named tuple: a proof of 100,000 storages
    makes 100,000 of them, at every load)."""

    key: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class FileEntry:
    """One data file and the checksums that prove it.

    ``chunks`` cover ``[0, covered)`` (``covered`` defaults to ``size``); a format-2 file's
    bytes past ``covered`` (the zip tail, the trailer) are checked by rebuilding them from the
    proof. ``blank`` is a region hashed as spaces (the proof's own place in a safetensors header).
    """

    name: str
    size: int
    algorithm: str
    chunk_bytes: int
    chunks: tuple[str, ...]
    kind: str = "torch"
    serialization_id: str | None = None
    id_offset: int | None = None
    storages: tuple[StorageRecord, ...] = ()
    covered: int | None = None
    blank: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        """End of the bytes the chunks cover."""
        return self.size if self.covered is None else self.covered

    def chunk_range(self, i: int) -> tuple[int, int]:
        lo = i * self.chunk_bytes
        return lo, min(self.end, lo + self.chunk_bytes)


@dataclass(frozen=True)
class Member:
    """A file of a folder checkpoint that carries its own proof, as the folder's carrier pins it."""

    name: str
    size: int
    proof_crc: int


@dataclass
class FolderProof:
    """What makes a folder one checkpoint (format 2): a token shared by its files, and, in the
    carrier (the file written last), every other file of the folder.

    ``members`` carry their own proofs (the carrier pins each by size and the CRC of its proof);
    ``listed`` are files stagesave did not lay out (hook files, raw files): the carrier holds
    their checksums; ``nested`` are sub-folders that are folder checkpoints of their own (an
    FSDP checkpoint's DCP parts), each proven by its own carrier. A file in the folder that none
    of them names is not part of the checkpoint (the user's: kept, never read).
    """

    token: str
    carrier: str
    members: list[Member] = field(default_factory=list)
    listed: list[FileEntry] = field(default_factory=list)
    nested: list[str] = field(default_factory=list)

    def names(self) -> set[str]:
        return {self.carrier, *(m.name for m in self.members), *(f.name for f in self.listed)}

    def to_doc(self, with_files: bool) -> dict[str, Any]:
        doc: dict[str, Any] = {"token": self.token, "carrier": self.carrier}
        if with_files:
            doc["members"] = [[m.name, m.size, m.proof_crc] for m in self.members]
            doc["listed"] = [entry_doc(f) for f in self.listed]
            if self.nested:
                doc["nested"] = list(self.nested)
        return doc


@dataclass
class Manifest:
    files: list[FileEntry]
    created_ns: int
    tensors: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    telemetry: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION
    #: Format 2: the per-directory sequence number that orders checkpoints.
    seq: int | None = None
    #: Format 2, folder checkpoints: the folder's proof (from its carrier).
    folder: FolderProof | None = None
    #: Format 2, torch files: digests of the central directory and the index record.
    zip_digests: dict[str, str] | None = None
    #: A torch file's tensor index, its digest checked but not yet parsed (a load parses it
    #: while it reads: see :mod:`stagesave.restore.index_check`); ``None``: parsed, or none.
    pending_index: bytes | None = field(default=None, repr=False, compare=False)

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_json(self) -> bytes:
        """The format-1 sidecar JSON (written only by ``stagesave adopt``)."""
        doc = {
            "format": FORMAT_TAG,
            "schema": SCHEMA_VERSION,
            "created_ns": self.created_ns,
            "files": [entry_doc(f) for f in self.files],
            "tensors": self.tensors,
            "metadata": self.metadata,
            "telemetry": self.telemetry,
        }
        return dumps(doc)


def entry_doc(f: FileEntry) -> dict[str, Any]:
    """A file entry as format 1 (and a folder's listed files) write it."""
    left_out = ("chunks", "storages", "covered", "blank")
    doc = {k: v for k, v in asdict(f).items() if k not in left_out}
    doc["chunks"] = list(f.chunks)
    doc["storages"] = [s._asdict() for s in f.storages]
    return doc


def proof_doc(
    entry: FileEntry, *, seq: int | None, created_ns: int, metadata: dict[str, Any],
    folder: dict[str, Any] | None, zip_digests: dict[str, str] | None,
) -> dict[str, Any]:
    """The format-2 proof of one file, as a JSON document."""
    return {
        "format": FORMAT_TAG,
        "schema": SCHEMA_EMBEDDED,
        "kind": entry.kind,
        "seq": seq,
        "created_ns": created_ns,
        "covered": entry.end,
        "algorithm": entry.algorithm,
        "chunk_bytes": entry.chunk_bytes,
        "chunks": list(entry.chunks),
        "serialization_id": entry.serialization_id,
        "id_offset": entry.id_offset,
        "storages": [[s.key, s.offset, s.nbytes] for s in entry.storages],
        "blank": list(entry.blank) if entry.blank is not None else None,
        "zip": zip_digests,
        "metadata": metadata,
        "folder": folder,
    }


def dumps(doc: Any) -> bytes:
    """Compact JSON, refusing NaN and infinities (they are not JSON)."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True)
class Summary:
    """The few facts a listing needs, at the end of every torch/trailer file of format 2."""

    kind: str
    #: ``None`` for the files of a folder other than its carrier (the carrier's counts).
    seq: int | None
    created_ns: int
    proof_offset: int
    proof_len: int
    proof_crc: int
    folder: str | None = None
    carrier: str | None = None

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "v": SCHEMA_EMBEDDED, "kind": self.kind, "seq": self.seq,
            "created_ns": self.created_ns,
            "proof": [self.proof_offset, self.proof_len, self.proof_crc],
        }
        if self.folder is not None:
            doc["folder"] = self.folder
            doc["carrier"] = self.carrier
        return dumps(doc)
