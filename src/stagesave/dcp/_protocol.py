"""The sharded commit: every rank writes its own file, one coordinator commits the folder.

All of this runs on the checkpointer's background thread, and ranks coordinate only through the
store: no collective and no torch op ever runs here (either one was reported to switch libgomp's
worker threads to passive waiting and slow training while the thread lives; not reproduced by
``benchmarks/bench_omp.py`` on a 2-vCPU VM, kept as a precaution). The order:

1. every rank writes its data file (chunks in parallel, hashed after the copy or as written),
   publishes it inside the save's staging folder, and then writes its marker: its manifest entry;
2. the coordinator polls the store until every rank's marker is there and DCP handed it the
   global metadata (``finish()``): a rank that failed, in the background or while staging,
   leaves a failure marker instead, so the coordinator gives up at once; a rank that died leaves
   nothing, so it gives up at the deadline; a ``dcp.save`` that raised after the writes never
   calls ``finish()``, so it gives up shortly after the last marker. It then writes
   ``.metadata``, and the directory manifest naming every file last;
3. POSIX: the staging folder is a hidden temporary beside the target and the commit renames it
   into place (``_dircommit``: an existing folder is moved aside first and removed after), so a
   crash at any step leaves the previous checkpoint or none. Object stores cannot rename: the
   ranks write into the target, whose previous manifest stays until the new one replaces it; a
   torn overwrite is still never valid, because every rank file carries the save id the
   manifest names (``resolve_dir`` checks it) and a new save's files never carry the old id;
4. the other ranks learn the outcome from the store as well: the target's manifest names their
   save id (committed), or the staging folder vanished without it / the abort marker appeared
   (failed), or the deadline passed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._checksum import digest
from .._commit import FileToWrite, WriteStats, write_file
from .._crash import crash_point
from .._dircommit import _move_into_place, _remove_tree
from .._discovery import _read_manifest
from .._manifest import FileEntry, Manifest, parse_manifest
from .._names import DIR_MANIFEST
from .._store import Store
from ..errors import CheckpointError, ManifestError
from ._format import (
    ID_OFFSET,
    METADATA_FILE,
    RANK_FILE_KIND,
    SAVE_ID_KEY,
    abort_marker,
    failure_marker,
    marker_rank,
    rank_file,
    rank_marker,
)

__all__ = ["CommitTimeoutError", "MetadataSlot", "SavePlanData", "commit", "wait_for_commit", "write_rank"]

#: Polling the store starts this fast and slows down to ``_POLL_MAX`` (seconds).
_POLL_MIN = 0.005
_POLL_MAX = 0.25
#: Once every rank's part is durable, DCP's finish() (the metadata) is due within moments; a
#: coordinator whose dcp.save raised after the writes never calls it.
FINISH_GRACE_S = 60.0


class CommitTimeoutError(CheckpointError, TimeoutError):
    """A sharded save did not commit in time (a rank died, hung, or the coordinator did)."""


@dataclass(frozen=True)
class SavePlanData:
    """What the coordinator decides for one save and DCP's plan scatter hands to every rank."""

    rank: int
    world_size: int
    save_id: str
    #: Folder the ranks write into: a hidden temporary beside ``target`` on POSIX, else ``target``.
    staging: str
    target: str
    coordinator_pid: int

    @property
    def file_name(self) -> str:
        return rank_file(self.rank)

    @property
    def renames(self) -> bool:
        return self.staging != self.target


@dataclass
class MetadataSlot:
    """Hands DCP's global metadata from ``finish()`` (caller thread) to the commit job."""

    _event: threading.Event = field(default_factory=threading.Event)
    _value: tuple[bytes, list[dict[str, Any]]] | None = None
    _abandoned: str | None = None

    def fill(self, data: bytes, tensors: list[dict[str, Any]]) -> None:
        self._value = (data, tensors)
        self._event.set()

    def abandon(self, reason: str) -> None:
        if not self._event.is_set():
            self._abandoned = reason
            self._event.set()

    @property
    def pending(self) -> bool:
        return not self._event.is_set()

    def wait(self, deadline: float, what: str) -> tuple[bytes, list[dict[str, Any]]]:
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


# ----------------------------------------------------------------------------- every rank
def write_rank(
    store: Store,
    spec: SavePlanData,
    view: memoryview,
    size: int,
    digests: list[str] | None,
    *,
    algorithm: str,
    chunk_bytes: int,
    pool: Any,
    stats: WriteStats,
) -> FileEntry:
    """Write this rank's file into the staging folder, publish it there, then its marker."""
    entry, publish, abort = write_file(
        store,
        FileToWrite(_join(spec.staging, spec.file_name), view, size, RANK_FILE_KIND, spec.save_id,
                    ID_OFFSET, (), entry_name=spec.file_name, digests=digests),
        algorithm=algorithm, chunk_bytes=chunk_bytes, pool=pool, stats=stats,
    )
    try:
        publish()
    except BaseException:
        abort()
        raise
    crash_point("dcp_before_marker")
    marker = Manifest(files=[entry], created_ns=time.time_ns(),
                      metadata={SAVE_ID_KEY: spec.save_id, "rank": spec.rank})
    store.put_atomic(_join(spec.staging, rank_marker(spec.rank, os.getpid(), spec.save_id)), marker.to_json())
    crash_point("dcp_after_marker")
    return entry


def report_failure(store: Store, spec: SavePlanData, error: BaseException) -> None:
    """Tell the coordinator this rank's part failed, so it gives up now (best effort)."""
    try:
        store.put_atomic(_join(spec.staging, failure_marker(spec.rank, os.getpid(), spec.save_id)),
                         str(error).encode()[:4096])
    except Exception:  # noqa: BLE001, S110 - the coordinator still gives up at its deadline
        pass


# ----------------------------------------------------------------------------- coordinator
def _scan_markers(store: Store, spec: SavePlanData, what: str) -> dict[int, str]:
    """The markers present now, by rank; raise at once if a rank reported a failure."""
    found: dict[int, str] = {}
    for info in store.list(spec.staging):
        leaf = info.name.rpartition("/")[2]
        parsed = marker_rank(leaf, spec.save_id)
        if parsed is None:
            continue
        rank, failed = parsed
        if failed:
            reason = store.read_range(info.name, 0, 4096).decode(errors="replace")
            raise CheckpointError(f"{what}: rank {rank} failed to write its part ({reason}); "
                                  "the save was not committed")
        found[rank] = info.name
    return found


def _wait_for_ranks(
    store: Store, spec: SavePlanData, slot: MetadataSlot, deadline: float, what: str
) -> tuple[dict[int, str], tuple[bytes, list[dict[str, Any]]]]:
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


def _read_markers(store: Store, spec: SavePlanData, found: dict[int, str], what: str) -> list[FileEntry]:
    entries = []
    for rank in range(spec.world_size):
        name = found[rank]
        marker = parse_manifest(store.read_range(name, 0, store.info(name).size), store.describe(name))
        entry = marker.files[0]
        if marker.metadata.get(SAVE_ID_KEY) != spec.save_id or entry.name != rank_file(rank) \
                or entry.serialization_id != spec.save_id:
            raise ManifestError(f"{what}: the marker of rank {rank} ({store.describe(name)}) does not "
                                "describe this save's file")
        entries.append(entry)
    return entries


def commit(
    store: Store,
    spec: SavePlanData,
    slot: MetadataSlot,
    make_manifest: Callable[[list[FileEntry], list[dict[str, Any]]], Manifest],
    *,
    algorithm: str,
    chunk_bytes: int,
    deadline: float,
    what: str,
) -> None:
    """Wait for every rank, then write ``.metadata`` and the manifest and publish the folder."""
    found, (data, tensors) = _wait_for_ranks(store, spec, slot, deadline, what)
    entries = _read_markers(store, spec, found, what)
    crash_point("dcp_before_metadata")
    store.put_atomic(_join(spec.staging, METADATA_FILE), data)
    chunks = tuple(digest(algorithm, data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes))
    entries.append(FileEntry(METADATA_FILE, len(data), algorithm, chunk_bytes, chunks, "dcp-metadata"))
    crash_point("dcp_before_manifest")
    store.put_atomic(_join(spec.staging, DIR_MANIFEST), make_manifest(entries, tensors).to_json())
    crash_point("dcp_after_manifest")
    if spec.renames:
        _move_into_place(store, spec.staging, spec.target)
    for info in store.list(spec.target):
        if marker_rank(info.name.rpartition("/")[2], spec.save_id) is not None:
            store.delete(info.name)


def abandon(store: Store, spec: SavePlanData) -> None:
    """After a failed save: remove the staging folder (POSIX) or leave the abort marker."""
    try:
        if spec.renames:
            _remove_tree(store, spec.staging)
        else:
            store.put_atomic(_join(spec.staging, abort_marker(os.getpid(), spec.save_id)), b"aborted")
    except Exception:  # noqa: BLE001, S110 - debris only; gc removes it
        pass


# ----------------------------------------------------------------------------- other ranks
def _committed(store: Store, spec: SavePlanData) -> bool:
    try:
        manifest = _read_manifest(store, _join(spec.target, DIR_MANIFEST))
    except (FileNotFoundError, ManifestError, OSError):
        return False
    return manifest.metadata.get(SAVE_ID_KEY) == spec.save_id


def _staging_exists(store: Store, spec: SavePlanData) -> bool:
    path = store.local_path(spec.staging)
    return path is not None and os.path.isdir(path)


def wait_for_commit(store: Store, spec: SavePlanData, deadline: float, what: str) -> None:
    """Block until the coordinator committed this save; raise when it failed or timed out."""
    delay = _POLL_MIN
    abort_name = _join(spec.staging, abort_marker(spec.coordinator_pid, spec.save_id))
    while True:
        if spec.renames:
            # The rename is atomic: once the staging folder is gone, the target tells the outcome.
            if not _staging_exists(store, spec):
                if _committed(store, spec):
                    return
                raise CheckpointError(f"{what}: the coordinator gave up on this save (see its error); "
                                      "it was not committed")
        else:
            if _committed(store, spec):
                return
            try:
                store.info(abort_name)
                raise CheckpointError(f"{what}: the coordinator gave up on this save (see its error); "
                                      "it was not committed")
            except FileNotFoundError:
                pass
        if time.monotonic() >= deadline:
            raise CommitTimeoutError(
                f"{what}: the coordinator did not commit before the deadline (it may have died); "
                "the save was not committed"
            )
        delay = _sleep(delay)
