"""What a writer agent leaves once its trainer was SIGKILLed: checks shared by the framework
crash tests (Lightning, Accelerate, S3).

A module with a name of its own (not ``conftest``), importable from every test folder
(``tests/conftest.py`` puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from stagesave.agent.segments import owned_segments, read_snapshot


def exited(pid: int, timeout: float = 60.0) -> bool:
    """Whether process ``pid`` ends within ``timeout`` seconds (``os.kill(pid, 0)`` raising
    ``ProcessLookupError``). A zombie counts as ended: an orphaned agent is reparented to
    whichever process reaps orphans here, and a container's init may never reap it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rpartition(b")")[2].split()[0] == b"Z":
                    return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def agents_of(trainer_pid: int) -> list[int]:
    """The live writer agents that process ``trainer_pid`` started (an agent's command line
    names its trainer's pid), also once that trainer is gone."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if (len(argv) >= 5 and argv[1] == b"-c" and b"stagesave.agent.serve" in argv[2]
                and argv[4] == str(trainer_pid).encode()):
            found.append(int(entry))
    return found


def assert_only_snapshot_of(shm: Path, checkpoint: str | None) -> None:
    """``shm`` holds exactly the agent's snapshot of ``checkpoint`` (its segment and the
    segment's description), or nothing at all when ``checkpoint`` is ``None`` (folder
    checkpoints keep no snapshot)."""
    names = sorted(os.listdir(shm))
    if checkpoint is None:
        assert names == [], names
        return
    segments = owned_segments(str(shm))
    assert len(segments) == 1, names  # the newest committed file's segment, no other
    [segment] = segments
    assert names == sorted([os.path.basename(segment), os.path.basename(segment) + ".json"]), (
        names)
    snap = read_snapshot(segment)
    assert snap is not None, f"{segment} has no valid snapshot description"
    assert snap.path == checkpoint, (snap.path, checkpoint)

