"""Restore from a writer agent's snapshot: a committed checkpoint still in shared memory.

When a trainer with ``writer="process"`` dies, its agent commits what it was handed and keeps
the segment holding the newest committed file (:mod:`stagesave.agent.segments`). A restart on
the same node finds it here: a snapshot counts only for the very file it was written as (its
path, its length and the serialization id in its proof), and only if its bytes match that
file's proof chunk by chunk. A resume then checks and loads the checkpoint from memory instead
of reading it from storage: ``latest()`` / ``resume_from()`` check the snapshot (the bytes the
load will use), and the load unpickles straight from a private copy-on-write mapping of it (no
copy, no read). A snapshot that does not match is removed with a warning and storage is used.

A snapshot is consumed by the first load that uses it (its name is removed; the memory lives
as long as the loaded tensors). ``stagesave gc --shm`` removes snapshots no one loaded.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import warnings
from typing import TYPE_CHECKING

from ..agent.segments import Snapshot, map_segment, owned_segments, read_snapshot, remove_segment
from ..ondisk.manifest import Manifest
from ..stores.base import Reader
from .proof import chunk_problems

if TYPE_CHECKING:  # torch: not imported by a writer agent, which verifies through this module
    from .image_load import Image

__all__ = ["checked_snapshot", "find_snapshot", "snapshot_image"]

_lock = threading.Lock()
#: Snapshots whose bytes this process matched against their file's proof.
_checked: set[tuple[str, str]] = set()


def find_snapshot(reader: Reader, manifest: Manifest) -> Snapshot | None:
    """The snapshot of exactly the file ``reader`` reads (``None``: there is none)."""
    entry = manifest.files[0]
    if entry.kind != "torch" or not entry.serialization_id:
        return None
    for segment in owned_segments():
        snap = read_snapshot(segment)
        if (snap is not None and snap.path == reader.where and snap.length == reader.size
                and snap.serialization_id == entry.serialization_id
                and snap.covered == entry.end):
            return snap
    return None


def _mapped(snap: Snapshot) -> memoryview | None:
    try:
        mem = map_segment(snap.segment, private=True)
    except (OSError, ValueError) as exc:
        warnings.warn(f"stagesave: the snapshot {snap.segment} of {snap.path} cannot be mapped "
                      f"({exc}); reading the checkpoint from storage", RuntimeWarning,
                      stacklevel=4)
        return None
    if len(mem) < snap.offset + snap.covered:
        mem.close()
        return None
    return memoryview(mem)[snap.offset : snap.offset + snap.covered]


def checked_snapshot(reader: Reader, manifest: Manifest, pool: cf.Executor
                     ) -> tuple[Snapshot, memoryview] | None:
    """The snapshot of ``reader``'s file with its bytes, if they match the file's proof (each
    checked once per process); a snapshot that does not match is removed with a warning."""
    snap = find_snapshot(reader, manifest)
    if snap is None:
        return None
    view = _mapped(snap)
    if view is None:
        return None
    key = (snap.segment, snap.serialization_id)
    with _lock:
        known = key in _checked
    if not known:
        problems = chunk_problems(None, manifest, pool, read=lambda lo, n: view[lo : lo + n],
                                  where=f"{snap.path} (snapshot in memory)")
        if problems:
            warnings.warn(f"stagesave: the snapshot of {snap.path} in memory does not match the "
                          f"file's proof ({problems[0]}); it is removed and the checkpoint is "
                          "read from storage", RuntimeWarning, stacklevel=4)
            remove_segment(snap.segment)
            return None
        with _lock:
            _checked.add(key)
    return snap, view


def snapshot_image(reader: Reader, manifest: Manifest, pool: cf.Executor) -> Image | None:
    """The image a load unpickles from the snapshot of ``reader``'s file (consumed), or
    ``None``. Its bytes are always matched against the proof, even for ``verify=False``: a
    trainer killed while staging its next save into the same segment leaves it torn."""
    got = checked_snapshot(reader, manifest, pool)
    if got is None:
        return None
    snap, view = got
    remove_segment(snap.segment)  # consumed: the mapping lives as long as the tensors
    head = bytes(view[:30])
    if head[:4] != b"PK\x03\x04":
        return None
    from .image_load import Image

    entry = manifest.files[0]
    pickle_at = 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    return Image(view, {s.key: s for s in entry.storages}, pickle_at, reader.where)

