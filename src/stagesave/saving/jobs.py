"""The background jobs of a Checkpointer: what "write and commit" and "retire" mean for a file,
a folder, a removal and an action, run by the pipeline's one job body (:mod:`.pipeline`)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..handle import SaveHandle
from ..stores.base import Store
from ..stores.local import LocalStore
from ..telemetry import SaveTelemetry
from . import inflight
from .commit import commit_file, commit_folder
from .pipeline import Job
from .retire import remove_checkpoint, retain
from .write import FileToWrite, WriteStats, Written

__all__ = ["SaveSpec", "Settings", "action_job", "file_job", "folder_job", "remove_job"]

#: Telemetry fields known only after the commit: kept out of the manifest (written before it).
_POST_COMMIT = ("path", "error", "commit_s", "time_to_commit_s", "committed_at", "tier")


class Staged(Protocol):
    """What a job writes: the staged files (``device``: the device holding them with
    ``device_staging``, else ``None``), device copies to wait for, a buffer to give back."""

    @property
    def files(self) -> list[FileToWrite]: ...

    @property
    def device(self) -> Any: ...

    def wait(self) -> None: ...

    def give_back(self) -> None: ...


@dataclass
class SaveSpec:
    """What a save job writes, in values (a writer agent rebuilds the job from it)."""

    kind: str  # "file" or "folder"
    store: Store
    name: str
    meta: dict[str, Any]
    t_start: float
    staging_dir: str | None = None
    nested: list[str] = field(default_factory=list)


class Settings(Protocol):
    """The options of the Checkpointer a job runs for, read when the job runs."""

    @property
    def checksum(self) -> str: ...

    chunk_bytes: int
    keep_last: int | None


def record(tel: SaveTelemetry, stats: WriteStats) -> dict[str, Any]:
    """Fold the write's figures into ``tel``; return what goes into the file's index."""
    tel.write_s, tel.fsync_s, tel.direct_io = stats.write_s, stats.fsync_s, stats.direct_io
    tel.checksum_s += stats.checksum_s
    stats.checksum_s = 0.0
    tel.throughput_bytes_per_s = tel.bytes / stats.write_s if stats.write_s > 0 else 0.0
    return {k: v for k, v in tel.to_dict().items() if k not in _POST_COMMIT}


def _write_device(
    store: Store,
    f: FileToWrite,
    settings: Settings,
    pool: cf.Executor,
    stats: WriteStats,
    tel: SaveTelemetry,
) -> Written:
    """Write the data of a file staged in device memory (``device_staging``)."""
    from .stage_device import gpudirect_kvikio, write_device_data  # torch: not in an agent

    assert isinstance(store, LocalStore)
    kvikio = gpudirect_kvikio()
    tel.gpudirect = kvikio is not None
    return write_device_data(
        store,
        f,
        algorithm=settings.checksum,
        chunk_bytes=settings.chunk_bytes,
        pool=pool,
        stats=stats,
        kvikio=kvikio,
    )


def _committed(tel: SaveTelemetry, t_start: float) -> None:
    tel.time_to_commit_s = time.perf_counter() - t_start
    tel.committed_at = time.time()


def file_job(
    handle: SaveHandle,
    store: Store,
    name: str,
    staged: Staged,
    *,
    settings: Settings,
    meta: dict[str, Any],
    t_start: float,
) -> Job:
    """Write and commit the one file of a file checkpoint, then apply ``keep_last``."""
    tel = handle.telemetry
    (f,) = staged.files

    def commit(pool: cf.Executor) -> None:
        stats = WriteStats()
        written = None
        if staged.device is not None:
            written = _write_device(store, f, settings, pool, stats, tel)
        c0 = time.perf_counter()
        done = commit_file(
            store,
            f,
            algorithm=settings.checksum,
            chunk_bytes=settings.chunk_bytes,
            pool=pool,
            stats=stats,
            metadata=meta,
            telemetry=lambda: record(tel, stats),
            written=written,
        )
        tel.bytes = done.length
        tel.commit_s = time.perf_counter() - c0 - (stats.write_s if written is None else 0.0)
        _committed(tel, t_start)

    def retire() -> None:
        if settings.keep_last is not None:
            retain(store, name.rpartition("/")[0], settings.keep_last)

    return Job(handle, f"saving checkpoint {tel.path}", commit, staged=staged, retire=retire,
               spec=SaveSpec("file", store, name, meta, t_start))


def folder_job(
    handle: SaveHandle,
    store: Store,
    dname: str,
    staged: Staged,
    *,
    settings: Settings,
    meta: dict[str, Any],
    t_start: float,
    staging_dir: str | None,
    nested: list[str],
) -> Job:
    """Write every file of a folder checkpoint, commit the folder, then apply ``keep_last``."""
    tel = handle.telemetry

    def commit(pool: cf.Executor) -> None:
        stats = WriteStats()
        write: Callable[[Store, FileToWrite], Written] | None = None
        if staged.device is not None:

            def write(s: Store, f: FileToWrite) -> Written:
                return _write_device(s, f, settings, pool, stats, tel)

        c0 = time.perf_counter()
        done = commit_folder(
            store,
            dname,
            staged.files,
            algorithm=settings.checksum,
            chunk_bytes=settings.chunk_bytes,
            pool=pool,
            stats=stats,
            metadata=meta,
            telemetry=lambda: record(tel, stats),
            staging_dir=staging_dir,
            write=write,
            nested=nested,
        )
        record(tel, stats)
        tel.bytes = sum(w.length for w in done)
        tel.commit_s = time.perf_counter() - c0 - stats.write_s
        _committed(tel, t_start)

    def retire() -> None:
        if settings.keep_last is not None:
            # removed folders wait for their deletion in staging_dir too, out of the listing
            debris = staging_dir if staging_dir is not None and store.local_path("") else None
            retain(store, dname.rpartition("/")[0], settings.keep_last, debris_dir=debris)

    return Job(handle, f"saving checkpoint {tel.path}", commit, staged=staged, retire=retire,
               spec=SaveSpec("folder", store, dname, meta, t_start, staging_dir, nested))


def remove_job(handle: SaveHandle, store: Store, name: str) -> Job:
    """Delete a checkpoint after every save of it pending in the process when it was asked."""
    before = inflight.pending(handle.path)  # other instances' saves of this path come first

    def commit(pool: cf.Executor) -> None:
        for earlier in before:
            earlier.exception()
        remove_checkpoint(store, name)

    return Job(handle, f"removing checkpoint {handle.path}", commit)


def action_job(handle: SaveHandle, fn: Callable[[], None], description: str) -> Job:
    """Run ``fn`` in the queue's order (``Checkpointer.run_after``)."""
    return Job(handle, description, lambda pool: fn())


def staging_dir_of(staging_dir: str | os.PathLike[str] | None) -> str | None:
    return os.fspath(staging_dir) if staging_dir is not None else None
