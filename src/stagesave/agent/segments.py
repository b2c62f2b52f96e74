"""Shared staging memory for a writer agent: files in a RAM filesystem, private to the user.

A segment is a file ``stagesave-<uid>-<token>.seg`` in :func:`shm_dir` (``/dev/shm`` by
default; ``STAGESAVE_SHM_DIR`` chooses another), created exclusively with mode 0600 and a
128-bit random token, never followed through a link, and mapped shared by the trainer (which
stages into it) and by its agent (which writes it out). A *snapshot* is a segment an agent kept
after its trainer died, holding the newest checkpoint it committed, described by a
``<segment>.json`` beside it: a restarted trainer loads from it (:mod:`.snapshot`) and
``stagesave gc`` removes those whose agent is gone.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import stat
import tempfile
import time
from dataclasses import asdict, dataclass

from ..stores import posix as fsops

__all__ = [
    "SEGMENT_SUFFIX", "Snapshot", "abandoned_segments", "create_segment", "map_segment",
    "mapped_paths", "owned_segments",
    "read_snapshot", "remove_segment", "shm_dir", "write_snapshot",
]

SEGMENT_SUFFIX = ".seg"
_ENV_DIR = "STAGESAVE_SHM_DIR"


def shm_dir() -> str:
    """Where segments live: ``$STAGESAVE_SHM_DIR``, else ``/dev/shm``, else the temp dir."""
    chosen = os.environ.get(_ENV_DIR)
    if chosen:
        return chosen
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _prefix() -> str:
    return f"stagesave-{os.getuid()}-"


def create_segment(capacity: int) -> tuple[str, mmap.mmap]:
    """A new private segment of ``capacity`` bytes, mapped shared: its path and its mapping.

    Raises:
        OSError: the RAM filesystem has no room or cannot be written.
    """
    path = os.path.join(shm_dir(), f"{_prefix()}{secrets.token_hex(16)}{SEGMENT_SUFFIX}")
    fd = fsops.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600)
    try:
        fsops.ftruncate(fd, capacity)
        # reserve the pages now: a full /dev/shm fails here with ENOSPC, not with SIGBUS later
        fsops.posix_fallocate(fd, 0, capacity)
        mem = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        remove_segment(path)
        raise
    os.close(fd)
    return path, mem


def _check_private(fd: int, path: str) -> int:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private segment of this user (mode 0600)")
    return st.st_size


def map_segment(path: str, *, private: bool = False) -> mmap.mmap:
    """Map an existing segment of this user (``private``: copy-on-write, for loading from it).

    Raises:
        PermissionError: it is not a regular file of this user with mode 0600.
        OSError: it does not exist.
    """
    fd = os.open(path, (os.O_RDONLY if private else os.O_RDWR) | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = _check_private(fd, path)
        if private:
            return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def remove_segment(path: str) -> None:
    """Remove a segment and its snapshot description, if there (mappings stay valid)."""
    for p in (path, path + ".json"):
        try:
            fsops.unlink(p)
        except FileNotFoundError:
            pass


def mapped_paths() -> set[str]:
    """Every file some process of this host maps (as far as ``/proc`` lets this user see)."""
    seen: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        seen.add(parts[5].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return seen


def abandoned_segments(directory: str | None = None, min_age_s: float = 10.0
                       ) -> list[tuple[str, int, str]]:
    """This user's segments no process maps any more (a trainer and its agent both died, or a
    snapshot no restart loaded): ``(path, bytes, what)`` for each, ``what`` being "snapshot of
    <checkpoint>" or "segment". Segments younger than ``min_age_s`` are left alone (one may be
    between its creation and its mapping)."""
    in_use = mapped_paths()
    now = time.time()
    found = []
    for path in owned_segments(directory):
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if path in in_use or now - st.st_mtime < min_age_s:
            continue
        snap = read_snapshot(path)
        found.append((path, st.st_size, f"snapshot of {snap.path}" if snap else "segment"))
    return found


def owned_segments(directory: str | None = None) -> list[str]:
    """Paths of this user's segments in ``directory`` (default :func:`shm_dir`)."""
    where = directory or shm_dir()
    try:
        names = os.listdir(where)
    except OSError:
        return []
    return sorted(os.path.join(where, n) for n in names
                  if n.startswith(_prefix()) and n.endswith(SEGMENT_SUFFIX))


@dataclass
class Snapshot:
    """A committed checkpoint's image kept in a segment after its trainer died.

    ``path``: the checkpoint as its store describes it (a local path or a URL); ``offset`` and
    ``covered``: where its image starts in the segment and how many bytes of the file it holds
    (the file's proof covers exactly those); ``length`` and ``serialization_id``: the committed
    file it must match; ``agent_pid``: the agent that kept it.
    """

    segment: str
    path: str
    offset: int
    covered: int
    length: int
    serialization_id: str
    agent_pid: int
    created_ns: int


def write_snapshot(snap: Snapshot) -> None:
    """Describe ``snap`` beside its segment (written to a temporary, then renamed)."""
    final = snap.segment + ".json"
    tmp = f"{final}.{secrets.token_hex(4)}.tmp"
    fd = fsops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(snap), f)
    fsops.rename(tmp, final)


def read_snapshot(segment: str) -> Snapshot | None:
    """The snapshot description of ``segment``; ``None`` if it has none (or not a valid one)."""
    try:
        fd = os.open(segment + ".json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        _check_private(fd, segment + ".json")
        with os.fdopen(fd, "r") as f:
            fd = -1
            doc = json.load(f)
        return Snapshot(**doc) if isinstance(doc, dict) else None
    except (OSError, ValueError, TypeError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)
