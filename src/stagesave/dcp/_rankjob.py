"""One rank's background part of a sharded save, as a job of its checkpointer's pipeline:
write the rank's file (with its own proof), then commit the folder (the coordinator) or wait for
the commit (the other ranks); on failure tell the other ranks and give the save up."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..checkpointer import Checkpointer
from ..handle import SaveHandle
from ..saving.lease import Lease
from ..saving.pipeline import Job
from ..saving.plan import FileImage
from ..saving.retire import retain
from ..saving.stage import ImageCrcs
from ..saving.write import WriteStats
from ..stores.base import Store
from ._coordinator import abandon, commit
from ._format import FORMAT_KEY, FORMAT_VALUE, SAVE_ID_KEY, WORLD_SIZE_KEY
from ._protocol import (
    SAVE_ID_ATTR,
    MetadataSlot,
    SavePlanData,
    abandoned,
    discard_if_abandoned,
    gave_up_error,
    report_failure,
    wait_for_commit,
    write_rank,
)

__all__ = ["RankJob", "RankStaging"]


class RankStaging:
    """The staged bytes of one rank's file: device copies to wait for, a host lease to give back
    (as soon as the file is written: waiting for the other ranks must not hold a buffer)."""

    def __init__(self, lease: Lease, wait_device: Callable[[], None] | None) -> None:
        self.lease, self.wait_device = lease, wait_device
        self._given_back = False

    def wait(self) -> None:
        if self.wait_device is not None:
            self.wait_device()

    def give_back(self) -> None:
        if self._given_back:
            return
        self._given_back = True
        if self.wait_device is not None:
            with contextlib.suppress(Exception):
                self.wait_device()
        self.lease.give_back()


@dataclass
class RankJob:
    """One rank's background part of one save: write, then commit (coordinator) or wait."""

    ckpt: Checkpointer
    store: Store
    spec: SavePlanData
    staging: RankStaging
    image: FileImage
    crcs: ImageCrcs | None
    slot: MetadataSlot | None
    handle: SaveHandle
    started: float
    timeout: float
    user_metadata: dict[str, Any]
    wrote: bool = False
    committed: bool = False

    @property
    def what(self) -> str:
        return f"sharded checkpoint {self.handle.path}"

    def job(self) -> Job:
        """This rank's part as a job of the checkpointer's pipeline."""
        return Job(
            self.handle,
            f"saving {self.what}",
            self.commit,
            staged=self.staging,
            retire=self.retire,
            on_error=self.on_error,
        )

    def metadata(self) -> dict[str, Any]:
        """What the folder's proof records besides the files: the user's metadata and the save's."""
        return {
            **self.user_metadata,
            FORMAT_KEY: FORMAT_VALUE,
            SAVE_ID_KEY: self.spec.save_id,
            WORLD_SIZE_KEY: self.spec.world_size,
        }

    def _write(self, pool: cf.Executor) -> None:
        stats = WriteStats()
        try:
            member = write_rank(
                self.store,
                self.spec,
                self.image,
                self.staging.lease.buf.view,
                self.crcs,
                algorithm=self.ckpt.checksum,
                chunk_bytes=self.ckpt.chunk_bytes,
                pool=pool,
                stats=stats,
            )
        finally:
            self.staging.give_back()
        tel = self.handle.telemetry
        tel.bytes = member.size  # the file as written: its data and its proof
        tel.write_s, tel.fsync_s, tel.direct_io = stats.write_s, stats.fsync_s, stats.direct_io
        tel.checksum_s += stats.checksum_s
        stats.checksum_s = 0.0
        tel.throughput_bytes_per_s = self.image.size / stats.write_s if stats.write_s > 0 else 0.0

    def commit(self, pool: cf.Executor) -> None:
        """Write this rank's file, then commit the folder (coordinator) or wait for it."""
        spec, tel = self.spec, self.handle.telemetry
        self._write(pool)
        self.wrote = True
        c0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        if self.slot is not None:
            commit(
                self.store,
                spec,
                self.slot,
                self.metadata(),
                algorithm=self.ckpt.checksum,
                chunk_bytes=self.ckpt.chunk_bytes,
                pool=pool,
                stats=WriteStats(),
                deadline=deadline,
                what=self.what,
            )
            self.committed = True
        else:
            wait_for_commit(self.store, spec, deadline, self.what)
        tel.commit_s = time.perf_counter() - c0
        tel.time_to_commit_s = time.perf_counter() - self.started
        tel.committed_at = time.time()

    def retire(self) -> None:
        """Apply ``keep_last`` after the coordinator's commit."""
        if self.committed and self.ckpt.keep_last is not None:
            retain(self.store, self.spec.parent, self.ckpt.keep_last)

    def on_error(self, exc: BaseException, error: BaseException) -> BaseException:
        """Tell the other ranks, give the save up where this rank owns it; the error to report."""
        spec = self.spec
        if (
            self.slot is None
            and not self.wrote
            and isinstance(exc, FileNotFoundError)
            and abandoned(self.store, spec)
        ):
            # The coordinator had given up and removed the staging folder under this rank's
            # write: that is the failure to report.
            error = gave_up_error(self.what)
            error.__cause__ = exc
        if not self.wrote:
            report_failure(self.store, spec, exc)
        if self.slot is not None and not self.committed:
            abandon(self.store, spec)
        elif self.slot is None:
            discard_if_abandoned(self.store, spec)
        with contextlib.suppress(Exception):  # which save it is, for every rank it reaches
            setattr(error, SAVE_ID_ATTR, spec.save_id)
        return error
