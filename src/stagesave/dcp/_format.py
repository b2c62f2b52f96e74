"""Names and layout of a sharded (DCP) checkpoint folder, defined once.

A committed folder is a genuine ``torch.distributed.checkpoint`` folder that torch's own
``FileSystemReader`` (and ``dcp_to_torch_save``) reads without stagesave:

- ``__<rank>_0.distcp``: one file per rank. A 64-byte header carrying the save id, then every
  item the rank wrote, each at a 64-byte aligned offset: a tensor as a complete ``torch.save``
  zip of that tensor (exactly what ``FileSystemWriter`` writes), a non-tensor object as the
  bytes DCP's planner serialized.
- ``.metadata``: DCP's pickled ``Metadata``, whose ``storage_data`` maps every item to
  ``(file, offset, length)``.
- ``checkpoint.stagesave.json``: the core's directory manifest, written last (the commit): every
  rank file and ``.metadata`` with size and chunk digests; each rank file's entry names the save
  id and where the header carries it, so a stale file of equal size left by an older save is
  never taken for part of this one.

While a save is in flight each rank also leaves a small marker (its file's manifest entry) that
the coordinator collects before it commits; markers carry the temporary marker in their names,
so an interrupted save's markers are debris that ``stagesave gc`` recognises.
"""

from __future__ import annotations

from .._names import TMP_MARKER

__all__ = [
    "HEADER_BYTES",
    "ITEM_ALIGNMENT",
    "METADATA_FILE",
    "RANK_FILE_KIND",
    "abort_marker",
    "failure_marker",
    "header",
    "rank_file",
    "rank_marker",
]

#: DCP's own name for the pickled metadata (``FileSystemWriter`` writes the same).
METADATA_FILE = ".metadata"
#: ``FileEntry.kind`` of a rank file in the manifest.
RANK_FILE_KIND = "dcp"
#: Items start at multiples of this (torch's own record alignment inside a zip).
ITEM_ALIGNMENT = 64
#: Bytes before the first item: magic and the save id.
HEADER_BYTES = 64
_MAGIC = b"stagesave-dcp\n"
#: Where the save id sits in every rank file (recorded as the manifest's ``id_offset``).
ID_OFFSET = len(_MAGIC)
#: Keys stagesave puts in the global manifest's ``metadata``.
SAVE_ID_KEY = "dcp_save_id"
WORLD_SIZE_KEY = "dcp_world_size"
FORMAT_KEY = "format"
FORMAT_VALUE = "torch.distributed.checkpoint"


def rank_file(rank: int) -> str:
    """The data file of ``rank`` (``FileSystemWriter``'s naming for one file per rank)."""
    return f"__{rank}_0.distcp"


def header(save_id: str) -> bytes:
    """The first :data:`HEADER_BYTES` of every rank file of save ``save_id``."""
    data = _MAGIC + save_id.encode() + b"\n"
    if len(data) > HEADER_BYTES:
        raise ValueError(f"save id {save_id!r} is too long for the rank file header")
    return data.ljust(HEADER_BYTES, b"\x00")


def rank_marker(rank: int, pid: int, save_id: str) -> str:
    """The marker a rank writes once its file is durable (its manifest entry, as JSON)."""
    return f".dcp-rank-{rank}.{pid}-{save_id}{TMP_MARKER}"


def failure_marker(rank: int, pid: int, save_id: str) -> str:
    """The marker a rank writes when its background write failed (the error message)."""
    return f".dcp-rank-{rank}-failed.{pid}-{save_id}{TMP_MARKER}"


def abort_marker(pid: int, save_id: str) -> str:
    """Written by the coordinator on object stores when it gives up on a save."""
    return f".dcp-abort.{pid}-{save_id}{TMP_MARKER}"


def marker_rank(leaf: str, save_id: str) -> tuple[int, bool] | None:
    """``(rank, failed)`` for a marker name of save ``save_id``; ``None`` for anything else."""
    if not leaf.startswith(".dcp-rank-") or not leaf.endswith(f"-{save_id}{TMP_MARKER}"):
        return None
    head = leaf[len(".dcp-rank-") :].split(".", 1)[0]
    failed = head.endswith("-failed")
    digits = head.removesuffix("-failed")
    if not digits.isdigit():
        return None
    return int(digits), failed
