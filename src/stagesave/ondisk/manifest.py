"""The proof of a checkpoint: what was committed, and how to check it (the public face).

Format 2 (written by this version) keeps the proof *inside* each file; format 1 (sidecar
``*.stagesave.json`` files) is still read. The proof is three concepts, one module each:

- :mod:`stagesave.ondisk.model`: the data model (``Manifest``, ``FileEntry``, ``FolderProof``,
  ``Summary``...) and its JSON as written;
- :mod:`stagesave.ondisk.validate`: the checks every field of an untrusted proof passes (limits,
  checked arithmetic, the field named when refused);
- :mod:`stagesave.ondisk.parse`: the parsers (format-1 manifest, format-2 summary, proof record,
  tensor index).

This module re-exports the names the rest of stagesave uses from them.
"""

from __future__ import annotations

from .model import (
    FileEntry,
    FolderProof,
    Manifest,
    Member,
    StorageRecord,
    Summary,
    dumps,
    entry_doc,
    proof_doc,
)
from .names import SCHEMA_EMBEDDED
from .parse import parse_index, parse_manifest, parse_proof, parse_summary
from .validate import MAX_DEPTH, MAX_NUMEL, MAX_RANK, plain_json

__all__ = [
    "MAX_DEPTH", "MAX_NUMEL", "MAX_RANK", "SCHEMA_EMBEDDED", "FileEntry", "FolderProof",
    "Manifest", "Member", "StorageRecord", "Summary", "dumps", "entry_doc", "parse_index",
    "parse_manifest", "parse_proof", "parse_summary", "plain_json", "proof_doc",
]
