"""``StagedStorageWriter``: ``dcp.save`` returns after one copy into host memory.

DCP calls a storage writer from inside ``dcp.save``: planning and the exchange of plans and write
results are collectives on the caller's thread, as they must be. This writer keeps them there and
changes only what ``write_data`` does: it lays out the rank's file (offsets known now), copies
every item into the rank's reused staging buffer, and returns DCP an already completed future
with the write results. The write itself (each rank file with its own proof), the markers and
the coordinator's commit (``.metadata`` with the folder's proof, written last) then run on the
checkpointer's background thread (``_protocol``), which makes only syscalls and hashes.

Why not ``dcp.async_save``: it runs the whole ``dcp.save`` (planning collectives included) on a
background thread, and a gloo collective off the training thread switches libgomp to passive
waiting and halves training speed while that thread lives. With this writer the synchronous
``dcp.save`` already returns after staging, so it is the call to use.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future
from typing_extensions import Self

from ..checkpointer import Checkpointer
from ..errors import UsageError, as_checkpoint_error
from ..handle import SaveHandle
from ..ondisk.names import TMP_MARKER, check_target_name
from ..saving.validate import check_proof_fits
from ..stores.base import Store
from ..telemetry import SaveTelemetry
from ._coordinator import (
    check_extra_files,
    clear_old_carrier,
    put_extra_files,
    take_lease,
)
from ._exchange import Exchanged
from ._format import lease
from ._metadata_bytes import MetadataPickler, StorageData
from ._protocol import MetadataSlot, SavePlanData, failed_saves, join, report_failure
from ._rank_bounds import rank_bounds, world_size
from ._rankfile import RankLayout, SkeletonCache, layout_rank_file
from ._rankjob import RankJob, RankStaging
from ._recent import Recent
from ._steady_planner import SteadySavePlanner
from ._unfinished import Unfinished

__all__ = ["StagedStorageWriter"]

#: Default seconds the coordinator waits for every rank's part (and the others for the commit).
DEFAULT_COMMIT_TIMEOUT = 1800.0


@dataclass
class _Save:
    """The state of the save in progress on this rank (from set-up to ``write_data``)."""

    started: float
    is_coordinator: bool
    store: Store
    name: str
    telemetry: SaveTelemetry
    slot: MetadataSlot | None = None
    spec: SavePlanData | None = None


class StagedStorageWriter(StorageWriter):
    """A DCP storage writer whose ``dcp.save`` returns after staging; the write is background.

    Use it with the synchronous ``torch.distributed.checkpoint.save`` on every rank::

        writer = StagedStorageWriter(checkpointer=ckpt)          # one per process, reused
        dcp.save(state_dict, checkpoint_id="/ckpt/step-100", storage_writer=writer)
        writer.last_handle.result()                              # optional: wait for the commit

    The folder is committed (and ``stagesave.latest`` sees it) once every rank's file is durable
    and the coordinator wrote ``.metadata`` (which carries the folder's proof) and published the
    folder; until then the previous checkpoint stays the latest.

    Args:
        path: The checkpoint folder (local path, URL, or relative to the checkpointer's root);
            ``checkpoint_id=`` of ``dcp.save`` replaces it for that save.
        checkpointer: The :class:`~stagesave.Checkpointer` whose buffers, background queue,
            retention and telemetry this writer shares. Default: a private one built from
            ``options`` and closed by :meth:`close`.
        commit_timeout: Seconds the coordinator waits for every rank's part after writing its
            own (and the other ranks wait for the commit) before the save fails.
        metadata: Stored in the folder's proof of every save (e.g. ``{"step": 100}``).
        extra_files: Small files (name -> bytes) the coordinator puts into the folder of the next
            save besides DCP's (Lightning's ``meta.pt``): written durably before any rank
            writes, listed with their checksums in the folder's proof, published with the
            folder. Consumed by that save (set it again for the next).
        **options: :class:`~stagesave.Checkpointer` arguments for the private checkpointer.

    Raises:
        ValueError: both ``checkpointer`` and checkpointer options were given, or a bad timeout.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        checkpointer: Checkpointer | None = None,
        commit_timeout: float = DEFAULT_COMMIT_TIMEOUT,
        metadata: dict[str, Any] | None = None,
        extra_files: dict[str, bytes] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if checkpointer is not None and options:
            raise ValueError(
                f"got a checkpointer and checkpointer options ({', '.join(sorted(options))}); "
                "configure the Checkpointer you pass instead"
            )
        if commit_timeout <= 0:
            raise ValueError(f"commit_timeout must be > 0 seconds, got {commit_timeout}")
        self._owned = checkpointer is None
        self._ckpt = checkpointer if checkpointer is not None else Checkpointer(**options)
        self.path = path
        self.commit_timeout = float(commit_timeout)
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.extra_files: dict[str, bytes] = dict(extra_files or {})
        check_extra_files(self.extra_files)
        self.last_handle: SaveHandle | None = None
        self._skeletons = SkeletonCache()
        self._layouts: Recent[RankLayout] = Recent()  # recent saves', reused for the same plan
        self._metadata_pickler = MetadataPickler()  # recent pickles, reused for the same plan
        self._storage_data = StorageData()  # .metadata's, reused for the same results
        self._planner: SteadySavePlanner | None = None
        self._save: _Save | None = None
        self._unfinished = Unfinished()
        self.exchanged = Exchanged()  # what steady saves sent (stagesave.dcp.save's exchange)
        self._recent_ids: deque[str] = deque(maxlen=64)

    @property
    def checkpointer(self) -> Checkpointer:
        """The checkpointer this writer runs on (for ``latest``, ``wait``, ``remove``...)."""
        return self._ckpt

    @property
    def planner(self) -> SteadySavePlanner:
        """This writer's save planner: DCP's default one, reusing its plans while the state's
        structure is the same. :func:`stagesave.dcp.save` uses it unless given another; pass it
        to ``dcp.save(..., planner=writer.planner)`` when calling DCP directly."""
        if self._planner is None:
            self._planner = SteadySavePlanner()
        return self._planner

    def _prepare_buffer(self) -> None:
        """When this writer's planner was just set up for this save (DCP sets the planner up
        first), make the staging buffer on a thread while DCP plans (host staging, the first
        save: nothing once a buffer is free), sized from the flat state."""
        planner = self._planner
        if planner is None or not planner.set_up_pending:
            return
        planner.set_up_pending = False
        prepare = self._ckpt.plans.prepare
        if prepare is not None:
            state = planner.state_dict
            prepare(lambda: rank_bounds(state, world_size()), only_when_empty=True)

    # ------------------------------------------------------------------ StorageWriter
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # a new save (DCP resets its writer first): what this call raises is not the last one's
        self._unfinished.starting()
        if checkpoint_id is not None:
            self.path = checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=os.fspath(self.path) if self.path is not None else None)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name.startswith("AsyncCheckpointExecutor"):
            raise UsageError(
                "StagedStorageWriter is meant for dcp.save, not dcp.async_save: async_save runs "
                "the planning collectives on a background thread, which slows training down while "
                "it lives. dcp.save with this writer already returns after staging; call dcp.save."
            )
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                "StagedStorageWriter needs dcp.save(use_collectives=True): the coordinator commits "
                "the folder once it knows every rank's plan"
            )
        if self.path is None:
            raise ValueError(
                "no checkpoint folder: pass checkpoint_id= to dcp.save or path= to the writer"
            )
        check_extra_files(self.extra_files)
        self.abandon("a new dcp.save started before the previous one reached finish() (it raised)",
                     raised=False)
        self._unfinished.starting()
        self._ckpt.pipeline.check_usable()
        store, name = self._ckpt.targets.split(self.path)
        check_target_name(name)
        tel = SaveTelemetry(path=store.describe(name), started_at=time.time())
        self._save = _Save(time.perf_counter(), is_coordinator, store, name, tel)
        self._prepare_buffer()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._current()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        s = self._current()
        save_id = secrets.token_hex(16)
        parent, _, leaf = s.name.rpartition("/")
        pid = os.getpid()
        hidden = join(parent, f".{leaf}.{pid}-{save_id[:8]}{TMP_MARKER}")
        local = s.store.local_path(s.name) is not None
        staging = hidden if local else s.name
        specs = [
            SavePlanData(
                i,
                len(plans),
                save_id,
                staging,
                s.name,
                pid,
                hidden,
                join(parent, lease(leaf, pid, save_id)),
                time.time_ns(),
            )
            for i in range(len(plans))
        ]
        # No rank writes before the plans go out: the lease exists before anyone could wait on
        # it, and on object stores the old folder loses its carrier before it is overwritten.
        try:
            take_lease(s.store, specs[0])
        except OSError as exc:
            raise as_checkpoint_error(
                exc, f"cannot save sharded checkpoint {s.telemetry.path}"
            ) from exc
        self._unfinished.took_lease(s.store, specs[0])
        if not local:
            clear_old_carrier(s.store, s.name)
        extra, self.extra_files = self.extra_files, {}
        put_extra_files(s.store, staging, extra, local=local, what=s.telemetry.path)
        return [dataclasses.replace(plan, storage_data=spec) for plan, spec in zip(plans, specs)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        s = self._current()
        spec = plan.storage_data
        if not isinstance(spec, SavePlanData):
            raise UsageError(
                "the save plan carries no stagesave data: StagedStorageWriter.prepare_global_plan "
                "did not run on the coordinator for this save (is every rank using this writer?)"
            )
        if spec.save_id in self._recent_ids:
            raise UsageError(
                "DCP reused a cached plan of an earlier save; StagedStorageWriter needs a fresh "
                "plan per save: create the planner with enable_plan_caching=False"
            )
        self._recent_ids.append(spec.save_id)
        s.spec = spec
        tel = s.telemetry
        ckpt = self._ckpt
        try:
            t0 = time.perf_counter()
            rank_image = layout_rank_file(
                plan.items, planner.resolve_data, spec.file_name, self._skeletons, self._layouts,
                planner.resolve_items if isinstance(planner, SteadySavePlanner) else None,
                planner.vouch if isinstance(planner, SteadySavePlanner) else None,
            )
            image = rank_image.image
            tel.plan_s = time.perf_counter() - t0
            check_proof_fits([(len(image.slots), image.size)], chunk_bytes=ckpt.chunk_bytes,
                             algorithm=ckpt.checksum, metadata={})
            s.store.check_writable(join(spec.staging, spec.file_name), image.size)
            lease = ckpt.memory.lease(image.size)
            tel.buffer_wait_s = lease.waited_s
            try:
                wait_device, crcs = ckpt.stager.stage_image(
                    image, lease.buf, 0, tel, algorithm=ckpt.checksum
                )
            except BaseException:
                lease.give_back()
                raise
        except BaseException as exc:
            # DCP reports this to every rank through its gathers; the marker makes the
            # coordinator's background side give up now instead of at its deadline (and the
            # lease the other ranks' background side, when this is the coordinator).
            report_failure(s.store, spec, exc)
            if s.is_coordinator:
                self._unfinished.drop_lease()
            raise
        tel.bytes = image.size
        tel.tensor_bytes = rank_image.tensor_bytes
        tel.blocking_s = time.perf_counter() - s.started
        if s.is_coordinator:
            s.slot = MetadataSlot()
        handle = SaveHandle(tel.path, tel)
        self.last_handle = handle
        self._unfinished.staged(handle, s.slot, spec.save_id)  # the commit job: the lease
        job = RankJob(
            ckpt,
            s.store,
            spec,
            RankStaging(lease, wait_device),
            image,
            crcs,
            s.slot,
            handle,
            s.started,
            self.commit_timeout,
            dict(self.metadata),
        )
        ckpt.pipeline.submit(job.job())
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(rank_image.results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        s = self._current()
        if s.slot is None or s.spec is None:
            raise UsageError("finish() was called before write_data() on the coordinator")
        try:
            metadata.version = CURRENT_DCP_VERSION
            metadata.storage_data = self._storage_data.of(results)
            metadata.storage_meta = StorageMeta(
                checkpoint_id=os.fspath(self.path) if self.path is not None else None,
                save_id=s.spec.save_id,
            )
            s.slot.fill(self._metadata_pickler.dumps(metadata))
        except BaseException as exc:
            s.slot.abandon(f"finish() failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._save = None

    # ------------------------------------------------------------------ lifecycle
    def abandon(self, reason: str = "dcp.save raised before finish()", *, raised: bool = True,
                error: BaseException | None = None) -> None:
        """``dcp.save`` raised: fail coordinator saves that will never get their metadata.

        Called by :func:`stagesave.dcp.save` when ``dcp.save`` raises (call it too where you
        catch ``dcp.save``'s error yourself), by the next save and by :meth:`close` (these with
        ``raised=False``); without it the commit job would wait until ``commit_timeout`` (and so
        would the other ranks, for a save whose commit job never started).

        The caller got the failed save's error from ``dcp.save``: its background side, which
        then fails too, is not raised again by a later save, ``wait`` or ``close`` (its handle's
        ``result()`` still raises it). ``raised``: this rank's latest ``dcp.save`` raised (a
        coordinator's save that never reached ``finish()`` is known to have raised). ``error``:
        what ``dcp.save`` raised; the earlier saves whose background failures it carries (on any
        rank: DCP hands one rank's error to every rank) count as delivered on this rank too.
        """
        self._unfinished.give_up(reason, raised=raised)
        if error is not None:
            self._unfinished.told(failed_saves(error))

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every save of the checkpointer committed or failed.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointError: a background save failed and its error was not delivered yet.
        """
        self._ckpt.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish pending saves; close the checkpointer if this writer created it; drop the
        plans, layouts and pickles kept for later saves (a later save makes them again)."""
        self.abandon("the writer was closed before dcp.save reached finish()", raised=False)
        self._layouts = Recent()
        self._metadata_pickler = MetadataPickler()
        self._storage_data = StorageData()
        self._planner = None
        self.exchanged = Exchanged()
        if self._owned:
            self._ckpt.close(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _current(self) -> _Save:
        if self._save is None:
            raise UsageError(
                "StagedStorageWriter was called outside dcp.save (set_up_storage_writer did "
                "not run)"
            )
        return self._save

