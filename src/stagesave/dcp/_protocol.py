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

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .._crash import crash_point
from ..errors import CheckpointError, CommitTimeoutError
from ..ondisk.manifest import FolderProof, Member, dumps
from ..restore.proof import peek
from ..saving.plan import FileImage
from ..saving.publish import remove_tree
from ..saving.stage import ImageCrcs
from ..saving.write import FileToWrite, WriteStats, write_data
from ..stores.base import Store
from ._format import (
    MAX_MARKER_BYTES,
    METADATA_FILE,
    failure_marker,
    rank_file,
    rank_marker,
)

__all__ = [
    "FINISH_GRACE_S", "POLL_MAX", "POLL_MIN", "SAVE_ID_ATTR", "CommitTimeoutError",
    "MetadataSlot", "SavePlanData", "abandoned", "committed", "discard_if_abandoned",
    "failed_saves", "gave_up_error", "join", "member_proof", "report_failure", "sleep",
    "wait_for_commit", "write_rank",
]

#: Polling the store starts this fast and slows down to ``POLL_MAX`` (seconds).
POLL_MIN = 0.005
POLL_MAX = 0.25
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


#: The attribute naming the save a rank job's failure belongs to (it survives the pickling of
#: DCP's collectives, which hand one rank's error to every rank).
SAVE_ID_ATTR = "stagesave_save_id"


def failed_saves(error: BaseException) -> set[str]:
    """The save ids of the rank jobs' failures in ``error``: itself, its causes, and each
    rank's error of a DCP ``CheckpointException``."""
    found: set[str] = set()
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        save_id = getattr(e, SAVE_ID_ATTR, None)
        if isinstance(save_id, str):
            found.add(save_id)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] for f in failures.values()
                        if isinstance(f, tuple) and f and isinstance(f[0], BaseException))
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return found


def join(parent: str, leaf: str) -> str:
    return f"{parent}/{leaf}" if parent else leaf


def sleep(delay: float) -> float:
    time.sleep(delay)
    return min(POLL_MAX, delay * 1.5)


def member_proof(spec: SavePlanData) -> dict[str, Any]:
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
        join(spec.staging, spec.file_name), image, view, crcs, entry_name=spec.file_name
    )
    written = write_data(
        store, f, algorithm=algorithm, chunk_bytes=chunk_bytes, pool=pool, stats=stats
    )
    try:
        written.seal(seq=None, created_ns=spec.created_ns, metadata={}, folder=member_proof(spec),
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
        join(spec.markers, rank_marker(spec.rank, os.getpid(), spec.save_id)), dumps(marker)
    )
    crash_point("dcp_after_marker")
    return member


def report_failure(store: Store, spec: SavePlanData, error: BaseException) -> None:
    """Tell the coordinator this rank's part failed, so it gives up now (best effort)."""
    try:
        store.put_atomic(join(spec.markers, failure_marker(spec.rank, os.getpid(), spec.save_id)),
                         str(error).encode()[:MAX_MARKER_BYTES])
    except Exception:  # noqa: BLE001, S110 - the coordinator still gives up at its deadline
        pass


# ----------------------------------------------------------------------------- other ranks
def committed(store: Store, spec: SavePlanData) -> bool:
    """Whether the target's carrier is this save's (its summary names the save's token)."""
    return _is_ours(store, join(spec.target, METADATA_FILE), spec)


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
            if _is_ours(store, join(spec.staging, spec.file_name), spec):
                store.delete(join(spec.staging, spec.file_name))
            for marker in (rank_marker, failure_marker):
                store.delete(join(spec.markers, marker(spec.rank, os.getpid(), spec.save_id)))
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
    delay = POLL_MIN
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
        delay = sleep(delay)
