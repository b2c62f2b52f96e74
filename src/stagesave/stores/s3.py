"""S3 fast path: multipart uploads whose parts are slices of the staging buffer.

Why a store of its own instead of fsspec's buffered file: s3fs's file object copies every byte
into its own buffer, uploads one part at a time, retries inside botocore with an opaque budget,
and completes the upload when the ``with`` block exits, even on an error (a torn object). Here a
data file is one multipart upload (one PUT when small) whose parts are ``memoryview`` slices of
the staging image, sent concurrently over a bounded number of connections on s3fs's event loop.
Every request is retried with exponential backoff and full jitter on throttling, server errors,
timeouts and dropped connections, and never on access or missing-bucket errors, which surface at
once. The upload is completed only by ``publish``, after the manifest object exists (see
``saving/commit.py``); a failure at any step aborts it, so nothing partial is ever published.

Reads pin the ETag that ``info`` saw (``If-Match``): the ranged reads of one load all come from
one version of an object even if another writer replaces it meanwhile (old or new, never a mix).
Credentials come from ``storage_options`` and are scrubbed from every message.

This module is the store (names, reads, listing, deletion); the multipart engine is
``s3_upload``, and every request goes through ``s3_requests`` (retries, error mapping).
"""

from __future__ import annotations

import asyncio
import builtins
import threading
from typing import Any

from ..errors import CheckpointNotFoundError, StorageError
from .base import ObjectInfo, PendingWrite, Reader, Store, check_name
from .s3_requests import (
    ACCESS_CODES,
    FailedRequest,
    RetryPolicy,
    S3Requests,
    all_or_none,
    error_code,
)
from .s3_upload import (
    DEFAULT_PART_BYTES,
    MAX_PART_BYTES,
    MIN_PART_BYTES,
    MiB,
    MultipartUpload,
    abort_stale_multipart_uploads,
    choose_part_size,
)
from .urls import s3_bucket_and_prefix

__all__ = ["RetryPolicy", "S3Store", "abort_stale_multipart_uploads", "choose_part_size"]

_UNPINNED_READ_TRIES = 3  # a read no version was pinned for: tries when the object is replaced


class S3Store(Store):
    """A checkpoint root on S3 or an S3-compatible server (``s3://bucket/prefix``).

    Args:
        url: ``s3://bucket`` or ``s3://bucket/prefix``.
        storage_options: s3fs arguments: ``key``, ``secret``, ``token``, ``profile``,
            ``endpoint_url``, ``client_kwargs`` (e.g. ``region_name``), ``config_kwargs``.
        max_connections: Requests in flight at once (parts of all uploads and ranged reads).
        part_size: Preferred part size; the actual size is chosen per file within S3's limits.
        multipart_threshold: Files up to this size go up as one PUT.
        retry: Backoff policy for every request.
        connect_timeout: Seconds to establish a connection.
        read_timeout: Seconds without progress on a response before the attempt is retried.

    Raises:
        ValueError: the URL is not an S3 URL, or carries credentials; a size is out of range.
        MissingExtraError: s3fs is not installed.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        max_connections: int = 16,
        part_size: int = DEFAULT_PART_BYTES,
        multipart_threshold: int = DEFAULT_PART_BYTES,
        retry: RetryPolicy | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
    ) -> None:
        self.bucket, self.prefix = s3_bucket_and_prefix(url)
        #: How to make this store again in another process (a writer agent's).
        self._made_with = (url, dict(storage_options or {}), max_connections, part_size,
                           multipart_threshold, retry, connect_timeout, read_timeout)
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not MIN_PART_BYTES <= part_size <= MAX_PART_BYTES:
            raise ValueError(f"part_size must be between 5 MiB and 5 GiB, got {part_size}")
        if multipart_threshold < 0:
            raise ValueError(f"multipart_threshold must be >= 0, got {multipart_threshold}")
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.part_size = part_size
        self.multipart_threshold = multipart_threshold
        #: Every request of this store and of its uploads goes through it.
        self.requests = S3Requests(
            self.bucket, self.url, dict(storage_options or {}), max_connections=max_connections,
            retry=retry or RetryPolicy(), connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        self.fs = self.requests.fs
        self._etags: dict[str, str] = {}
        self._lock = threading.Lock()
        self._bucket_checked = False

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the arguments it was made with (its connections stay here)."""
        return (_remake, self._made_with)

    @property
    def retry(self) -> RetryPolicy:
        """Backoff policy for every request."""
        return self.requests.retry

    @retry.setter
    def retry(self, policy: RetryPolicy) -> None:
        self.requests.retry = policy

    @property
    def max_connections(self) -> int:
        """Requests in flight at once (parts of all uploads and ranged reads)."""
        return self.requests.max_connections

    @max_connections.setter
    def max_connections(self, n: int) -> None:
        self.requests.max_connections = n

    def _key(self, name: str) -> str:
        check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    # ------------------------------------------------------------------ writing
    def check_writable(self, name: str, size: int) -> None:
        """Validate the name and size; check once that the bucket exists (no retries here).

        Raises:
            ValueError: invalid name, or the file exceeds S3's 5 TiB object limit.
            CheckpointNotFoundError: the bucket does not exist.
        """
        self._key(name)
        choose_part_size(size, self.part_size)
        if self._bucket_checked:
            return

        async def head() -> None:
            client = await self.requests.client()
            await client.head_bucket(Bucket=self.bucket)

        try:
            self.requests.run(asyncio.wait_for(head(), timeout=5.0))
        except Exception as exc:
            code = error_code(exc)
            if code in ("404", "NoSuchBucket"):
                raise CheckpointNotFoundError(
                    f"cannot write {self.describe(name)}: bucket {self.bucket!r} does not exist. "
                    "Create it or fix the checkpoint URL."
                ) from exc
            if code not in ACCESS_CODES:
                return  # unreachable or failing now: the background write retries and reports
            # Access denied to HeadBucket says little: writes may still be allowed.
        self._bucket_checked = True

    def begin_write(
        self, name: str, image: memoryview, size: int, *, tail: bool = False
    ) -> PendingWrite:
        return MultipartUpload(
            self.requests, self._key(name), self.describe(name), image, size, tail=tail,
            part_size=self.part_size, multipart_threshold=self.multipart_threshold,
            forget=lambda: self._forget(name),
        )

    def open(self, name: str) -> Reader:
        info = self.info(name)  # pins the ETag that the reads then require
        with self._lock:
            etag = self._etags.get(name)
        return _PinnedReader(self, name, info, etag)

    def put_atomic(self, name: str, data: bytes) -> None:
        key = self._key(name)
        self._forget(name)
        self.requests.run(self.requests.call("PutObject", self.describe(name), Bucket=self.bucket,
                                             Key=key, Body=data, ContentLength=len(data)))

    def delete(self, name: str) -> None:
        key = self._key(name)
        self._forget(name)
        try:
            self.requests.run(self.requests.call("DeleteObject", self.describe(name),
                                                 Bucket=self.bucket, Key=key))
        except CheckpointNotFoundError as exc:
            if getattr(exc, "s3_code", None) == "NoSuchBucket":
                raise

    def _forget(self, name: str) -> None:
        with self._lock:
            self._etags.pop(name, None)

    # ------------------------------------------------------------------ reading
    def info(self, name: str) -> ObjectInfo:
        key = self._key(name)
        try:
            head = self.requests.run(self.requests.call("HeadObject", self.describe(name),
                                                        Bucket=self.bucket, Key=key))
        except CheckpointNotFoundError as exc:
            if getattr(exc, "s3_code", None) == "NoSuchBucket":
                raise
            if self._has_children(name):
                raise IsADirectoryError(
                    f"{self.describe(name)} is a prefix (directory), not an object"
                ) from exc
            raise
        with self._lock:
            self._etags[name] = head["ETag"]
        return ObjectInfo(name, int(head["ContentLength"]), head["LastModified"].timestamp())

    def _has_children(self, name: str) -> bool:
        listed = self.requests.run(self.requests.call(
            "ListObjectsV2", self.describe(name), Bucket=self.bucket,
            Prefix=self._key(name) + "/", MaxKeys=1,
        ))
        return bool(listed.get("KeyCount") or listed.get("Contents")
                    or listed.get("CommonPrefixes"))

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        view = memoryview(bytearray(length))
        return bytes(view[: self.read_into(name, offset, view)])

    def read_into(self, name: str, offset: int, out: memoryview) -> int:
        """Fill ``out`` with concurrent ranged GETs of one object version.

        Raises:
            FileNotFoundError: no such object.
            StorageError: the object was replaced while being read, or the server kept failing.
        """
        with self._lock:
            etag = self._etags.get(name)
        return self._read_pinned(name, offset, out, etag)

    def _read_pinned(self, name: str, offset: int, out: memoryview, etag: str | None) -> int:
        """Like :meth:`read_into`, every ranged GET requiring ``etag``; without one, the version
        the first GET returns (an object replaced between two GETs is read again, whole)."""
        key = self._key(name)
        if len(out) == 0:
            return 0
        step = self.part_size
        spans = [(lo, min(len(out), lo + step)) for lo in range(0, len(out), step)]

        async def all_spans() -> int:
            pin, first = etag, 0
            if pin is None and len(spans) > 1:
                seen: builtins.list[str] = []
                lo, hi = spans[0]
                n = await self._get_into(key, name, offset + lo, out[lo:hi], None, seen)
                if n < hi - lo:
                    return n  # end of object
                pin, first = (seen[-1] if seen else None), 1  # the attempt that filled it
            counts = await all_or_none(
                self._get_into(key, name, offset + lo, out[lo:hi], pin)
                for lo, hi in spans[first:]
            )
            total = sum(hi - lo for lo, hi in spans[:first])
            for (lo, hi), n in zip(spans[first:], counts, strict=True):
                total += n
                if n < hi - lo:
                    break  # end of object
            return total

        for attempt in range(1, _UNPINNED_READ_TRIES + 1):
            try:
                return self.requests.run(all_spans())
            except StorageError as exc:
                replaced = getattr(exc, "s3_code", None) == "PreconditionFailed"
                if replaced:
                    self._forget(name)
                if not replaced or etag is not None or attempt == _UNPINNED_READ_TRIES:
                    raise
        return 0  # not reached: the last attempt returns or raises

    async def _get_into(
        self, key: str, name: str, offset: int, out: memoryview, etag: str | None,
        seen: builtins.list[str] | None = None,
    ) -> int:
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": key,
                                  "Range": f"bytes={offset}-{offset + len(out) - 1}"}
        if etag:
            params["IfMatch"] = etag

        async def once() -> int:
            async with self.requests.semaphore():
                client = await self.requests.client()
                try:
                    response = await client.get_object(**params)
                except Exception as exc:
                    if error_code(exc) in ("InvalidRange", "416"):
                        return 0  # offset at or past the end
                    raise
                if seen is not None and response.get("ETag"):
                    seen.append(response["ETag"])
                body = response["Body"]
                pos = 0
                try:
                    while pos < len(out):
                        chunk = await body.read(min(len(out) - pos, 4 * MiB))
                        if not chunk:
                            break
                        out[pos : pos + len(chunk)] = chunk
                        pos += len(chunk)
                finally:
                    body.close()
                expected = min(len(out), int(response.get("ContentLength", pos)))
                if pos < expected:
                    raise ConnectionError(f"response ended after {pos} of {expected} bytes")
                return pos

        try:
            return await self.requests.retrying("GetObject", once)
        except FailedRequest as failed:
            failed.where = self.describe(name)
            raise

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._list(prefix)[0]

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        return self._list(prefix)[1]

    def _list(self, prefix: str) -> tuple[builtins.list[ObjectInfo], builtins.list[str]]:
        base = self._key(prefix) + "/" if prefix else (f"{self.prefix}/" if self.prefix else "")
        where = self.describe(prefix) if prefix else self.url

        async def pages() -> tuple[builtins.list[ObjectInfo], builtins.list[str]]:
            files: builtins.list[ObjectInfo] = []
            dirs: builtins.list[str] = []
            token: str | None = None
            while True:
                params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/"}
                if token:
                    params["ContinuationToken"] = token
                page = await self.requests.call("ListObjectsV2", where, **params)
                for obj in page.get("Contents", []):
                    leaf = obj["Key"][len(base):]
                    if leaf and "/" not in leaf:
                        name = f"{prefix}/{leaf}" if prefix else leaf
                        files.append(ObjectInfo(name, int(obj["Size"]),
                                                obj["LastModified"].timestamp(),
                                                str(obj.get("ETag", ""))))
                for common in page.get("CommonPrefixes", []):
                    leaf = common["Prefix"][len(base):].rstrip("/")
                    if leaf:
                        dirs.append(leaf)
                if not page.get("IsTruncated"):
                    return files, dirs
                token = page.get("NextContinuationToken")

        return self.requests.run(pages())

    def close(self) -> None:
        self.requests.close()


class _PinnedReader(Reader):
    """One version of an object: every ranged GET requires the ETag its HEAD saw."""

    def __init__(self, store: S3Store, name: str, info: ObjectInfo, etag: str | None) -> None:
        self.store, self.name, self.etag = store, name, etag
        self.size, self.mtime = info.size, info.mtime
        self.where = store.describe(name)

    def read(self, offset: int, length: int) -> bytes:
        n = max(0, min(length, self.size - offset))
        buf = bytearray(n)
        got = self.readinto(offset, memoryview(buf)) if n else 0
        del buf[got:]
        return bytes(buf)

    def readinto(self, offset: int, out: memoryview) -> int:
        n = min(len(out), max(0, self.size - offset))
        return self.store._read_pinned(self.name, offset, out[:n], self.etag) if n else 0


def _remake(url: str, storage_options: dict[str, Any], max_connections: int, part_size: int,
            multipart_threshold: int, retry: RetryPolicy | None, connect_timeout: float,
            read_timeout: float) -> S3Store:
    return S3Store(url, storage_options, max_connections=max_connections, part_size=part_size,
                   multipart_threshold=multipart_threshold, retry=retry,
                   connect_timeout=connect_timeout, read_timeout=read_timeout)
