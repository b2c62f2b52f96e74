"""Whether the process named in a temporary's or an aside folder's name still runs.

stagesave writes its pid into the names of what a save leaves while it runs (temporaries,
folders moved aside during a replacement). A reader, ``gc`` and the repair every commit performs
all ask the same question of such a name: is its writer alive on this host? This is the one
answer. A zombie counts as dead (it will never finish its renames); a process we may not signal
counts as alive (someone else's). On a filesystem shared by several hosts a pid says nothing
about other hosts: callers there rely on age instead.
"""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int, *, ours_alive: bool = True) -> bool:
    """Whether process ``pid`` runs on this host (a zombie counts as dead).

    ``ours_alive=False``: this process's own pid counts as dead, for callers to whom names this
    process created are its own to clean (the commit protocol's repair, a listing deciding
    whether to wait for a mover).
    """
    if pid <= 0:
        return False
    if pid == os.getpid():
        return ours_alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # state is the field after the parenthesised command name
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
