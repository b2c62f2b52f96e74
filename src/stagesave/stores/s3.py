"""S3 fast path: multipart uploads whose parts are slices of the staging buffer.

Why a store of its own instead of fsspec's buffered file: s3fs's file object copies every byte
into its own buffer, uploads one part at a time, retries inside botocore with an opaque budget,
and completes the upload when the ``with`` block exits, even on an error (a torn object). Here a
data file is one multipart upload (one PUT when small) whose parts are ``memoryview`` slices of
the staging image, sent concurrently over a bounded number of connections on s3fs's event loop.
Every request is retried with exponential backoff and full jitter on throttling, server errors,
timeouts and dropped connections, and never on access or missing-bucket errors, which surface at
once. The upload is completed only by ``publish``, after the manifest object exists (see
``_commit.py``); a failure at any step aborts it, so nothing partial is ever published.

Reads pin the ETag that ``info`` saw (``If-Match``): the ranged reads of one load all come from
one version of an object even if another writer replaces it meanwhile (old or new, never a mix).
Credentials come from ``storage_options`` and are scrubbed from every message.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from .._crash import crash_point
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    MissingExtraError,
    StorageError,
)
from .base import ObjectInfo, PendingWrite, Reader, Store, check_name

__all__ = ["RetryPolicy", "S3Store", "abort_stale_multipart_uploads", "choose_part_size"]

T = TypeVar("T")

MiB = 1 << 20
#: S3's limits on multipart uploads.
MIN_PART_BYTES = 5 * MiB
MAX_PART_BYTES = 5 * 1024 * MiB
MAX_PARTS = 10_000
MAX_OBJECT_BYTES = 5 * (1 << 40)
#: Default part size (and single-PUT threshold): small enough for parallelism on 1 GiB files.
DEFAULT_PART_BYTES = 16 * MiB

_RETRY_CODES = frozenset({
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
    "ThrottlingException", "RequestThrottled", "RequestLimitExceeded", "TooManyRequestsException",
    "IncompleteBody", "BadDigest", "XAmzContentSHA256Mismatch", "OperationAborted",
    "500", "502", "503", "504",
})
_ACCESS_CODES = frozenset({
    "AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
    "AccountProblem", "ExpiredToken", "InvalidToken", "InvalidSecurity", "TokenRefreshRequired",
})
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


def choose_part_size(size: int, preferred: int = DEFAULT_PART_BYTES) -> int:
    """The part size for a ``size``-byte object: ``preferred`` unless S3's limits forbid it.

    Parts are whole MiB, at least 5 MiB, at most 5 GiB, and no more than 10,000 of them.

    Raises:
        ValueError: the object exceeds S3's 5 TiB limit.
    """
    if size > MAX_OBJECT_BYTES:
        raise ValueError(f"{size} bytes exceeds S3's 5 TiB object limit; save smaller (sharded) files")
    part = max(preferred, MIN_PART_BYTES, -(-size // MAX_PARTS))
    part = -(-part // MiB) * MiB
    return min(part, MAX_PART_BYTES)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: attempt ``n`` waits ``U(0, min(cap, base * 2**n))``.

    ``max_attempts`` counts the first try; ``1`` disables retries.
    """

    max_attempts: int = 8
    base_delay_s: float = 0.1
    max_delay_s: float = 20.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("retry delays must be >= 0")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (0-based)."""
        return random.uniform(0.0, min(self.max_delay_s, self.base_delay_s * (2.0**attempt)))


def _code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status:
            return str(status)
    return None


def _status(exc: BaseException) -> int:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return 0


def _retryable(exc: BaseException) -> bool:
    """Throttling, server errors, timeouts and dropped connections; never access or absence."""
    import aiohttp
    from botocore import exceptions as bex

    code = _code(exc)
    if code is not None:
        return code in _RETRY_CODES or _status(exc) >= 500 or _status(exc) == 429
    if isinstance(exc, bex.SSLError):
        return False
    return isinstance(
        exc,
        (
            bex.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
            bex.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError
            bex.IncompleteReadError,
            aiohttp.ClientError,
            asyncio.TimeoutError,
            ConnectionError,
            TimeoutError,
        ),
    )


class _Attempts(Exception):
    """Internal: the last error of a request and how many attempts it took."""

    def __init__(self, op: str, cause: BaseException, attempts: int) -> None:
        super().__init__(op)
        self.op = op
        self.cause = cause
        self.attempts = attempts
        self.code = _code(cause)


def _parse_url(url: str) -> tuple[str, str]:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("s3", "s3a"):
        raise ValueError("an S3 checkpoint root must look like s3://bucket/prefix")
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        # Never echo it: it may hold a secret.
        raise ValueError(
            "credentials in an s3:// URL are not supported (and would leak into logs); "
            "pass them in storage_options (key=..., secret=...)"
        )
    if not bucket:
        raise ValueError("an S3 checkpoint root must name a bucket: s3://bucket/prefix")
    return bucket, prefix.strip("/")


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
        self.bucket, self.prefix = _parse_url(url)
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not MIN_PART_BYTES <= part_size <= MAX_PART_BYTES:
            raise ValueError(f"part_size must be between 5 MiB and 5 GiB, got {part_size}")
        if multipart_threshold < 0:
            raise ValueError(f"multipart_threshold must be >= 0, got {multipart_threshold}")
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.max_connections = max_connections
        self.part_size = part_size
        self.multipart_threshold = multipart_threshold
        self.retry = retry or RetryPolicy()
        options = dict(storage_options or {})
        self._secrets = [
            str(options[k]) for k in ("key", "secret", "token", "password", "username")
            if options.get(k) and len(str(options[k])) >= 4
        ]
        try:
            import s3fs
        except ImportError as exc:
            raise MissingExtraError(
                "checkpoints at s3:// need an optional dependency: pip install 'stagesave[s3]'"
            ) from exc
        config = dict(options.pop("config_kwargs", None) or {})
        config.update(
            # stagesave retries each request itself (one budget, jittered, classified).
            retries={"total_max_attempts": 1, "mode": "standard"},
            # Parts are memoryviews of the staging buffer; botocore's validator only knows
            # bytes/bytearray/files, the HTTP layer sends any buffer without copying it.
            parameter_validation=False,
            # Integrity is end to end: chunk digests in the manifest, verified on load.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=2 * max_connections,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        self.fs = s3fs.S3FileSystem(**options, config_kwargs=config, skip_instance_cache=True)
        self._loop: asyncio.AbstractEventLoop = self.fs.loop
        self._sem: asyncio.Semaphore | None = None
        self._etags: dict[str, str] = {}
        self._lock = threading.Lock()
        self._bucket_checked = False

    # ------------------------------------------------------------------ plumbing
    def _key(self, name: str) -> str:
        check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def _scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on s3fs's loop from a plain thread; translate failures."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            result: T = future.result()
            return result
        except _Attempts as failed:
            raise self._translate(failed) from failed.cause
        except BaseException:
            future.cancel()
            raise

    async def _client(self) -> Any:
        return await self.fs.set_session()

    def _semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_connections)
        return self._sem

    async def _retrying(self, op: str, attempt_fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``attempt_fn`` under the retry policy; raise ``_Attempts`` when it gives up."""
        attempt = 0
        while True:
            try:
                return await attempt_fn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                attempt += 1
                if not _retryable(exc) or attempt >= self.retry.max_attempts:
                    raise _Attempts(op, exc, attempt) from exc
                await asyncio.sleep(self.retry.delay(attempt - 1))

    async def _call(self, op: str, where: str, **params: Any) -> dict[str, Any]:
        method = "".join("_" + c.lower() if c.isupper() else c for c in op).lstrip("_")

        async def once() -> dict[str, Any]:
            async with self._semaphore():
                client = await self._client()
                result: dict[str, Any] = await getattr(client, method)(**params)
                return result

        try:
            return await self._retrying(op, once)
        except _Attempts as failed:
            failed.where = where  # type: ignore[attr-defined]
            raise

    def _translate(self, failed: _Attempts) -> CheckpointError:
        """Map a failed request to the stagesave family, with a message that says what to do."""
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError

        where = getattr(failed, "where", self.url)
        cause, code, op = failed.cause, failed.code, failed.op
        detail = self._scrub(f"{code}: {getattr(cause, 'response', {}).get('Error', {}).get('Message', '')}"
                             if code else f"{type(cause).__name__}: {cause}").rstrip(": ")
        err: CheckpointError
        if isinstance(cause, (NoCredentialsError, PartialCredentialsError)):
            err = CheckpointPermissionError(
                f"S3 {op} on {where}: no usable credentials. Pass key/secret (or profile) in "
                "storage_options, or configure the AWS credential chain."
            )
        elif code == "NoSuchBucket":
            err = CheckpointNotFoundError(
                f"S3 {op} on {where}: bucket {self.bucket!r} does not exist. Create it or fix the "
                "checkpoint URL."
            )
        elif code in _ACCESS_CODES:
            err = CheckpointPermissionError(
                f"S3 {op} on {where} was refused ({detail}). Check the credentials in "
                "storage_options and the bucket policy; access errors are not retried."
            )
        elif code in _MISSING_CODES:
            err = CheckpointNotFoundError(f"S3 {op}: no object at {where}")
        elif code == "NoSuchUpload":
            err = StorageError(
                f"S3 {op} on {where}: the multipart upload no longer exists (aborted by a cleanup "
                "call or expired by a lifecycle rule)"
            )
        elif code == "PreconditionFailed":
            err = StorageError(
                f"{where} was replaced by another writer while it was being read; read it again "
                "to get the new version"
            )
        elif _retryable(cause):
            err = StorageError(
                f"S3 {op} on {where} failed after {failed.attempts} attempts ({detail}). The "
                "server is throttling or unreachable: retry later, or allow more attempts with "
                "S3Store(retry=RetryPolicy(max_attempts=...))"
            )
        else:
            err = StorageError(f"S3 {op} on {where} failed: {detail}")
        tagged: Any = err  # callers look at the S3 code and attempts (complete-retry, pins)
        tagged.s3_code = code
        tagged.attempts = failed.attempts
        return err

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
            client = await self._client()
            await client.head_bucket(Bucket=self.bucket)

        try:
            self._run(asyncio.wait_for(head(), timeout=5.0))
        except Exception as exc:
            code = _code(exc)
            if code in ("404", "NoSuchBucket"):
                raise CheckpointNotFoundError(
                    f"cannot write {self.describe(name)}: bucket {self.bucket!r} does not exist. "
                    "Create it or fix the checkpoint URL."
                ) from exc
            if code not in _ACCESS_CODES:
                return  # unreachable or failing now: the background write retries and reports
            # Access denied to HeadBucket says little: writes may still be allowed.
        self._bucket_checked = True

    def begin_write(self, name: str, image: memoryview, size: int, *, tail: bool = False) -> PendingWrite:
        return _Upload(self, name, image, size, tail)

    def open(self, name: str) -> Reader:
        info = self.info(name)  # pins the ETag that the reads then require
        with self._lock:
            etag = self._etags.get(name)
        return _PinnedReader(self, name, info, etag)

    def put_atomic(self, name: str, data: bytes) -> None:
        key = self._key(name)
        self._forget(name)
        self._run(self._call("PutObject", self.describe(name), Bucket=self.bucket, Key=key, Body=data,
                             ContentLength=len(data)))

    def delete(self, name: str) -> None:
        key = self._key(name)
        self._forget(name)
        try:
            self._run(self._call("DeleteObject", self.describe(name), Bucket=self.bucket, Key=key))
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
            head = self._run(self._call("HeadObject", self.describe(name), Bucket=self.bucket, Key=key))
        except CheckpointNotFoundError as exc:
            if getattr(exc, "s3_code", None) == "NoSuchBucket":
                raise
            if self._has_children(name):
                raise IsADirectoryError(f"{self.describe(name)} is a prefix (directory), not an object") from exc
            raise
        with self._lock:
            self._etags[name] = head["ETag"]
        return ObjectInfo(name, int(head["ContentLength"]), head["LastModified"].timestamp())

    def _has_children(self, name: str) -> bool:
        listed = self._run(self._call("ListObjectsV2", self.describe(name), Bucket=self.bucket,
                                      Prefix=self._key(name) + "/", MaxKeys=1))
        return bool(listed.get("KeyCount") or listed.get("Contents") or listed.get("CommonPrefixes"))

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        buf = bytearray(length)
        n = self.read_into(name, offset, memoryview(buf))
        del buf[n:]
        return bytes(buf)

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
        key = self._key(name)
        if len(out) == 0:
            return 0
        step = self.part_size
        spans = [(lo, min(len(out), lo + step)) for lo in range(0, len(out), step)]

        async def all_spans() -> int:
            counts = await asyncio.gather(
                *(self._get_into(key, name, offset + lo, out[lo:hi], etag) for lo, hi in spans)
            )
            total = 0
            for (lo, hi), n in zip(spans, counts):
                total += n
                if n < hi - lo:
                    break  # end of object
            return total

        try:
            return self._run(all_spans())
        except StorageError as exc:
            if getattr(exc, "s3_code", None) == "PreconditionFailed":
                self._forget(name)
            raise

    async def _get_into(self, key: str, name: str, offset: int, out: memoryview, etag: str | None) -> int:
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": key,
                                  "Range": f"bytes={offset}-{offset + len(out) - 1}"}
        if etag:
            params["IfMatch"] = etag

        async def once() -> int:
            async with self._semaphore():
                client = await self._client()
                try:
                    response = await client.get_object(**params)
                except Exception as exc:
                    if _code(exc) in ("InvalidRange", "416"):
                        return 0  # offset at or past the end
                    raise
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
            return await self._retrying("GetObject", once)
        except _Attempts as failed:
            failed.where = self.describe(name)  # type: ignore[attr-defined]
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
                page = await self._call("ListObjectsV2", where, **params)
                for obj in page.get("Contents", []):
                    leaf = obj["Key"][len(base):]
                    if leaf and "/" not in leaf:
                        name = f"{prefix}/{leaf}" if prefix else leaf
                        files.append(ObjectInfo(name, int(obj["Size"]), obj["LastModified"].timestamp(),
                                                str(obj.get("ETag", ""))))
                for common in page.get("CommonPrefixes", []):
                    leaf = common["Prefix"][len(base):].rstrip("/")
                    if leaf:
                        dirs.append(leaf)
                if not page.get("IsTruncated"):
                    return files, dirs
                token = page.get("NextContinuationToken")

        return self._run(pages())

    def close(self) -> None:
        creator = getattr(self.fs, "_s3creator", None)
        if creator is not None:
            with contextlib.suppress(Exception):  # closing is best effort
                type(self.fs).close_session(self._loop, creator)
            self.fs._s3creator = None
            self.fs._s3 = None


class _PinnedReader(Reader):
    """One version of an object: every ranged GET requires the ETag its HEAD saw."""

    def __init__(self, store: S3Store, name: str, info: ObjectInfo, etag: str | None) -> None:
        self.store, self.name, self.size, self.mtime, self.etag = store, name, info.size, info.mtime, etag
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


class _Upload(PendingWrite):
    """One data file: a multipart upload of image slices, or one PUT at publish time.

    With a tail (a format-2 proof), the last part is the image's last slice followed by the tail,
    uploaded once the tail is known; every other part is a slice of the image.

    Part tasks live on s3fs's event loop (``_tasks`` is touched only there); other threads
    schedule them with ``call_soon_threadsafe``, whose FIFO order guarantees that ``finish`` and
    ``abort``, submitted afterwards, see every part scheduled before them.
    """

    def __init__(self, store: S3Store, name: str, image: memoryview, size: int, tail: bool = False) -> None:
        self.store = store
        self.name = name
        self.key = store._key(name)
        self.where = store.describe(name)
        self.view = image[:size]
        self.size = size
        self.has_tail = tail
        self.tail: bytes | None = None
        self.single = size <= store.multipart_threshold
        self.part_size = choose_part_size(size, store.part_size)
        self.n_parts = max(1, math.ceil(size / self.part_size))
        self.upload_id: str | None = None
        self.etags: list[str] = []
        self._tasks: dict[int, asyncio.Future[str]] = {}
        self._scheduled: set[int] = set()
        self._failure: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        store._forget(name)
        if not self.single:
            created = store._run(store._call("CreateMultipartUpload", self.where, Bucket=store.bucket,
                                             Key=self.key, ContentType="application/octet-stream"))
            self.upload_id = str(created["UploadId"])

    def _schedule(self, part: int) -> None:
        """Start part ``part`` on the loop (caller holds ``_lock``)."""
        if part in self._scheduled or self._closed:
            return
        self._scheduled.add(part)
        self.store._loop.call_soon_threadsafe(self._start, part)

    def _start(self, part: int) -> None:
        self._tasks[part] = asyncio.ensure_future(self._upload_part(part))

    async def _upload_part(self, part: int) -> str:
        lo = (part - 1) * self.part_size
        hi = min(self.size, lo + self.part_size)
        body: Any = self.view[lo:hi]
        if self.has_tail and part == self.n_parts:
            assert self.tail is not None
            body = bytes(body) + self.tail
        try:
            result = await self.store._call(
                "UploadPart", f"{self.where} (part {part} of {self.n_parts})", Bucket=self.store.bucket,
                Key=self.key, UploadId=self.upload_id, PartNumber=part, Body=body,
                ContentLength=len(body),
            )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            with self._lock:
                if self._failure is None:
                    self._failure = exc
            raise
        crash_point("mid_data")
        return str(result["ETag"])

    def _raise(self, exc: BaseException) -> None:
        if isinstance(exc, _Attempts):
            raise self.store._translate(exc) from exc.cause
        raise exc

    def write_range(self, lo: int, hi: int) -> None:
        """Start uploading the parts that begin in ``[lo, hi)``; returns without waiting."""
        if self.single:
            return
        with self._lock:
            if self._failure is not None:
                self._raise(self._failure)  # stop early: this save is lost anyway
            first = -(-lo // self.part_size)
            last = min(-(-hi // self.part_size), self.n_parts)
            if self.has_tail and self.tail is None:
                last = min(last, self.n_parts - 1)  # the last part waits for the tail
            for index in range(first, last):
                self._schedule(index + 1)

    def write_tail(self, data: bytes) -> None:
        if not self.has_tail:
            raise ValueError("this upload was begun without a tail")
        with self._lock:
            self.tail = bytes(data)
            if not self.single:
                self._schedule(self.n_parts)

    def finish(self) -> None:
        """Wait until every part is up (starting any not started yet)."""
        if self.single:
            return
        if self.has_tail and self.tail is None:
            raise ValueError("the tail of this upload was never written")
        with self._lock:
            for part in range(1, self.n_parts + 1):
                self._schedule(part)

        async def wait_all() -> list[str]:
            return list(await asyncio.gather(*(self._tasks[p] for p in range(1, self.n_parts + 1))))

        self.etags = self.store._run(wait_all())

    def _expected_etag(self) -> str:
        joined = b"".join(bytes.fromhex(e.strip('"')) for e in self.etags)
        return f'"{hashlib.md5(joined, usedforsecurity=False).hexdigest()}-{len(self.etags)}"'

    def publish(self) -> None:
        """Complete the upload (or PUT the small file): the object appears atomically."""
        store = self.store
        if self.single:
            body: Any = self.view if self.tail is None else bytes(self.view) + self.tail
            store._run(store._call("PutObject", self.where, Bucket=store.bucket, Key=self.key,
                                   Body=body, ContentLength=len(body)))
            self._closed = True
            return
        parts = [{"PartNumber": p, "ETag": e} for p, e in enumerate(self.etags, start=1)]
        try:
            store._run(store._call("CompleteMultipartUpload", self.where, Bucket=store.bucket,
                                   Key=self.key, UploadId=self.upload_id, MultipartUpload={"Parts": parts}))
        except StorageError as exc:
            # A retried Complete whose first try succeeded (the reply was lost) finds no upload:
            # if the object carries exactly the ETag of our parts, the publish did happen.
            if getattr(exc, "s3_code", None) != "NoSuchUpload" or getattr(exc, "attempts", 1) < 2:
                raise
            try:
                head = store._run(store._call("HeadObject", self.where, Bucket=store.bucket, Key=self.key))
            except CheckpointError:
                raise exc from None
            if head.get("ETag") != self._expected_etag():
                raise
        self._closed = True
        store._forget(self.name)

    def abort(self) -> None:
        """Stop the parts in flight, then abort the multipart upload; never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        store = self.store

        async def cancel_all() -> None:
            tasks = list(self._tasks.values())
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            store._run(cancel_all())
            if self.upload_id is not None:
                store._run(store._call("AbortMultipartUpload", self.where, Bucket=store.bucket,
                                       Key=self.key, UploadId=self.upload_id))
        except Exception as exc:  # noqa: BLE001 - abort never raises; cleanup finds what is left
            if getattr(exc, "s3_code", None) != "NoSuchUpload":
                import sys

                print(
                    f"stagesave: could not abort the multipart upload of {self.where}: {exc}; "
                    "stagesave.abort_stale_multipart_uploads() removes it later",
                    file=sys.stderr,
                )


def abort_stale_multipart_uploads(
    store_or_url: S3Store | Store | str,
    *,
    older_than_s: float = 3600.0,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Abort multipart uploads under a root that were started more than ``older_than_s`` ago.

    A process killed in the middle of a save leaves its upload open, and S3 bills the parts until
    it is aborted. Uploads younger than ``older_than_s`` are left alone: they may belong to a
    save still running (keep the default unless no process writes under this root).

    Args:
        store_or_url: An :class:`S3Store`, a tiered store whose remote tier is one, or a URL.
        older_than_s: Minimum age of an upload to abort, by its ``Initiated`` time.
        storage_options: s3fs arguments when a URL is given.

    Returns:
        ``s3://bucket/key`` of each aborted upload (one entry per upload).

    Raises:
        TypeError: the store is not on S3.
        CheckpointError: listing or aborting failed (access denied, no such bucket, ...).
    """
    own = False
    store: Any = store_or_url
    if isinstance(store_or_url, str):
        store = S3Store(store_or_url, storage_options)
        own = True
    elif not isinstance(store, S3Store) and isinstance(getattr(store, "remote", None), S3Store):
        store = store.remote
    if not isinstance(store, S3Store):
        raise TypeError(f"abort_stale_multipart_uploads needs an s3:// root, got {type(store_or_url).__name__}")
    prefix = f"{store.prefix}/" if store.prefix else ""
    cutoff = time.time() - older_than_s

    async def sweep() -> list[str]:
        aborted: list[str] = []
        markers: dict[str, str] = {}
        while True:
            page = await store._call("ListMultipartUploads", store.url, Bucket=store.bucket, Prefix=prefix,
                                     **markers)
            for upload in page.get("Uploads", []):
                initiated = upload.get("Initiated")
                if initiated is not None and initiated.timestamp() > cutoff:
                    continue
                key = upload["Key"]
                try:
                    await store._call("AbortMultipartUpload", f"s3://{store.bucket}/{key}",
                                      Bucket=store.bucket, Key=key, UploadId=upload["UploadId"])
                except _Attempts as failed:
                    if failed.code != "NoSuchUpload":  # finished or aborted meanwhile
                        raise
                    continue
                aborted.append(f"s3://{store.bucket}/{key}")
            if not page.get("IsTruncated"):
                return aborted
            markers = {"KeyMarker": page.get("NextKeyMarker", ""),
                       "UploadIdMarker": page.get("NextUploadIdMarker", "")}

    try:
        return store._run(sweep())
    finally:
        if own:
            store.close()
