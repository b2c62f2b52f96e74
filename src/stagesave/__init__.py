"""stagesave: checkpoints that cost training one copy into host memory.

Public API::

    ckpt = stagesave.Checkpointer("/ckpt", keep_last=3)
    handle = ckpt.save(state, "step-100.ckpt")   # returns after staging
    ...
    state = ckpt.load(ckpt.latest().path)       # verified, safe by default
"""

from __future__ import annotations

import os
from typing import Any

from .checkpointer import Checkpointer, flush_all, flush_on_sigterm
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    ClosedError,
    IntegrityError,
    ManifestError,
    MissingExtraError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedObjectError,
    UsageError,
)
from .handle import SaveHandle
from .ondisk.names import TMP_MARKER, is_temporary
from .restore.discovery import CheckpointInfo
from .safety import allow_globals, allowed_globals
from .stores.base import Store
from .stores.fsspec import FsspecStore
from .stores.local import LocalStore
from .stores.s3 import RetryPolicy, S3Store, abort_stale_multipart_uploads
from .stores.tiered import TieredStore
from .telemetry import SaveTelemetry

__version__ = "0.1.0"

__all__ = [
    "TMP_MARKER",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointPermissionError",
    "Checkpointer",
    "ClosedError",
    "FsspecStore",
    "IntegrityError",
    "LocalStore",
    "ManifestError",
    "MissingExtraError",
    "RetryPolicy",
    "S3Store",
    "SaveHandle",
    "SaveTelemetry",
    "StorageError",
    "Store",
    "TieredStore",
    "UnsafeCheckpointError",
    "UnsupportedObjectError",
    "UsageError",
    "abort_stale_multipart_uploads",
    "allow_globals",
    "allowed_globals",
    "flush_all",
    "flush_on_sigterm",
    "is_temporary",
    "latest",
    "list_checkpoints",
    "load",
    "save",
    "verify",
]


def save(state: Any, path: str | os.PathLike[str], **options: Any) -> SaveTelemetry:
    """Save ``state`` to ``path`` and wait until it is committed (one-off use).

    ``options`` are :class:`Checkpointer` arguments (``checksum=``, ``storage_options=``, ...).
    """
    with Checkpointer(**options) as ckpt:
        return ckpt.save(state, path).result()


def load(path: str | os.PathLike[str], map_location: Any = None, **options: Any) -> Any:
    """Load one checkpoint; ``verify``, ``mmap``, ``trusted`` and ``safe_globals`` as in
    :meth:`Checkpointer.load`, other options as in :class:`Checkpointer`."""
    load_keys = {"verify", "mmap", "trusted", "safe_globals"}
    load_opts = {k: options.pop(k) for k in list(options) if k in load_keys}
    with Checkpointer(**options) as ckpt:
        return ckpt.load(path, map_location, **load_opts)


def latest(
    root: str | os.PathLike[str], *, verify: bool = True, **options: Any
) -> CheckpointInfo | None:
    """The newest checkpoint directly in ``root`` that a resume can load (verified unless
    ``verify=False``), or ``None``: see :meth:`Checkpointer.latest`."""
    with Checkpointer(**options) as ckpt:
        return ckpt.latest(root, verify=verify)


def list_checkpoints(root: str | os.PathLike[str], **options: Any) -> list[CheckpointInfo]:
    """Every checkpoint directly in ``root``, newest first."""
    with Checkpointer(**options) as ckpt:
        return ckpt.list(root)


def verify(path: str | os.PathLike[str], **options: Any) -> CheckpointInfo:
    """Check every byte of a checkpoint against its manifest."""
    with Checkpointer(**options) as ckpt:
        return ckpt.verify(path)
