"""Named crash points for the fault-injection suite.

A test sets ``STAGESAVE_CRASH_AT=<point>[:<n>]`` in a child process; the n-th time (default the
first) that the save protocol reaches that point, the process SIGKILLs itself, exactly as a power
cut or an OOM kill would stop it. Without the variable a crash point costs one dict lookup.
A writer agent (``writer="process"``) runs the protocol with ``STAGESAVE_AGENT_CRASH_AT`` as its
``STAGESAVE_CRASH_AT`` (and never inherits the trainer's).
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["AGENT_ENV_VAR", "CRASH_POINTS", "ENV_VAR", "crash_point"]

ENV_VAR = "STAGESAVE_CRASH_AT"
AGENT_ENV_VAR = "STAGESAVE_AGENT_CRASH_AT"

#: Every point the protocol passes, in order (tests iterate over this).
CRASH_POINTS = (
    "before_data",
    "mid_data",
    "after_data",
    "after_data_fsync",
    "before_proof",
    "after_proof",
    "after_aside",
    "into_folder",
    "after_rename",
    "after_commit",
    "during_retention",
    "during_upload",
    # sharded (stagesave.dcp) saves
    "dcp_before_marker",
    "dcp_after_marker",
    "dcp_before_metadata",
    "dcp_after_metadata",
)

_counts: dict[str, int] = {}
_lock = threading.Lock()


def crash_point(name: str) -> None:
    """SIGKILL this process if the test-only environment variable names this point."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        hit = _counts[name] == (int(nth) if nth else 1)
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)
