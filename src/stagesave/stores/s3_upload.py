"""S3 multipart uploads whose parts are slices of the staging buffer.

s3fs's file object copies every byte into its own buffer, uploads one part at a time and
completes the upload when the ``with`` block exits, even on an error (a torn object). Here a data
file is one multipart upload (one PUT when small) whose parts are ``memoryview`` slices of the
staging image, sent concurrently over the store's bounded connections on s3fs's event loop, each
retried by :class:`~.s3_requests.S3Requests`. The upload is completed only by ``publish``, after
the manifest object exists (see ``saving/commit.py``); a failure at any step aborts it, so
nothing partial is ever published. Uploads left open by a killed process are found and aborted
by :func:`abort_stale_multipart_uploads`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._crash import crash_point
from ..errors import CheckpointError, StorageError
from .base import PendingWrite, Store
from .s3_requests import FailedRequest, S3Requests

if TYPE_CHECKING:
    from .s3 import S3Store

__all__ = [
    "DEFAULT_PART_BYTES",
    "MAX_OBJECT_BYTES",
    "MAX_PARTS",
    "MAX_PART_BYTES",
    "MIN_PART_BYTES",
    "MiB",
    "MultipartUpload",
    "abort_stale_multipart_uploads",
    "choose_part_size",
]

MiB = 1 << 20
#: S3's limits on multipart uploads.
MIN_PART_BYTES = 5 * MiB
MAX_PART_BYTES = 5 * 1024 * MiB
MAX_PARTS = 10_000
MAX_OBJECT_BYTES = 5 * (1 << 40)
#: Default part size (and single-PUT threshold): small enough for parallelism on 1 GiB files.
DEFAULT_PART_BYTES = 16 * MiB


def choose_part_size(size: int, preferred: int = DEFAULT_PART_BYTES) -> int:
    """The part size for a ``size``-byte object: ``preferred`` unless S3's limits forbid it.

    Parts are whole MiB, at least 5 MiB, at most 5 GiB, and no more than 10,000 of them.

    Raises:
        ValueError: the object exceeds S3's 5 TiB limit.
    """
    if size > MAX_OBJECT_BYTES:
        raise ValueError(
            f"{size} bytes exceeds S3's 5 TiB object limit; save smaller (sharded) files"
        )
    part = max(preferred, MIN_PART_BYTES, -(-size // MAX_PARTS))
    part = -(-part // MiB) * MiB
    return min(part, MAX_PART_BYTES)


class MultipartUpload(PendingWrite):
    """One data file: a multipart upload of image slices, or one PUT at publish time.

    With a tail (a format-2 proof), the last part is the image's last slice followed by the tail,
    uploaded once the tail is known; every other part is a slice of the image.

    Part tasks live on s3fs's event loop (``_tasks`` is touched only there); other threads
    schedule them with ``call_soon_threadsafe``, whose FIFO order guarantees that ``finish`` and
    ``abort``, submitted afterwards, see every part scheduled before them.

    Args:
        requests: The store's request engine.
        key: The object key.
        where: The object's display URL, for messages.
        image: The staging image; its first ``size`` bytes are the file.
        size: Bytes of the image to upload.
        tail: Whether :meth:`write_tail` appends bytes after them.
        part_size: The store's preferred part size.
        multipart_threshold: Files up to this size go up as one PUT.
        forget: Drops the store's pinned version of the name (called on begin and on publish).
    """

    def __init__(
        self,
        requests: S3Requests,
        key: str,
        where: str,
        image: memoryview,
        size: int,
        *,
        tail: bool,
        part_size: int,
        multipart_threshold: int,
        forget: Callable[[], None],
    ) -> None:
        self.requests = requests
        self.key = key
        self.where = where
        self.view = image[:size]
        self.size = size
        self.has_tail = tail
        self.tail: bytes | None = None
        self.single = size <= multipart_threshold
        self.part_size = choose_part_size(size, part_size)
        self.n_parts = max(1, math.ceil(size / self.part_size))
        self.upload_id: str | None = None
        self.etags: list[str] = []
        self._forget = forget
        self._tasks: dict[int, asyncio.Future[str]] = {}
        self._scheduled: set[int] = set()
        self._failure: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        forget()
        if not self.single:
            created = requests.run(requests.call(
                "CreateMultipartUpload", self.where, Bucket=requests.bucket, Key=self.key,
                ContentType="application/octet-stream",
            ))
            self.upload_id = str(created["UploadId"])

    def _schedule(self, part: int) -> None:
        """Start part ``part`` on the loop (caller holds ``_lock``)."""
        if part in self._scheduled or self._closed:
            return
        self._scheduled.add(part)
        self.requests.loop.call_soon_threadsafe(self._start, part)

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
            result = await self.requests.call(
                "UploadPart", f"{self.where} (part {part} of {self.n_parts})",
                Bucket=self.requests.bucket, Key=self.key, UploadId=self.upload_id,
                PartNumber=part, Body=body, ContentLength=len(body),
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
        if isinstance(exc, FailedRequest):
            raise self.requests.translate(exc) from exc.cause
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
            parts = range(1, self.n_parts + 1)
            return list(await asyncio.gather(*(self._tasks[p] for p in parts)))

        self.etags = self.requests.run(wait_all())

    def _expected_etag(self) -> str:
        joined = b"".join(bytes.fromhex(e.strip('"')) for e in self.etags)
        return f'"{hashlib.md5(joined, usedforsecurity=False).hexdigest()}-{len(self.etags)}"'

    def publish(self) -> None:
        """Complete the upload (or PUT the small file): the object appears atomically."""
        requests, bucket = self.requests, self.requests.bucket
        if self.single:
            body: Any = self.view if self.tail is None else bytes(self.view) + self.tail
            requests.run(requests.call("PutObject", self.where, Bucket=bucket, Key=self.key,
                                       Body=body, ContentLength=len(body)))
            self._closed = True
            return
        parts = [{"PartNumber": p, "ETag": e} for p, e in enumerate(self.etags, start=1)]
        try:
            requests.run(requests.call(
                "CompleteMultipartUpload", self.where, Bucket=bucket, Key=self.key,
                UploadId=self.upload_id, MultipartUpload={"Parts": parts},
            ))
        except StorageError as exc:
            # A retried Complete whose first try succeeded (the reply was lost) finds no upload:
            # if the object carries exactly the ETag of our parts, the publish did happen.
            if getattr(exc, "s3_code", None) != "NoSuchUpload" or getattr(exc, "attempts", 1) < 2:
                raise
            try:
                head = requests.run(requests.call("HeadObject", self.where, Bucket=bucket,
                                                  Key=self.key))
            except CheckpointError:
                raise exc from None
            if head.get("ETag") != self._expected_etag():
                raise
        self._closed = True
        self._forget()

    def abort(self) -> None:
        """Stop the parts in flight, then abort the multipart upload; never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        requests = self.requests

        async def cancel_all() -> None:
            tasks = list(self._tasks.values())
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            requests.run(cancel_all())
            if self.upload_id is not None:
                requests.run(requests.call("AbortMultipartUpload", self.where,
                                           Bucket=requests.bucket, Key=self.key,
                                           UploadId=self.upload_id))
        except Exception as exc:  # noqa: BLE001, RUF100 - abort never raises
            # (cleanup finds what is left)
            if getattr(exc, "s3_code", None) != "NoSuchUpload":
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
    from .s3 import S3Store  # the store module imports this one

    own = False
    store: Any = store_or_url
    if isinstance(store_or_url, str):
        store = S3Store(store_or_url, storage_options)
        own = True
    elif not isinstance(store, S3Store) and isinstance(getattr(store, "remote", None), S3Store):
        store = store.remote
    if not isinstance(store, S3Store):
        raise TypeError(
            "abort_stale_multipart_uploads needs an s3:// root, "
            f"got {type(store_or_url).__name__}"
        )
    requests, bucket = store.requests, store.bucket
    prefix = f"{store.prefix}/" if store.prefix else ""
    cutoff = time.time() - older_than_s

    async def sweep() -> list[str]:
        aborted: list[str] = []
        markers: dict[str, str] = {}
        while True:
            page = await requests.call("ListMultipartUploads", store.url, Bucket=bucket,
                                       Prefix=prefix, **markers)
            for upload in page.get("Uploads", []):
                initiated = upload.get("Initiated")
                if initiated is not None and initiated.timestamp() > cutoff:
                    continue
                key = upload["Key"]
                try:
                    await requests.call("AbortMultipartUpload", f"s3://{bucket}/{key}",
                                        Bucket=bucket, Key=key, UploadId=upload["UploadId"])
                except FailedRequest as failed:
                    if failed.code != "NoSuchUpload":  # finished or aborted meanwhile
                        raise
                    continue
                aborted.append(f"s3://{bucket}/{key}")
            if not page.get("IsTruncated"):
                return aborted
            markers = {"KeyMarker": page.get("NextKeyMarker", ""),
                       "UploadIdMarker": page.get("NextUploadIdMarker", "")}

    try:
        return requests.run(sweep())
    finally:
        if own:
            store.close()
