"""What a listing says of one checkpoint: :class:`CheckpointInfo`, and how checkpoints order.

"Newest" is the sequence number each format-2 save records (one more than the highest committed
in its directory), never the wall clock: format-2 checkpoints order by it, above everything
else; format-1 and plain files, which have none, order by their recorded time or mtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..ondisk.manifest import Manifest

__all__ = ["CHECKPOINT_SUFFIXES", "CheckpointInfo", "join", "replaced", "reread"]

#: Plain files with these suffixes are listed as (unverified) checkpoints.
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".tar", ".safetensors")


@dataclass
class CheckpointInfo:
    """A checkpoint found in a store."""

    path: str
    name: str
    status: str  # "committed" | "verified" | "unverified" | "corrupt"
    created: float
    size: int
    manifest: Manifest | None = None
    #: Format 1: the sidecar manifest that proves it (``None`` for format 2: the file itself).
    manifest_name: str | None = None
    problems: list[str] = field(default_factory=list)
    tier: str | None = None
    is_dir: bool = False
    #: Whether the checkpoint has a stagesave proof (matching or not).
    problems_from_manifest: bool = False
    #: The name that was judged: the target when ``name`` is a link inside the root.
    judged: str | None = None
    #: Format 2: the save's sequence number in its directory.
    seq: int | None = None
    #: 2: proof inside the file(s); 1: sidecar manifests; 0: no proof (a plain file).
    format: int = 0
    #: A folder: files in it that are not part of the checkpoint (the user's, kept; relative
    #: names). Never read as part of the checkpoint.
    beside: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return self.status in ("committed", "verified", "unverified")

    def order(self) -> tuple[int, float, float, str]:
        """Sort key, larger is newer: format 2 by sequence number, above everything else.

        Sequence number 0 marks a checkpoint migrated from format 1: it orders with those, by
        its original time (they all predate the first format-2 save of their directory).
        """
        if self.seq:
            return (1, float(self.seq), self.created, self.name)
        return (0, self.created, 0.0, self.name)


def join(directory: str, leaf: str) -> str:
    """``directory/leaf`` as a store names it (``leaf`` alone in the root)."""
    return f"{directory}/{leaf}" if directory else leaf


def replaced(exc: BaseException) -> bool:
    """Whether ``exc`` says the object was replaced by another writer while it was read (S3)."""
    return getattr(exc, "s3_code", None) == "PreconditionFailed"


T = TypeVar("T")


def reread(fn: Callable[[], T], attempts: int = 4) -> T:
    """``fn()``, started again when the object it reads was replaced meanwhile (S3: a ranged read
    of one version found another), so that a replacement is never reported as damage."""
    for attempt in range(attempts):
        try:
            return fn()
        except OSError as exc:
            if not replaced(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
