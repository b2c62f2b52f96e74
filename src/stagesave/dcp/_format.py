"""Names and layout of a sharded (DCP) checkpoint folder, defined once.

A committed folder holds exactly what torch's ``FileSystemWriter`` writes, and torch's own
``FileSystemReader`` (and ``dcp_to_torch_save``) reads it without stagesave:

- ``__<rank>_0.distcp``: one file per rank. Every item the rank wrote, each at a 64-byte aligned
  offset: a tensor as a complete ``torch.save`` zip of that tensor (exactly what
  ``FileSystemWriter`` writes), a non-tensor object as the bytes DCP's planner serialized. After
  the last item, the file's own proof as a trailer (kind ``"dcp"``): its chunk checksums and the
  save's token, then a summary and a footer. DCP reads items by ``(offset, length)``, so the
  trailer is invisible to it.
- ``.metadata``: DCP's pickled ``Metadata``, whose ``storage_data`` maps every item to
  ``(file, offset, length)``, followed by its proof as a trailer (kind ``"dcp-metadata"``;
  unpickling stops at the pickle's end). It is the folder's *carrier*, written last by the
  coordinator: its proof names every rank file (size and the CRC of its proof), the save's
  sequence number and the user's metadata. The folder is committed iff it is in place.

While a save is in flight each rank also leaves a small marker (its file's size and proof CRC)
that the coordinator collects before it commits, and the coordinator holds a *lease* beside the
target (created before any rank writes, removed once the save committed or failed) that tells
the other ranks whether it still works on the save. Markers and lease are temporaries (their
names carry the temporary marker, so an interrupted save's are debris that ``stagesave gc``
recognises) and never sit inside a committed folder: on POSIX the markers are in the staging
folder and removed before it is renamed into place; on object stores they are in a hidden
prefix beside the target.
"""

from __future__ import annotations

from ..ondisk.names import TMP_MARKER

__all__ = [
    "ITEM_ALIGNMENT",
    "METADATA_FILE",
    "METADATA_KIND",
    "RANK_FILE_KIND",
    "failure_marker",
    "lease",
    "rank_file",
    "rank_marker",
]

#: DCP's own name for the pickled metadata (``FileSystemWriter`` writes the same).
METADATA_FILE = ".metadata"
#: Kind of a rank file's proof (a trailer after the data).
RANK_FILE_KIND = "dcp"
#: Kind of ``.metadata``'s proof (a trailer after the pickle); the folder's carrier.
METADATA_KIND = "dcp-metadata"
#: Items start at multiples of this (torch's own record alignment inside a zip).
ITEM_ALIGNMENT = 64
#: Keys stagesave puts in the proof's ``metadata`` (beside the user's).
SAVE_ID_KEY = "dcp_save_id"
WORLD_SIZE_KEY = "dcp_world_size"
FORMAT_KEY = "format"
FORMAT_VALUE = "torch.distributed.checkpoint"
#: Largest marker the coordinator reads.
MAX_MARKER_BYTES = 4096


def rank_file(rank: int) -> str:
    """The data file of ``rank`` (``FileSystemWriter``'s naming for one file per rank)."""
    return f"__{rank}_0.distcp"


def rank_marker(rank: int, pid: int, save_id: str) -> str:
    """The marker a rank writes once its file is durable (its size and proof CRC, as JSON)."""
    return f".dcp-rank-{rank}.{pid}-{save_id}{TMP_MARKER}"


def failure_marker(rank: int, pid: int, save_id: str) -> str:
    """The marker a rank writes when its background write failed (the error message)."""
    return f".dcp-rank-{rank}-failed.{pid}-{save_id}{TMP_MARKER}"


def lease(leaf: str, pid: int, save_id: str) -> str:
    """Held by the coordinator of save ``save_id`` of the folder ``leaf``, beside it (the name
    adds at most 42 bytes to ``leaf``, within what ``check_target_name`` leaves)."""
    return f".{leaf}.dcp-lease.{pid}-{save_id[:8]}{TMP_MARKER}"


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
