"""The sharded commit: every rank writes its own file, one coordinator commits the folder.

All of this runs on the checkpointer's background thread, and ranks coordinate only through the
store: no collective and no torch op ever runs here (either one was reported to switch libgomp's
worker threads to passive waiting and slow training while the thread lives; not reproduced by
``benchmarks/bench_omp.py`` on a 2-vCPU VM, kept as a precaution). The order:

1. every rank writes its data file (chunks in parallel, hashed while staging or as written),
   seals it with its own proof (a trailer naming the save's token and the carrier,
   ``.metadata``), publishes it in the save's staging folder, and then writes its marker: the
   file's size and the CRC of its proof;
2. the coordinator polls the store until every rank's marker is there and DCP handed it the
   global metadata (``finish()``): a rank that failed, in the background or while staging,
   leaves a failure marker instead, so the coordinator gives up at once; a rank that died leaves
   nothing, so it gives up at the deadline; a ``dcp.save`` that raised after the writes never
   calls ``finish()``, so it gives up shortly after the last marker. It then writes
   ``.metadata`` last, the folder's carrier: its proof pins every rank file (size and proof
   CRC) and holds the save's sequence number, taken under the directory's commit lock;
   whatever the outcome, it then gives up its lease (created before any rank wrote);
3. POSIX: the staging folder is a hidden temporary beside the target, the markers are removed
   from it, and the commit renames it into place (``_commit``: swapped with an existing folder
   where the filesystem can, else the old one moved aside first), so a crash at any step leaves
   the previous checkpoint or the new one, never a mix. Object stores cannot rename: the
   coordinator removes the old carrier before any rank writes (from then on the old folder is
   invalid, never half-valid), the ranks write into the target, the coordinator removes files
   the new save did not write, and the new ``.metadata`` written last is the commit. The
   markers sit in a hidden prefix beside the target there;
4. the other ranks learn the outcome from the store as well: the target's ``.metadata`` carries
   their save's token (committed), or the coordinator's lease is gone without it (failed: it
   goes only after the commit is visible), or the deadline passed (the coordinator died).
   Watching the staging folder instead would not do: a rank still writing may create it again
   after the coordinator removed it.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .._crash import crash_point
from ..errors import CheckpointError, CommitTimeoutError, ManifestError
from ..ondisk.checksum import digest
from ..ondisk.manifest import FileEntry, FolderProof, Manifest, Member, dumps
from ..ondisk.names import DIR_MANIFEST, is_temporary
from ..restore.discovery import next_seq
from ..restore.proof import peek
from ..saving.plan import FileImage
from ..saving.publish import remove_tree, rename_into_place, restore_aside
from ..saving.stage import ImageCrcs
from ..saving.write import FileToWrite, WriteStats, write_data
from ..stores import posix as fsops
from ..stores.base import Store
from ._format import (
    MAX_MARKER_BYTES,
    METADATA_FILE,
    METADATA_KIND,
    failure_marker,
    marker_rank,
    rank_file,
    rank_marker,
)

__all__ = [
    "CommitTimeoutError", "MetadataSlot", "SavePlanData", "abandon", "abandoned", "commit",
    "discard_if_abandoned", "gave_up_error", "take_lease", "wait_for_commit", "write_rank",
]

#: Polling the store starts this fast and slows down to ``_POLL_MAX`` (seconds).
_POLL_MIN = 0.005
_POLL_MAX = 0.25
#: Once every rank's part is durable, DCP's finish() (the metadata) is due within moments; a
#: coordinator whose dcp.save raised after the writes never calls it.
FINISH_GRACE_S = 60.0


@dataclass(frozen=True)
class SavePlanData:
    """What the coordinator decides for one save and DCP's plan scatter hands to every rank."""

    rank: int
    world_size: int
    #: The save's token: every file's proof names it, so a file of another save is never taken
    #: for part of this one.
    save_id: str
    #: Folder the ranks write into: a hidden temporary beside ``target`` on POSIX, else ``target``.
    staging: str
    target: str
    coordinator_pid: int
    #: Where the markers go: ``staging`` on POSIX, a hidden prefix beside ``target`` elsewhere.
    markers: str = ""
    #: The coordinator's lease, beside ``target``: exists while it works on the save.
    lease: str = ""
    #: Wall-clock time of the save (for display), the same in every file's proof.
    created_ns: int = 0

    @property
    def file_name(self) -> str:
        return rank_file(self.rank)

    @property
    def renames(self) -> bool:
        return self.staging != self.target

    @property
    def parent(self) -> str:
        return self.target.rpartition("/")[0]


@dataclass
class MetadataSlot:
    """Hands DCP's pickled global metadata from ``finish()`` (caller thread) to the commit job."""

    _event: threading.Event = field(default_factory=threading.Event)
    _value: bytes | None = None
    _abandoned: str | None = None

    def fill(self, data: bytes) -> None:
        self._value = data
        self._event.set()

    def abandon(self, reason: str) -> None:
        if not self._event.is_set():
            self._abandoned = reason
            self._event.set()

    @property
    def pending(self) -> bool:
        return not self._event.is_set()

    def wait(self, deadline: float, what: str) -> bytes:
        if not self._event.wait(max(0.0, deadline - time.monotonic())):
            raise CommitTimeoutError(
                f"{what}: dcp.save never handed over the global metadata (finish() was not "
                "called before the commit deadline); the save was not committed"
            )
        if self._value is None:
            raise CheckpointError(f"{what}: {self._abandoned}; the save was not committed")
        return self._value


def _join(parent: str, leaf: str) -> str:
    return f"{parent}/{leaf}" if parent else leaf


def _sleep(delay: float) -> float:
    time.sleep(delay)
    return min(_POLL_MAX, delay * 1.5)


def _member_proof(spec: SavePlanData) -> dict[str, Any]:
    return FolderProof(spec.save_id, METADATA_FILE).to_doc(False)


# ----------------------------------------------------------------------------- every rank
def write_rank(
    store: Store,
    spec: SavePlanData,
    image: FileImage,
    view: memoryview,
    crcs: ImageCrcs | None,
    *,
    algorithm: str,
    chunk_bytes: int,
    pool: Any,
    stats: WriteStats,
) -> Member:
    """Write this rank's file into the staging folder with its proof, publish it, then its
    marker."""
    f = FileToWrite(
        _join(spec.staging, spec.file_name), image, view, crcs, entry_name=spec.file_name
    )
    written = write_data(
        store, f, algorithm=algorithm, chunk_bytes=chunk_bytes, pool=pool, stats=stats
    )
    try:
        written.seal(seq=None, created_ns=spec.created_ns, metadata={}, folder=_member_proof(spec),
                     summary_folder=(spec.save_id, METADATA_FILE))
        written.finish(stats)
        written.publish()
    except BaseException:
        written.abort()
        raise
    member = Member(spec.file_name, written.length, written.proof_crc)
    crash_point("dcp_before_marker")
    marker = {"save": spec.save_id, "rank": spec.rank, "name": member.name, "size": member.size,
              "proof_crc": member.proof_crc}
    store.put_atomic(
        _join(spec.markers, rank_marker(spec.rank, os.getpid(), spec.save_id)), dumps(marker)
    )
    crash_point("dcp_after_marker")
    return member


def report_failure(store: Store, spec: SavePlanData, error: BaseException) -> None:
    """Tell the coordinator this rank's part failed, so it gives up now (best effort)."""
    try:
        store.put_atomic(_join(spec.markers, failure_marker(spec.rank, os.getpid(), spec.save_id)),
                         str(error).encode()[:MAX_MARKER_BYTES])
    except Exception:  # noqa: BLE001, S110 - the coordinator still gives up at its deadline
        pass


# ----------------------------------------------------------------------------- coordinator
def clear_old_carrier(store: Store, target: str) -> None:
    """Object stores, before any rank writes into ``target``: remove the old folder's carrier
    (format 2 ``.metadata`` and a format-1 manifest), so that the old folder, about to be
    overwritten file by file, is never taken for valid."""
    store.delete(_join(target, METADATA_FILE))
    store.delete(_join(target, DIR_MANIFEST))


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
    delay = _POLL_MIN
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
        delay = _sleep(delay)


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


def _clear_stale(store: Store, spec: SavePlanData, members: list[Member]) -> None:
    """Object stores: remove files of older saves in the target that this save did not write."""
    keep = {m.name for m in members}
    for info in store.list(spec.target):
        if info.name.rpartition("/")[2] not in keep:
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
        _join(spec.staging, METADATA_FILE), image, memoryview(mem), entry_name=METADATA_FILE
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


# ----------------------------------------------------------------------------- other ranks
def committed(store: Store, spec: SavePlanData) -> bool:
    """Whether the target's carrier is this save's (its summary names the save's token)."""
    return _is_ours(store, _join(spec.target, METADATA_FILE), spec)


def abandoned(store: Store, spec: SavePlanData) -> bool:
    """Whether the coordinator is done with the save without committing it (best effort)."""
    try:
        return not _holds_lease(store, spec) and not committed(store, spec)
    except OSError:
        return False


def discard_if_abandoned(store: Store, spec: SavePlanData) -> bool:
    """A rank whose part of a save failed, or that learnt the coordinator gave up: once the
    coordinator is done without committing, the staging folder is garbage (this rank may have
    created it again after the coordinator removed it): remove it (best effort).

    Returns whether the coordinator gave up.
    """
    if not abandoned(store, spec):
        return False
    try:
        if spec.renames:
            remove_tree(store, spec.staging)
        else:  # what this rank wrote after the coordinator cleared up
            if _is_ours(store, _join(spec.staging, spec.file_name), spec):
                store.delete(_join(spec.staging, spec.file_name))
            for marker in (rank_marker, failure_marker):
                store.delete(_join(spec.markers, marker(spec.rank, os.getpid(), spec.save_id)))
    except Exception:  # noqa: BLE001, S110 - debris only; gc removes it
        pass
    return True


def _is_ours(store: Store, name: str, spec: SavePlanData) -> bool:
    """Whether the file ``name`` was written by this save (its summary names the save's token)."""
    try:
        with store.open(name) as reader:
            summary = peek(reader).summary
    except OSError:
        return False
    return summary is not None and summary.folder == spec.save_id


def gave_up_error(what: str) -> CheckpointError:
    return CheckpointError(
        f"{what}: the coordinator gave up on this save (see its error); it was not committed"
    )


def _holds_lease(store: Store, spec: SavePlanData) -> bool:
    try:
        store.info(spec.lease)
    except FileNotFoundError:
        return False
    return True


def wait_for_commit(store: Store, spec: SavePlanData, deadline: float, what: str) -> None:
    """Block until the coordinator committed this save; raise when it failed or timed out."""
    delay = _POLL_MIN
    while True:
        if committed(store, spec):
            return
        # The lease goes only once the commit is visible: without it, the target tells the outcome.
        if not _holds_lease(store, spec):
            if committed(store, spec):
                return
            raise gave_up_error(what)
        if time.monotonic() >= deadline:
            raise CommitTimeoutError(
                f"{what}: the coordinator did not commit before the deadline (it may have died); "
                "the save was not committed"
            )
        delay = _sleep(delay)
