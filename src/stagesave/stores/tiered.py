"""Tiered storage: commit to a fast local tier first, upload to a remote tier in the background.

A save that has to reach S3 before it counts is as slow as the link; a save on local NVMe is
durable in seconds but dies with the node. The tiered store gets both: the whole commit protocol
(``saving/commit.py``) runs against the local tier, so a checkpoint is committed as soon as it is
on local disk, and every local commit queues an upload that copies the committed bytes, which
carry their own proof, to the remote tier (invisible until published, a folder's carrier last),
reading the committed local file through ``mmap`` and checking each chunk against its proof on
the way, so a copy that rotted on disk is never published remotely. A failed upload never fails
the save: it is reported (stderr, telemetry with ``tier="remote"`` and ``error``) and retried
after the next local commit.

Each tier has its own retention; local retention never removes a checkpoint whose upload is still
pending (it would be the only copy). Reads choose, per checkpoint, the newest committed copy,
preferring the local tier on a tie, so ``latest()`` restores from local disk when the local copy
is valid and from the remote tier otherwise (another node wrote a newer one, or the local disk
was wiped). While the remote tier fails, reads skip it for ``remote_retry_after_s``.

This module is the store; the uploads and retention are ``saving/upload.py`` (a step of a save),
the choice of a tier for reads is ``tier_route.py``.
"""

from __future__ import annotations

import builtins
import os
from contextlib import AbstractContextManager
from typing import Any

from ..errors import ClosedError
from ..ondisk.names import DIR_MANIFEST, TMP_MARKER, split_manifest_name
from ..saving.retire import remove_checkpoint
from ..saving.upload import Uploader, register_for_exit, unregister_for_exit
from ..telemetry import SaveTelemetry, TelemetryCallback
from .base import ObjectInfo, PendingWrite, Reader, Store
from .targets import open_store
from .tier_route import LOCAL, REMOTE, TierRouter

__all__ = ["TieredStore"]


class _LocalWrite(PendingWrite):
    """The local tier's pending write; its publish is the local commit, which queues an upload."""

    def __init__(self, store: TieredStore, name: str, inner: PendingWrite) -> None:
        self.store = store
        self.name = name
        self.inner = inner
        self.direct = getattr(inner, "direct", None)

    def write_range(self, lo: int, hi: int) -> None:
        self.inner.write_range(lo, hi)

    def write_tail(self, data: bytes) -> None:
        self.inner.write_tail(data)

    def flush(self) -> None:
        self.inner.flush()

    def finish(self) -> None:
        self.inner.finish()

    def publish(self) -> None:
        self.inner.publish()
        if TMP_MARKER in self.name:
            return  # a file of a folder being assembled: the folder uploads once committed
        self.store._queue_upload(self.name)

    def abort(self) -> None:
        self.inner.abort()


class TieredStore(Store):
    """A fast local tier and a remote tier behind one checkpoint root.

    Args:
        local: The local tier: a :class:`LocalStore` or a directory (NVMe).
        remote: The remote tier: a store or a URL (``s3://...``, any fsspec URL, a path).
        storage_options: fsspec/s3fs options used when ``remote`` is a URL.
        keep_local: Committed checkpoints kept on the local tier (``None``: all). A checkpoint
            whose upload has not succeeded yet is never removed from the local tier.
        keep_remote: Committed checkpoints kept on the remote tier (``None``: all).
        upload_threads: Threads uploading chunks of one file in parallel.
        telemetry_callback: Called with a :class:`SaveTelemetry` (``tier="remote"``) after each
            upload, committed or failed.
        remote_retry_after_s: After a remote failure, reads skip the remote tier this long.
        remote_timeout_s: A read of the remote tier (listing, choosing a tier) that takes
            longer counts as a failure (uploads have no such deadline).

    Raises:
        ValueError: a retention count below 1.
    """

    def __init__(
        self,
        local: Store | str | os.PathLike[str],
        remote: Store | str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        keep_local: int | None = None,
        keep_remote: int | None = None,
        upload_threads: int = 4,
        telemetry_callback: TelemetryCallback | None = None,
        remote_retry_after_s: float = 30.0,
        remote_timeout_s: float = 10.0,
    ) -> None:
        for what, n in (("keep_local", keep_local), ("keep_remote", keep_remote)):
            if n is not None and n < 1:
                raise ValueError(f"{what} must be >= 1 or None, got {n}")
        self.local = open_store(local, None)
        self.remote = open_store(remote, storage_options)
        if self.local.local_path("") is None:
            raise ValueError(f"the local tier must be a local directory, got {self.local.url}")
        self.url = self.remote.url
        self.keep_local = keep_local
        self.keep_remote = keep_remote
        self.remote_retry_after_s = remote_retry_after_s
        self.remote_timeout_s = remote_timeout_s
        #: Which tier each checkpoint is read from.
        self._routes = TierRouter(self.local, self.remote, retry_after_s=remote_retry_after_s,
                                 timeout_s=remote_timeout_s)
        #: The background uploads to the remote tier, and both tiers' retention.
        self._uploads = Uploader(
            self.local, self.remote, keep_local=keep_local, keep_remote=keep_remote,
            threads=upload_threads, telemetry_callback=telemetry_callback,
            on_remote_failure=self._routes.remote_failed,
        )
        self._closed = False
        register_for_exit(self)

    def tier_of(self, name: str) -> str:
        """``"local"`` or ``"remote"``: where reads of ``name`` go now.

        Meaningful once ``info`` or ``latest`` chose the tier of its checkpoint.
        """
        return REMOTE if self._routes.tier(name) is self.remote else LOCAL

    # ------------------------------------------------------------------ Store: writing (local)
    def check_writable(self, name: str, size: int) -> None:
        self.local.check_writable(name, size)

    def begin_write(
        self, name: str, image: memoryview, size: int, *, tail: bool = False
    ) -> PendingWrite:
        self._routes.set_local(name)
        return _LocalWrite(self, name, self.local.begin_write(name, image, size, tail=tail))

    def put_atomic(self, name: str, data: bytes) -> None:
        self.local.put_atomic(name, data)
        self._routes.set_local(name)
        parent, _, leaf = name.rpartition("/")
        if leaf == DIR_MANIFEST and TMP_MARKER not in parent:
            # A folder manifest written where the folder already is: that write is the commit.
            # A folder assembled under a temporary name commits when it is renamed into place
            # (``folder_committed``).
            self._queue_upload(parent)

    def folder_committed(self, directory: str) -> None:
        """The folder ``directory`` was renamed into place on the local tier: queue its upload.

        Wherever the folder was assembled (a hidden sibling, or a ``staging_dir`` outside the
        root), the upload reads the committed folder under its final name.
        """
        self._queue_upload(directory)

    def _queue_upload(self, name: str) -> None:
        """``name`` is committed on the local tier: queue its upload. With the upload queue
        closed, that is reported (stderr, telemetry); the local commit stands (the save does not
        fail: it is committed)."""
        try:
            self._uploads.committed(name)
        except ClosedError as exc:
            self._uploads.report_failure(
                name,
                f"uploading {self.remote.describe(name)} was not queued ({exc}); the local "
                "checkpoint is committed",
                None,
            )

    @property
    def direct_io(self) -> bool:
        """Whether the local tier writes with O_DIRECT (folders staged outside it write alike)."""
        return bool(getattr(self.local, "direct_io", True))

    def commit_lock(self, name: str) -> AbstractContextManager[None]:
        """The local tier's commit lock: every commit (and aside repair) happens there."""
        return self.local.commit_lock(name)

    def delete(self, name: str) -> None:
        """Delete a file from both tiers.

        From the remote tier after the uploads queued before this call.
        """
        self.local.delete(name)
        self._uploads.forget(name)
        self._uploads.delete_remote(name, lambda: self.remote.delete(name))

    def retire(self, name: str, is_dir: bool | None, debris_dir: str | None = None) -> None:
        """Remove the checkpoint ``name`` from both tiers (``commit.remove_checkpoint``): at once
        from the local tier, from the remote tier after the uploads queued before this call."""
        local = self.local.local_path(name)
        if is_dir is None:
            is_dir = local is not None and os.path.isdir(local)
        remove_checkpoint(self.local, name, is_dir=is_dir, debris_dir=debris_dir)
        self._uploads.forget(name)
        self._uploads.delete_remote(name,
                                   lambda: remove_checkpoint(self.remote, name, is_dir=is_dir))

    # ------------------------------------------------------------------ Store: reading (routed)
    def info(self, name: str) -> ObjectInfo:
        store, fallback = self._route_for_read(name)
        try:
            return store.info(name)
        except FileNotFoundError:
            if fallback is None:
                raise
            return fallback.info(name)

    def open(self, name: str) -> Reader:
        store, fallback = self._route_for_read(name)
        try:
            return store.open(name)
        except FileNotFoundError:
            if fallback is None:
                raise
            return fallback.open(name)

    def _route_for_read(self, name: str) -> tuple[Store, Store | None]:
        """The tier to read ``name`` from, and the one to try when it is not there (if any)."""
        if self._uploads.is_deleting(name):  # deleted; only a new local commit can exist
            return self.local, None
        return self._routes.for_read(name)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        return self._routes.tier(name).read_range(name, offset, length)

    def read_into(self, name: str, offset: int, out: memoryview) -> int:
        return self._routes.tier(name).read_into(name, offset, out)

    def local_path(self, name: str) -> str | None:
        return self.local.local_path(name) if self._routes.tier(name) is self.local else None

    def describe(self, name: str) -> str:
        return self._routes.tier(name).describe(name)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Both tiers' files; for a checkpoint routed to one tier, that tier's file and manifests.

        A name deleted from both tiers is not listed from the remote tier while its queued
        remote removal has not run yet (the removal follows the uploads queued before it).
        """
        only = self._routes.folder_tier(prefix)
        if only is not None:  # a folder checkpoint is read from one tier, all of it
            return only.list(prefix)
        local = {i.name: i for i in self.local.list(prefix)}
        remote_files = self._routes.remote_list(lambda: self.remote.list(prefix))
        deleting = self._uploads.deleting()
        remote = {i.name: i for i in remote_files if i.name not in deleting}
        out = []
        for name in sorted(local.keys() | remote.keys()):
            routed = self._routes.routed(name)
            first, second = (remote, local) if routed == REMOTE else (local, remote)
            info = first.get(name)
            if info is None:
                if routed is not None and split_manifest_name(name.rpartition("/")[2]) is not None:
                    continue  # a manifest of the copy that is not read
                info = second[name]
            out.append(info)
        return out

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        only = self._routes.folder_tier(prefix)
        if only is not None:
            return only.list_dirs(prefix)
        dirs = set(self.local.list_dirs(prefix))
        dirs.update(self._routes.remote_list(lambda: self.remote.list_dirs(prefix)))
        return sorted(dirs)

    # ------------------------------------------------------------------ uploads
    def attach_telemetry(self, callback: TelemetryCallback) -> None:
        """Also send upload telemetry to ``callback`` (e.g. the Checkpointer's own)."""
        self._uploads.attach_telemetry(callback)

    def wait_uploads(self, timeout: float | None = None) -> builtins.list[SaveTelemetry]:
        """Wait until every queued upload has finished; return the records since the last call.

        Raises:
            TimeoutError: uploads still running after ``timeout`` seconds.
        """
        return self._uploads.wait(timeout)

    def pending_uploads(self) -> builtins.list[str]:
        """Names committed locally whose upload has not succeeded yet."""
        return self._uploads.pending()

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float | None = None) -> None:
        """Finish queued uploads, then release both tiers. Safe to call more than once.

        Raises:
            TimeoutError: uploads still running after ``timeout`` seconds (they are abandoned).
        """
        if self._closed:
            return
        self._closed = True
        unregister_for_exit(self)
        try:
            if not self._uploads.stop(timeout):
                raise TimeoutError(f"uploads to {self.remote.url} still running after {timeout} s")
        finally:
            self._routes.close()
            self.local.close()
            self.remote.close()

    def __enter__(self) -> TieredStore:  # noqa: PYI034, RUF100 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
