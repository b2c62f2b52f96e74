"""The storage contract: a handful of operations every backend implements.

A checkpoint root is a store; names inside it are relative POSIX paths (``last.ckpt``,
``checkpoint_3/model.safetensors``). Writing a data file happens in three steps so that the
commit protocol (``saving/commit.py``) can order them: ``begin_write`` opens an invisible temporary
(a temp file, a multipart upload), ``PendingWrite.write_range`` fills it from the staging buffer
(thread-safe, called in parallel on disjoint ranges), ``write_tail`` appends the bytes that
follow them (a format-2 file's proof), ``finish`` makes it durable and ``publish`` makes it
visible under its final name atomically. A folder checkpoint on a local root is assembled
elsewhere and renamed into place; the store hears of that commit through ``folder_committed``.

Reading goes through :meth:`Store.open`: one :class:`Reader` sees one version of a file (a
descriptor locally, an ETag-pinned object on S3), so data and proof always come from the same
write even while another process replaces the file.
"""

from __future__ import annotations

import builtins
import contextlib
import posixpath
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass

__all__ = ["ObjectInfo", "PendingWrite", "Reader", "Store", "check_name"]


@dataclass(frozen=True)
class ObjectInfo:
    """A file in a store."""

    name: str
    size: int
    mtime: float
    #: Tells two versions of a name apart where the store can (inode, ETag); "" otherwise.
    version: str = ""


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
        raise ValueError(
            f"invalid checkpoint name {name!r}: must be a relative path inside the root"
        )
    return name


class PendingWrite(ABC):
    """A data file being written: invisible until :meth:`publish`."""

    @abstractmethod
    def write_range(self, lo: int, hi: int) -> None:
        """Write bytes ``[lo, hi)`` of the image; ranges from different threads never overlap."""

    def write_tail(self, data: bytes) -> None:
        """Write ``data`` right after the image's ``size`` bytes, once every range is written.

        Only for writes begun with ``tail=True``.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot append a tail")

    def flush(self) -> None:  # noqa: B027, RUF100 - optional: the default does nothing
        """Make the ranges written so far durable, keeping the file open (optional)."""

    @abstractmethod
    def finish(self) -> None:
        """Make everything written durable (fsync, upload the remaining parts)."""

    @abstractmethod
    def publish(self) -> None:
        """Make the file visible under its final name, atomically replacing an older one."""

    @abstractmethod
    def abort(self) -> None:
        """Discard everything; never raises."""


class Reader(ABC):
    """One version of one file, read by ranges (thread-safe)."""

    name: str
    size: int
    mtime: float
    #: Where it lives, for messages.
    where: str

    @abstractmethod
    def read(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (fewer at the end of the file)."""

    @abstractmethod
    def readinto(self, offset: int, out: memoryview) -> int:
        """Fill ``out`` from ``offset``; how many bytes were read."""

    def fileno(self) -> int | None:
        """A descriptor of this version when it is a local file (to load it without reopening)."""
        return None

    def close(self) -> None:  # noqa: B027, RUF100 - optional: the default does nothing
        """Release the descriptor or connection."""

    def __enter__(self) -> Reader:  # noqa: PYI034, RUF100 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RangeReader(Reader):
    """A reader over ``Store.read_range`` for stores without versioned reads."""

    def __init__(self, store: Store, name: str, info: ObjectInfo) -> None:
        self.store, self.name, self.size, self.mtime = store, name, info.size, info.mtime
        self.where = store.describe(name)

    def read(self, offset: int, length: int) -> bytes:
        return self.store.read_range(self.name, offset, min(length, max(0, self.size - offset)))

    def readinto(self, offset: int, out: memoryview) -> int:
        n = min(len(out), max(0, self.size - offset))
        return self.store.read_into(self.name, offset, out[:n]) if n else 0


class Store(ABC):
    """A checkpoint root: local directory, fsspec filesystem, or tiers of both."""

    #: A display form of the root, without credentials.
    url: str

    @abstractmethod
    def check_writable(self, name: str, size: int) -> None:
        """Fail now, on the caller's thread, if writing ``name`` of ``size`` bytes cannot work."""

    @abstractmethod
    def begin_write(
        self, name: str, image: memoryview, size: int, *, tail: bool = False
    ) -> PendingWrite:
        """Start writing ``image[:size]`` to ``name``; ``image`` may extend past ``size``.

        With ``tail``, :meth:`PendingWrite.write_tail` appends more bytes before ``finish``.
        """

    @abstractmethod
    def put_atomic(self, name: str, data: bytes) -> None:
        """Write a small object durably and atomically."""

    def open(self, name: str) -> Reader:
        """A reader of one version of ``name``.

        Raises:
            FileNotFoundError: absent. IsADirectoryError: a directory.
        """
        return _RangeReader(self, name, self.info(name))

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

    def folder_committed(self, directory: str) -> None:  # noqa: B027, RUF100 - optional hook
        """Called once the folder checkpoint ``directory`` was renamed into place, committed.

        The folder commit (``saving/commit.py``) assembles a folder under a temporary name, possibly
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

    def close(self) -> None:  # noqa: B027, RUF100 - optional: the default does nothing
        """Release connections."""
