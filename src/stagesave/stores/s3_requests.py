"""One S3 request: sent on s3fs's event loop, retried under one budget, translated on failure.

botocore's own retries are turned off (an opaque budget per client); every request of the S3
store and of its multipart uploads goes through :meth:`S3Requests.call` instead, which retries
with exponential backoff and full jitter on throttling, server errors, timeouts and dropped
connections, and never on access or missing-bucket errors, which surface at once. A request that
gives up is translated into the stagesave exception family with a message that says what to do,
credentials scrubbed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    MissingExtraError,
    StorageError,
)

__all__ = [
    "ACCESS_CODES", "FailedRequest", "RetryPolicy", "S3Requests", "all_or_none", "error_code",
    "retryable",
]

T = TypeVar("T")

_RETRY_CODES = frozenset({
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
    "ThrottlingException", "RequestThrottled", "RequestLimitExceeded", "TooManyRequestsException",
    "IncompleteBody", "BadDigest", "XAmzContentSHA256Mismatch", "OperationAborted",
    "500", "502", "503", "504",
})
ACCESS_CODES = frozenset({
    "AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
    "AccountProblem", "ExpiredToken", "InvalidToken", "InvalidSecurity", "TokenRefreshRequired",
})
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


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


def error_code(exc: BaseException) -> str | None:
    """The S3 error code of a botocore error (or its HTTP status), ``None`` for other errors."""
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


def retryable(exc: BaseException) -> bool:
    """Throttling, server errors, timeouts and dropped connections; never access or absence."""
    import aiohttp
    from botocore import exceptions as bex

    code = error_code(exc)
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


class FailedRequest(Exception):
    """The last error of a request that gave up, and how many attempts it took.

    Raised on the event loop; :meth:`S3Requests.run` turns it into the stagesave family.
    """

    def __init__(self, op: str, cause: BaseException, attempts: int) -> None:
        super().__init__(op)
        self.op = op
        self.cause = cause
        self.attempts = attempts
        self.code = error_code(cause)
        #: What the request was about, for messages (set by :meth:`S3Requests.call`).
        self.where: str | None = None


class S3Requests:
    """s3fs's client and event loop for one bucket, with stagesave's retries and error mapping.

    Args:
        bucket: The bucket every request addresses.
        url: The root's display URL (messages about the root itself).
        options: s3fs arguments (``storage_options``); ``config_kwargs`` is merged into ours.
        max_connections: Requests in flight at once.
        retry: Backoff policy for every request.
        connect_timeout: Seconds to establish a connection.
        read_timeout: Seconds without progress on a response before the attempt is retried.

    Raises:
        MissingExtraError: s3fs is not installed.
    """

    def __init__(
        self,
        bucket: str,
        url: str,
        options: dict[str, Any],
        *,
        max_connections: int,
        retry: RetryPolicy,
        connect_timeout: float,
        read_timeout: float,
    ) -> None:
        self.bucket = bucket
        self.url = url
        self.max_connections = max_connections
        self.retry = retry
        options = dict(options)
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
        self.loop: asyncio.AbstractEventLoop = self.fs.loop
        self._sem: asyncio.Semaphore | None = None

    def scrub(self, text: str) -> str:
        """``text`` without the credentials of ``storage_options``."""
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on s3fs's loop from a plain thread; translate failures."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            result: T = future.result()
            return result
        except FailedRequest as failed:
            raise self.translate(failed) from failed.cause
        except BaseException:
            future.cancel()
            raise

    async def client(self) -> Any:
        """The aiobotocore client (created on first use)."""
        return await self.fs.set_session()

    def semaphore(self) -> asyncio.Semaphore:
        """The bound on requests in flight (created on the loop, on first use)."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_connections)
        return self._sem

    async def retrying(self, op: str, attempt_fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``attempt_fn`` under the retry policy; raise ``FailedRequest`` when it gives up."""
        attempt = 0
        while True:
            try:
                return await attempt_fn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                attempt += 1
                if not retryable(exc) or attempt >= self.retry.max_attempts:
                    raise FailedRequest(op, exc, attempt) from exc
                await asyncio.sleep(self.retry.delay(attempt - 1))

    async def call(self, op: str, where: str, **params: Any) -> dict[str, Any]:
        """One API call (``op`` as AWS spells it, ``"PutObject"``), retried.

        ``where`` names what it is about in messages.
        """
        method = "".join("_" + c.lower() if c.isupper() else c for c in op).lstrip("_")

        async def once() -> dict[str, Any]:
            async with self.semaphore():
                client = await self.client()
                result: dict[str, Any] = await getattr(client, method)(**params)
                return result

        try:
            return await self.retrying(op, once)
        except FailedRequest as failed:
            failed.where = where
            raise

    def translate(self, failed: FailedRequest) -> CheckpointError:
        """Map a failed request to the stagesave family, with a message that says what to do."""
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError

        where = failed.where or self.url
        cause, code, op = failed.cause, failed.code, failed.op
        raw = (
            f"{code}: {getattr(cause, 'response', {}).get('Error', {}).get('Message', '')}"
            if code else f"{type(cause).__name__}: {cause}"
        )
        detail = self.scrub(raw).rstrip(": ")
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
        elif code in ACCESS_CODES:
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
        elif retryable(cause):
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

    def close(self) -> None:
        """Close s3fs's session (best effort)."""
        creator = getattr(self.fs, "_s3creator", None)
        if creator is not None:
            with contextlib.suppress(Exception):  # closing is best effort
                type(self.fs).close_session(self.loop, creator)
            self.fs._s3creator = None
            self.fs._s3 = None


async def all_or_none(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Run the requests together; when one fails, the others are cancelled and awaited before
    the error goes on (``asyncio.gather`` leaves them running): no ranged GET of a failed read
    keeps writing into the caller's buffer (a retry's, or after the read returned)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
