"""The coordinator's side of a sharded save: wait for every rank's part (their markers), then
commit the folder with ``.metadata`` carrying the folder's proof, written last; leases and
giving a save up. See :mod:`._protocol` for the whole protocol and the other ranks' side."""

from __future__ import annotations

import json
import mmap
import re
import time
from typing import Any

from .._crash import crash_point
from ..errors import CheckpointError, CommitTimeoutError, ManifestError, as_checkpoint_error
from ..ondisk.checksum import digest
from ..ondisk.manifest import FileEntry, FolderProof, Manifest, Member
from ..ondisk.names import DIR_MANIFEST, is_temporary
from ..restore.discovery import next_seq
from ..saving.plan import FileImage
from ..saving.publish import remove_tree, rename_into_place, restore_aside
from ..saving.write import FileToWrite, WriteStats, write_data
from ..stores import posix as fsops
from ..stores.base import Store, check_name
from ._format import (
    MAX_MARKER_BYTES,
    METADATA_FILE,
    METADATA_KIND,
    marker_rank,
    rank_file,
)
from ._protocol import (
    FINISH_GRACE_S,
    POLL_MIN,
    MetadataSlot,
    SavePlanData,
    join,
    sleep,
)

__all__ = [
    "abandon", "check_extra_files", "clear_old_carrier", "commit", "put_extra_files", "take_lease",
]


# ----------------------------------------------------------------------------- coordinator
def clear_old_carrier(store: Store, target: str) -> None:
    """Object stores, before any rank writes into ``target``: remove the old folder's carrier
    (format 2 ``.metadata`` and a format-1 manifest), so that the old folder, about to be
    overwritten file by file, is never taken for valid."""
    store.delete(join(target, METADATA_FILE))
    store.delete(join(target, DIR_MANIFEST))


def _scan_markers(store: Store, spec: SavePlanData, what: str) -> dict[int, str]:
    """The markers present now, by rank; raise at once if a rank reported a failure."""
    found: dict[int, str] = {}
    for info in store.list(spec.markers):
        leaf = info.name.rpartition("/")[2]
        parsed = marker_rank(leaf, spec.save_id)
        if parsed is None:
            continue
        rank, failed = parsed
        if failed:
            reason = store.read_range(info.name, 0, MAX_MARKER_BYTES).decode(errors="replace")
            raise CheckpointError(f"{what}: rank {rank} failed to write its part ({reason}); "
                                  "the save was not committed")
        found[rank] = info.name
    return found


def _wait_for_ranks(
    store: Store, spec: SavePlanData, slot: MetadataSlot, deadline: float, what: str
) -> tuple[dict[int, str], bytes]:
    """Poll until every rank's marker is there and DCP handed over the metadata.

    Gives up at once when a rank reports a failure or the save is abandoned; at ``deadline``
    when a rank never finishes; and ``FINISH_GRACE_S`` after the last marker when the metadata
    never comes (``dcp.save`` raised after the writes, e.g. a lost peer during its gathers).
    """
    delay = POLL_MIN
    all_there_since: float | None = None
    while True:
        found = _scan_markers(store, spec, what)
        complete = all(r in found for r in range(spec.world_size))
        if not slot.pending:
            metadata = slot.wait(deadline, what)  # raises at once if the save was abandoned
            if complete:
                return found, metadata
        elif complete:
            all_there_since = all_there_since if all_there_since is not None else time.monotonic()
            if time.monotonic() - all_there_since > FINISH_GRACE_S:
                raise CheckpointError(
                    f"{what}: every rank wrote its part but dcp.save never reached finish() on the "
                    "coordinator (it raised); the save was not committed"
                )
        now = time.monotonic()
        if now >= deadline:
            missing = [r for r in range(spec.world_size) if r not in found]
            if not missing:
                slot.wait(now, what)  # raises the metadata timeout
            shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
            raise CommitTimeoutError(
                f"{what}: rank(s) {shown} did not finish writing their part before the commit "
                "deadline (killed, hung or too slow; raise commit_timeout for slow storage); "
                "the save was not committed and the previous checkpoint stays the latest"
            )
        delay = sleep(delay)


def _parse_marker(data: bytes, where: str, spec: SavePlanData, rank: int) -> Member:
    """A rank's marker, checked: it must describe this save's file of that rank.

    Raises:
        ManifestError: it does not.
    """
    try:
        doc = json.loads(data) if len(data) <= MAX_MARKER_BYTES else None
    except (ValueError, RecursionError):
        doc = None
    name = rank_file(rank)
    ok = (
        isinstance(doc, dict)
        and doc.get("save") == spec.save_id
        and doc.get("rank") == rank
        and doc.get("name") == name
        and all(
            isinstance(doc.get(k), int) and not isinstance(doc.get(k), bool)
            for k in ("size", "proof_crc")
        )
        and 0 <= doc["size"]
        and 0 <= doc["proof_crc"] <= 0xFFFFFFFF
    )
    if not ok:
        raise ManifestError(
            f"the marker of rank {rank} ({where}) does not describe this save's file {name}"
        )
    assert isinstance(doc, dict)
    return Member(name, doc["size"], doc["proof_crc"])


def _read_markers(store: Store, spec: SavePlanData, found: dict[int, str]) -> list[Member]:
    return [
        _parse_marker(
            store.read_range(found[r], 0, MAX_MARKER_BYTES + 1), store.describe(found[r]), spec, r
        )
        for r in range(spec.world_size)
    ]


def check_extra_files(files: dict[str, bytes]) -> None:
    """Refuse extra files that could not be files of their own in a DCP folder.

    Raises:
        ValueError: the name, and why.
    """
    for name in files:
        try:
            check_name(name)
        except ValueError as exc:
            raise ValueError(f"extra file {name!r}: {exc}") from exc
        if "/" in name or name == METADATA_FILE or name.endswith(".distcp") or is_temporary(name):
            raise ValueError(f"extra file {name!r}: not a plain file name of its own in a DCP "
                             "folder")


def put_extra_files(
    store: Store, staging: str, files: dict[str, bytes], *, local: bool, what: str,
) -> None:
    """Put the caller's extra files into the folder being assembled, each complete and durable
    when this returns (before any rank writes: the commit lists them in the folder's proof).

    On failure the folder, still this coordinator's alone, is removed (local) or the files
    written so far are (object stores), and the save fails before anything was staged.

    Raises:
        ValueError: a name that is not a plain file name or is one of DCP's.
        CheckpointError: a file could not be written.
    """
    check_extra_files(files)
    written = []
    try:
        for name, data in files.items():
            store.put_atomic(join(staging, name), bytes(data))
            written.append(join(staging, name))
    except BaseException as exc:
        if local:
            remove_tree(store, staging)
        else:
            for name in written:
                _quietly_delete(store, name)
        if isinstance(exc, Exception):
            raise as_checkpoint_error(exc, f"cannot write the extra files of {what}") from exc
        raise


def _list_extras(
    store: Store, spec: SavePlanData, members: list[Member], *, algorithm: str, chunk_bytes: int,
) -> list[FileEntry]:
    """POSIX: files something else put into the staging folder before the commit (Lightning's
    ``meta.pt``) become part of the checkpoint, listed in its proof with their checksums; stray
    temporaries are removed (the staging folder is this save's alone)."""
    ours = {m.name for m in members} | {METADATA_FILE}
    listed = []
    for info in store.list(spec.staging):
        leaf = info.name.rpartition("/")[2]
        if leaf in ours:
            continue
        if is_temporary(leaf):
            store.delete(info.name)
            continue
        with store.open(info.name) as reader:
            size = reader.size
            chunks = []
            for lo in range(0, size, chunk_bytes):
                data = reader.read(lo, min(chunk_bytes, size - lo))
                if len(data) != min(chunk_bytes, size - lo):
                    raise CheckpointError(
                        f"{reader.where} changed while it was being added to the checkpoint"
                    )
                chunks.append(digest(algorithm, data))
        listed.append(FileEntry(leaf, size, algorithm, chunk_bytes, tuple(chunks), kind="raw"))
    return listed


#: DCP's rank files (``FileSystemWriter``'s names): an older save's that this one did not write
#: are stale; any other file in the folder is the user's.
_RANK_FILE = re.compile(r"^__\d+_\d+\.distcp$")


def _clear_stale(store: Store, spec: SavePlanData, members: list[Member]) -> None:
    """Object stores: remove rank files of older saves (and stagesave's temporaries) in the
    target that this save did not write; the user's files stay."""
    keep = {m.name for m in members}
    for info in store.list(spec.target):
        leaf = info.name.rpartition("/")[2]
        if leaf not in keep and (_RANK_FILE.match(leaf) or is_temporary(leaf)):
            store.delete(info.name)


def _metadata_file(spec: SavePlanData, data: bytes) -> FileToWrite:
    """``.metadata`` as a file to write: the pickle in page-aligned memory (O_DIRECT can take
    it; the anonymous map is freed with the last view of it)."""
    mem = mmap.mmap(-1, -(-max(len(data), 1) // mmap.PAGESIZE) * mmap.PAGESIZE)
    mem[: len(data)] = data
    image = FileImage(
        size=len(data),
        pieces=[(0, data)],
        slots=[],
        serialization_id="",
        id_offset=0,
        kind=METADATA_KIND,
    )
    return FileToWrite(
        join(spec.staging, METADATA_FILE), image, memoryview(mem), entry_name=METADATA_FILE
    )


def commit(
    store: Store,
    spec: SavePlanData,
    slot: MetadataSlot,
    metadata: dict[str, Any],
    *,
    algorithm: str,
    chunk_bytes: int,
    pool: Any,
    stats: WriteStats,
    deadline: float,
    what: str,
) -> Manifest:
    """Wait for every rank, then write ``.metadata`` (the carrier) last and publish the folder.

    Returns the carrier's manifest (the folder's proof).
    """
    found, data = _wait_for_ranks(store, spec, slot, deadline, what)
    members = _read_markers(store, spec, found)
    crash_point("dcp_before_metadata")
    listed: list[FileEntry] = []
    if spec.renames:
        for name in found.values():  # temporaries never enter a committed folder
            store.delete(name)
        listed = _list_extras(store, spec, members, algorithm=algorithm, chunk_bytes=chunk_bytes)
    else:
        _clear_stale(store, spec, members)
    f = _metadata_file(spec, data)
    written = write_data(
        store, f, algorithm=algorithm, chunk_bytes=chunk_bytes, pool=pool, stats=stats
    )
    try:
        with store.commit_lock(spec.target):
            if spec.renames:
                restore_aside(store, spec.parent)
            seq = next_seq(store, spec.parent)
            folder = FolderProof(spec.save_id, METADATA_FILE, members, listed).to_doc(True)
            manifest = written.seal(
                seq=seq,
                created_ns=spec.created_ns,
                metadata=metadata,
                folder=folder,
                summary_folder=(spec.save_id, METADATA_FILE),
            )
            written.finish(stats)
            written.publish()
            crash_point("dcp_after_metadata")
            if spec.renames:
                src, dst = store.local_path(spec.staging), store.local_path(spec.target)
                assert src is not None and dst is not None
                fsops.fsync_dir(src)  # the markers' removal, durable before the folder appears
                rename_into_place(store, src, dst, spec.target)
            else:
                crash_point("after_rename")
                crash_point("after_commit")
    except BaseException:
        written.abort()
        raise
    store.folder_committed(spec.target)
    if not spec.renames:
        for name in found.values():
            _quietly_delete(store, name)
    _quietly_delete(store, spec.lease)  # only now: the commit is visible
    return manifest


def _quietly_delete(store: Store, name: str) -> None:
    try:
        store.delete(name)
    except Exception:  # noqa: BLE001, S110 - debris only; gc removes it
        pass


def take_lease(store: Store, spec: SavePlanData) -> None:
    """The coordinator, before the plans (and so any write) go out: hold the save's lease."""
    store.put_atomic(spec.lease, spec.save_id.encode())


def abandon(store: Store, spec: SavePlanData) -> None:
    """After a failed save: give up the lease (the other ranks stop waiting), then remove what
    the save wrote. POSIX: the staging folder. Object stores: the markers, and every file in the
    target (the old folder lost its carrier before this save wrote: what is left is garbage
    that would be listed as a corrupt checkpoint). A rank still writing removes what it writes
    after this once it sees the lease gone (:func:`discard_if_abandoned`); the lease goes first
    so that a rank whose write fails because its folder vanished knows why."""
    _quietly_delete(store, spec.lease)
    try:
        if spec.renames:
            remove_tree(store, spec.staging)
        else:
            for info in store.list(spec.markers):
                if marker_rank(info.name.rpartition("/")[2], spec.save_id) is not None:
                    _quietly_delete(store, info.name)
            for info in store.list(spec.target):
                _quietly_delete(store, info.name)
    except Exception:  # noqa: BLE001, S110 - debris only; gc removes it
        pass


