"""The storage contract: a handful of operations every backend implements.

A checkpoint root is a store; names inside it are relative POSIX paths (``last.ckpt``,
``checkpoint_3/model.safetensors``). Writing a data file happens in three steps so that the
commit protocol (``_commit.py``) can order them: ``begin_write`` opens an invisible temporary
(a temp file, a multipart upload), ``PendingWrite.write_range`` fills it from the staging buffer
(thread-safe, called in parallel on disjoint ranges), ``finish`` makes it durable and ``publish``
makes it visible under its final name atomically. Small metadata goes through ``put_atomic``.
A folder checkpoint on a local root is assembled elsewhere and renamed into place
(``_dircommit.py``); the store hears of that commit through ``folder_committed``.
"""

from __future__ import annotations

import builtins
import contextlib
import posixpath
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass

__all__ = ["ObjectInfo", "PendingWrite", "Store", "check_name"]


@dataclass(frozen=True)
class ObjectInfo:
    """A file in a store."""

    name: str
    size: int
    mtime: float


def check_name(name: str) -> str:
    """Validate a name inside a store: relative, normalized, no traversal, no URL.

    Raises:
        ValueError: the name could escape the store root.
    """
    if (
        not name
        or "\x00" in name
        or "://" in name
        or name.startswith(("/", "\\", "../"))
        or "\\" in name
        or posixpath.normpath(name) != name
        or name in ("..", ".")
    ):
        raise ValueError(f"invalid checkpoint name {name!r}: must be a relative path inside the root")
    return name


class PendingWrite(ABC):
    """A data file being written: invisible until :meth:`publish`."""

    @abstractmethod
    def write_range(self, lo: int, hi: int) -> None:
        """Write bytes ``[lo, hi)`` of the image; ranges from different threads never overlap."""

    @abstractmethod
    def finish(self) -> None:
        """Make everything written durable (fsync, upload the remaining parts)."""

    @abstractmethod
    def publish(self) -> None:
        """Make the file visible under its final name, atomically replacing an older one."""

    @abstractmethod
    def abort(self) -> None:
        """Discard everything; never raises."""


class Store(ABC):
    """A checkpoint root: local directory, fsspec filesystem, or tiers of both."""

    #: A display form of the root, without credentials.
    url: str

    @abstractmethod
    def check_writable(self, name: str, size: int) -> None:
        """Fail now, on the caller's thread, if writing ``name`` of ``size`` bytes cannot work."""

    @abstractmethod
    def begin_write(self, name: str, image: memoryview, size: int) -> PendingWrite:
        """Start writing ``image[:size]`` to ``name``; ``image`` may extend past ``size``."""

    @abstractmethod
    def put_atomic(self, name: str, data: bytes) -> None:
        """Write a small object durably and atomically."""

    @abstractmethod
    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """Read up to ``length`` bytes at ``offset`` (fewer at end of file)."""

    @abstractmethod
    def read_into(self, name: str, offset: int, out: memoryview) -> int:
        """Fill ``out`` from ``offset``; return how many bytes were read."""

    @abstractmethod
    def info(self, name: str) -> ObjectInfo:
        """Size and modification time. Raises FileNotFoundError when absent."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Files directly inside directory ``prefix`` ("" for the root)."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove a file; absent is not an error."""

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        """Names of the directories directly inside ``prefix`` (leaf names only)."""
        return []

    def describe(self, name: str) -> str:
        """Where ``name`` lives, for messages (never with credentials)."""
        return f"{self.url.rstrip('/')}/{name}"

    def commit_lock(self, name: str) -> AbstractContextManager[None]:
        """Serialize commits (and aside repairs) in ``name``'s directory across processes.

        Stores without a locking primitive return a no-op context.
        """
        return contextlib.nullcontext()

    def folder_committed(self, directory: str) -> None:
        """Called once the folder checkpoint ``directory`` was renamed into place, committed.

        The folder commit (``_dircommit.py``) assembles a folder under a temporary name, possibly
        in another directory (``staging_dir``), and renames it into place under the commit lock;
        it calls this hook after that rename succeeded, never after a failed commit. A store that
        acts on committed checkpoints (a tiered store queues the upload) overrides it; the
        default does nothing. It must not raise for reasons of its own: the folder is committed.
        """

    def canonical(self, name: str) -> str:
        """The name that ``name`` stands for (a link inside the root resolves to its target)."""
        return name

    def local_path(self, name: str) -> str | None:
        """A POSIX path for ``name`` when the store is a local directory, else ``None``."""
        return None

    def close(self) -> None:
        """Release connections."""
