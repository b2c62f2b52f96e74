"""Any fsspec filesystem (``memory://``, ``file://``, ``s3://``, ``gcs://``, ...).

This generic store writes each data file with one ``pipe`` to a temporary key and publishes it
with ``mv``; the S3 fast path (multipart parts that are slices of the staging buffer) lives in
its own module. Credentials passed in ``storage_options`` never appear in ``url`` or messages.
"""

from __future__ import annotations

import builtins
import contextlib
import posixpath
import secrets
from typing import Any

from ..errors import MissingExtraError
from ..ondisk.names import TMP_MARKER
from .base import ObjectInfo, PendingWrite, Store, check_name

__all__ = ["FsspecStore"]

_EXTRA_FOR = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}


def _filesystem(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as exc:
        extra = _EXTRA_FOR.get(protocol)
        hint = (f"pip install 'stagesave[{extra}]'" if extra == "s3"
                else f"install the fsspec backend for {protocol}://")
        raise MissingExtraError(
            f"checkpoints at {protocol}:// need an optional dependency: {hint}"
        ) from exc
    return fs, path.rstrip("/")


def _temporary_beside(path: str) -> str:
    """A fresh temporary key in the folder of ``path`` (listed as a temporary, never as a file)."""
    head, _, leaf = path.rpartition("/")
    return f"{head}/.{leaf}.{secrets.token_hex(4)}{TMP_MARKER}"


class _PipePendingWrite(PendingWrite):
    def __init__(
        self, store: FsspecStore, name: str, image: memoryview, size: int, tail: bool
    ) -> None:
        self.store = store
        self.final = store._path(name)
        self.tmp = _temporary_beside(self.final)
        self.image = image
        self.size = size
        self.tail = b""

    def write_range(self, lo: int, hi: int) -> None:
        pass  # one pipe in finish(): generic filesystems have no ranged writes

    def write_tail(self, data: bytes) -> None:
        self.tail = bytes(data)

    def finish(self) -> None:
        self.store.fs.pipe_file(self.tmp, bytes(self.image[: self.size]) + self.tail)

    def publish(self) -> None:
        self.store.fs.mv(self.tmp, self.final)

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # abort never raises
            self.store.fs.rm_file(self.tmp)


class FsspecStore(Store):
    """A root URL on any fsspec filesystem."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self._made_with = (url, dict(storage_options or {}))
        self.fs, self.root = _filesystem(url, dict(storage_options or {}))
        protocol = url.split("://", 1)[0]
        if "://" in self.root:  # filesystems whose paths are URLs themselves (http)
            self.url = self.root
        else:
            self.url = f"{protocol}://{self.root.lstrip('/')}" if protocol != "memory" else f"memory://{self.root}"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the arguments it was made with (a writer agent makes its own)."""
        return (FsspecStore, self._made_with)

    def _path(self, name: str) -> str:
        return posixpath.join(self.root, check_name(name))

    def check_writable(self, name: str, size: int) -> None:
        check_name(name)

    def begin_write(
        self, name: str, image: memoryview, size: int, *, tail: bool = False
    ) -> PendingWrite:
        return _PipePendingWrite(self, name, image, size, tail)

    def put_atomic(self, name: str, data: bytes) -> None:
        """A temporary key, then ``mv``: a filesystem whose ``pipe`` is not atomic (``file://``,
        where the file exists, empty, from its open) never shows ``name`` partly written."""
        final = self._path(name)
        tmp = _temporary_beside(final)
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, final)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(tmp)
            raise

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        data: bytes = self.fs.cat_file(self._path(name), start=offset, end=offset + length)
        if len(data) > length:  # the server ignored the range (a plain HTTP server sends it all)
            data = data[offset : offset + length]
        return data

    def read_into(self, name: str, offset: int, out: memoryview) -> int:
        data = self.read_range(name, offset, len(out))
        out[: len(data)] = data
        return len(data)

    def info(self, name: str) -> ObjectInfo:
        i = self.fs.info(self._path(name))
        if i.get("type") == "directory":
            raise IsADirectoryError(self.describe(name))
        mtime = i.get("mtime") or i.get("LastModified") or i.get("created") or 0.0
        if hasattr(mtime, "timestamp"):
            mtime = mtime.timestamp()
        return ObjectInfo(name, int(i["size"]), float(mtime))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = self._path(prefix) if prefix else self.root
        try:
            entries = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            if e.get("type") != "file":
                continue
            leaf = e["name"].rstrip("/").rpartition("/")[2]
            name = f"{prefix}/{leaf}" if prefix else leaf
            mtime = e.get("mtime") or e.get("LastModified") or e.get("created") or 0.0
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            size = e.get("size")
            if size is None:  # listings that do not say (an HTTP index page): ask the file
                with contextlib.suppress(Exception):
                    size = self.fs.info(e["name"]).get("size")
            out.append(ObjectInfo(name, int(size or 0), float(mtime)))
        return out

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        base = self._path(prefix) if prefix else self.root
        try:
            entries = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        return [e["name"].rstrip("/").rpartition("/")[2] for e in entries
                if e.get("type") == "directory"]

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))
