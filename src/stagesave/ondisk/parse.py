"""Reading a proof back: the format-1 sidecar manifest, and format 2's summary, proof record,
tensor index and folder proof.

Each parser takes the raw bytes and where they were read from, and returns the data model of
:mod:`stagesave.ondisk.model` only once every field passed the checks of
:mod:`stagesave.ondisk.validate` (and, with signing keys, the proof's signature checked).
The format-2 parsers say "invalid proof" where format 1 says "invalid manifest".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from ..errors import ManifestError
from .checksum import CRYPTOGRAPHIC, DIGEST_HEX_LEN
from .model import FileEntry, FolderProof, Manifest, Member, Summary
from .names import FORMAT_TAG, MAX_MANIFEST_BYTES, SCHEMA_EMBEDDED, SCHEMA_VERSION
from .signing import check_doc
from .signing import current as signing_keys
from .validate import (
    MAX_CHUNK,
    MAX_SEQ,
    algorithm,
    chunks,
    fail,
    file_entry,
    file_name,
    integer,
    json_object,
    kind,
    load_json,
    serialization_id,
    storages,
    string,
    telemetry,
    tensors,
)

__all__ = ["parse_index", "parse_manifest", "parse_proof", "parse_summary"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate a format-1 sidecar manifest read from ``where``.

    Raises:
        ManifestError: anything is wrong; the message names the manifest and the problem.
    """
    doc = load_json(data, where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_TAG:
        raise fail(where, "not a stagesave manifest")
    keys = signing_keys()
    if keys is not None and keys.require:
        raise fail(where, "format 1 cannot be signed, and signatures are required "
                          "(stagesave migrate rewrites it)")
    schema = doc.get("schema")
    if schema != SCHEMA_VERSION:
        raise fail(
            where,
            f"schema {schema!r} is not supported by this stagesave (reads schema "
            f"{SCHEMA_VERSION}); upgrade stagesave to read it",
        )
    created = integer(doc.get("created_ns"), "created_ns", where, 0, 1 << 64)
    files_doc = doc.get("files")
    if not isinstance(files_doc, list) or not files_doc or len(files_doc) > 1_000_000:
        raise fail(where, "files must be a non-empty list")
    files = [file_entry(f, where) for f in files_doc]
    if len({f.name for f in files}) != len(files):
        raise fail(where, "a file is listed twice")
    index = tensors(doc.get("tensors", []), where)
    metadata = json_object(doc.get("metadata", {}), "metadata", where)
    tel = telemetry(doc.get("telemetry", {}), where)
    return Manifest(files, created, index, metadata, tel, schema)


def _as_proof_error(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Say "proof" rather than "manifest" in the errors of the format-2 parsers."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except ManifestError as exc:
            message = str(exc).replace("invalid manifest ", "invalid proof ", 1)
            raise ManifestError(message) from None

    return wrapper


@_as_proof_error
def parse_summary(data: bytes, where: str) -> Summary:
    """Parse the summary at the end of a format-2 file.

    Raises:
        ManifestError: not a valid summary.
    """
    doc = load_json(data, where)
    if not isinstance(doc, dict) or doc.get("v") != SCHEMA_EMBEDDED:
        raise fail(where, "the summary is not of stagesave format 2 "
                          "(written by a newer stagesave?)")
    proof = doc.get("proof")
    if not isinstance(proof, list) or len(proof) != 3:
        raise fail(where, "the summary does not locate the proof")
    folder = doc.get("folder")
    carrier = doc.get("carrier")
    if folder is not None:
        folder = string(folder, "folder token", where, 64)
        carrier = file_name(carrier, where)
    seq = doc.get("seq")
    if seq is not None or folder is None:
        seq = integer(seq, "seq", where, 0, MAX_SEQ)
    return Summary(
        kind=kind(doc.get("kind"), where),
        seq=seq,
        created_ns=integer(doc.get("created_ns"), "created_ns", where, 0, 1 << 64),
        proof_offset=integer(proof[0], "proof offset", where),
        proof_len=integer(proof[1], "proof length", where, 1, MAX_MANIFEST_BYTES),
        proof_crc=integer(proof[2], "proof crc", where, 0, 0xFFFFFFFF),
        folder=folder,
        carrier=carrier,
    )


def _folder(doc: Any, where: str) -> FolderProof | None:
    """A carrier's folder proof: the save's token, and its members, listed and nested folders
    (each named once)."""
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise fail(where, "folder must be an object")
    token = string(doc.get("token"), "folder token", where, 64)
    carrier = file_name(doc.get("carrier"), where)
    members = []
    raw_members = doc.get("members", [])
    if not isinstance(raw_members, list) or len(raw_members) > 1_000_000:
        raise fail(where, "folder members must be a list")
    for m in raw_members:
        if not isinstance(m, list) or len(m) != 3:
            raise fail(where, "a folder member is not [name, size, proof_crc]")
        members.append(Member(file_name(m[0], where), integer(m[1], "member size", where),
                              integer(m[2], "member proof crc", where, 0, 0xFFFFFFFF)))
    raw_listed = doc.get("listed", [])
    if not isinstance(raw_listed, list) or len(raw_listed) > 1_000_000:
        raise fail(where, "folder listed files must be a list")
    listed = [file_entry(f, where) for f in raw_listed]
    raw_nested = doc.get("nested", [])
    if not isinstance(raw_nested, list) or len(raw_nested) > 100_000:
        raise fail(where, "nested folders must be a list")
    nested = [file_name(n, where) for n in raw_nested]
    proof = FolderProof(token, carrier, members, listed, nested)
    names = [carrier, *(m.name for m in members), *(f.name for f in listed), *nested]
    if len(set(names)) != len(names):
        raise fail(where, "a folder file is named twice")
    return proof


def _zip_digests(doc: dict[str, Any], algo: str, where: str) -> dict[str, str] | None:
    """A torch file's digests of its central directory and its index record."""
    zip_digests = doc.get("zip")
    hex_len = DIGEST_HEX_LEN[algo]
    if zip_digests is not None and (
        not isinstance(zip_digests, dict) or set(zip_digests) != {"cd", "index"}
        or not all(isinstance(v, str) and len(v) == hex_len for v in zip_digests.values())
    ):
        raise fail(where, "zip must hold the digests of the central directory and the index")
    return zip_digests


@_as_proof_error
def parse_proof(data: bytes, where: str, name: str, size: int) -> Manifest:
    """Parse and validate a format-2 proof of the file ``name`` of ``size`` bytes.

    Raises:
        ManifestError: anything is wrong; the message names the file and the problem.
    """
    doc = load_json(data, where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_TAG:
        raise fail(where, "not a stagesave proof")
    if doc.get("schema") != SCHEMA_EMBEDDED:
        raise fail(where, f"schema {doc.get('schema')!r} is not supported by this stagesave; "
                          "upgrade it")
    file_kind = kind(doc.get("kind"), where)
    covered = integer(doc.get("covered"), "covered", where, 0, size)
    algo = algorithm(doc, where)
    check_doc(doc, where, signing_keys(), cryptographic=algo in CRYPTOGRAPHIC)
    chunk_bytes = integer(doc.get("chunk_bytes"), "chunk_bytes", where, 1, MAX_CHUNK)
    digests = chunks(doc.get("chunks"), algo, covered, chunk_bytes, name, where)
    sid, id_offset = serialization_id(doc, covered, where)
    blank = doc.get("blank")
    if blank is not None:
        if not isinstance(blank, list) or len(blank) != 2:
            raise fail(where, "blank must be [offset, length]")
        lo = integer(blank[0], "blank offset", where, 0, covered)
        blank = (lo, integer(blank[1], "blank length", where, 0, covered - lo))
    zip_digests = _zip_digests(doc, algo, where)
    metadata = json_object(doc.get("metadata", {}), "metadata", where)
    entry = FileEntry(
        name=name, size=size, algorithm=algo, chunk_bytes=chunk_bytes, chunks=digests,
        kind=file_kind, serialization_id=sid, id_offset=id_offset,
        storages=storages(doc.get("storages", []), covered, where, compact=True),
        covered=covered, blank=blank,
    )
    manifest = Manifest(
        files=[entry], created_ns=integer(doc.get("created_ns"), "created_ns", where, 0, 1 << 64),
        metadata=metadata, schema=SCHEMA_EMBEDDED, folder=_folder(doc.get("folder"), where),
        zip_digests=zip_digests,
    )
    seq = doc.get("seq")
    if seq is not None or manifest.folder is None:
        manifest.seq = integer(seq, "seq", where, 0, MAX_SEQ)
    return manifest


@_as_proof_error
def parse_index(data: bytes, where: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The tensor index and telemetry of a format-2 torch file.

    Raises:
        ManifestError: not valid.
    """
    doc = load_json(data, where)
    if not isinstance(doc, dict):
        raise fail(where, "the index is not an object")
    return tensors(doc.get("tensors", []), where), telemetry(doc.get("telemetry", {}), where)
