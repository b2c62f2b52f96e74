"""What a path will be once the operations pending on it in this process ran.

A framework that decides names by asking the filesystem (Lightning's ``ModelCheckpoint``
versions ``name.ckpt`` as ``name-v1.ckpt`` when the file exists) would overwrite a checkpoint
whose save is still pending, and version past one whose removal is. The answer here counts the
last pending save or removal of the path (by any ``Checkpointer`` of the process, as
:mod:`.inflight` records them); with nothing pending, the filesystem has the answer.
"""

from __future__ import annotations

import os

from . import inflight

__all__ = ["path_key", "will_exist"]


def path_key(path: str) -> str:
    """The key pending operations on ``path`` are recorded under: a URL without its trailing
    slash, or the absolute local path."""
    return path.rstrip("/") if "://" in path else os.path.abspath(os.path.expanduser(path))


def will_exist(path: str) -> bool | None:
    """Whether ``path`` will exist once the operations pending on it ran (``True``: its last
    pending operation is a save; ``False``: a removal); ``None`` when nothing is pending on it
    (ask the filesystem)."""
    ops = [h for h in inflight.pending(path_key(path)) if h.kind in ("save", "remove")]
    return None if not ops else ops[-1].kind == "save"
