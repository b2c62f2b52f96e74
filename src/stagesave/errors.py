"""One exception family that also speaks built-in.

Every error stagesave raises derives from :class:`CheckpointError`, and each subclass also
derives from the built-in exception a caller would naturally catch (``FileNotFoundError`` for a
missing checkpoint, ``ValueError`` for a corrupt one, ...). Code written against plain
``torch.save``/``torch.load`` keeps catching what it caught before.
"""

from __future__ import annotations

import pickle

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointPermissionError",
    "ClosedError",
    "CommitTimeoutError",
    "IntegrityError",
    "ManifestError",
    "MissingExtraError",
    "StorageError",
    "UnsafeCheckpointError",
    "UnsupportedObjectError",
    "UsageError",
    "as_checkpoint_error",
    "oserror_to_checkpoint_error",
]


class CheckpointError(Exception):
    """Base class of every error raised by stagesave."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint (or the directory to write it into) does not exist."""


class CheckpointPermissionError(CheckpointError, PermissionError):
    """The target cannot be written or read with the current permissions."""


class StorageError(CheckpointError, OSError):
    """The storage failed: disk full, I/O error, a remote fault beyond the retry budget."""


class IntegrityError(CheckpointError, ValueError):
    """A checkpoint's bytes do not match its manifest (corrupt, truncated or torn)."""


class ManifestError(CheckpointError, ValueError):
    """A manifest is unreadable, malformed, from an unknown schema or otherwise refused."""


class UnsupportedObjectError(CheckpointError, TypeError):
    """The state contains an object that cannot be saved."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """Loading would need a global that is not allow-listed (it could run code)."""


class ClosedError(CheckpointError, RuntimeError):
    """The checkpointer was closed."""


class UsageError(CheckpointError, RuntimeError):
    """stagesave was called in an order or a state it does not support (a programming error
    in the caller or an integration, never a storage problem); the message says which call."""


class CommitTimeoutError(CheckpointError, TimeoutError):
    """A sharded save did not commit in time (a rank died, hung, or the coordinator did)."""


class MissingExtraError(CheckpointError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def oserror_to_checkpoint_error(exc: OSError, what: str) -> CheckpointError:
    """Map an ``OSError`` to the matching member of the family, with a message saying what failed.

    Args:
        exc: The original error (chained by the caller with ``raise ... from exc``).
        what: What stagesave was doing, e.g. ``"writing /ckpt/last.ckpt"``.
    """
    import errno

    reason = exc.strerror or str(exc)
    if isinstance(exc, FileNotFoundError):
        return CheckpointNotFoundError(f"{what}: {reason}. Check that the path exists.")
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM):
        return CheckpointPermissionError(
            f"{what}: {reason}. Check the permissions of the target directory."
        )
    if exc.errno == errno.EROFS:
        return CheckpointPermissionError(
            f"{what}: the filesystem is read-only. Choose a writable checkpoint directory."
        )
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageError(
            exc.errno,
            f"{what}: no space left on the device. Free space or lower the number of "
            "checkpoints kept; the previous checkpoint is untouched.",
        )
    return StorageError(exc.errno, f"{what}: {reason}")


def as_checkpoint_error(exc: BaseException, what: str) -> BaseException:
    """``exc`` as a :class:`CheckpointError` saying ``what`` failed (chained to ``exc``).

    Checkpoint errors pass through; an ``OSError`` becomes the matching storage error; other
    exceptions become :class:`StorageError`; ``BaseException``s that are not ``Exception``s
    (``KeyboardInterrupt``...) are returned as they are.
    """
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        err = oserror_to_checkpoint_error(exc, what)
    elif isinstance(exc, Exception):
        err = StorageError(f"{what}: {type(exc).__name__}: {exc}")
    else:
        return exc
    err.__cause__ = exc
    return err
