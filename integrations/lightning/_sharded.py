"""Lightning's sharded checkpoints, written and read through ``stagesave.dcp``.

Under FSDP with ``state_dict_type="sharded"`` and under ``ModelParallelStrategy`` Lightning
bypasses ``CheckpointIO``: every rank calls DCP's ``dcp.save`` with torch's ``FileSystemWriter``
(blocking until its shard is on storage) and rank 0 then ``torch.save``s the rest of the
checkpoint (loops, callbacks, hyper-parameters) as ``meta.pt`` into the folder. Here every rank
calls the same synchronous ``dcp.save`` with a :class:`~stagesave.dcp.StagedStorageWriter` on
the plugin's checkpointer, so it returns once the rank's shards are copied into its host buffer,
and the folder is committed in the background once every rank's file is durable. Sharing the
plugin's checkpointer orders ``ModelCheckpoint``'s removals and links after these saves, shares
the staging buffers, and sends the saves' telemetry to the same callback.

``meta.pt`` is written by the coordinator into the folder while it is still being assembled
(DCP's global planning step, before any rank writes), with a manifest of its own, so the commit
that makes the folder visible also publishes ``meta.pt``: a committed folder always has it, and
a failure to write it fails the save on every rank before anything is staged. It is small and
written synchronously; the shards are the large part.

The folder keeps Lightning's layout (DCP files plus ``meta.pt``), so Lightning's own strategies
load it without stagesave; loading here checks every byte against the manifests and unpickles
with stagesave's allow-list. Plain Lightning folders (no manifests) load too, unverified.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan

import stagesave.dcp as sdcp
from stagesave import (
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    IntegrityError,
    SaveHandle,
)
from stagesave.dcp import StagedStorageReader, StagedStorageWriter

from ._plugin import LIGHTNING_SAFE_GLOBALS, StagedCheckpointIO

__all__ = ["META_FILE", "ShardedCheckpoints"]

#: Lightning's name for the non-tensor part of a sharded checkpoint, inside the folder
#: (``lightning.fabric.utilities.load._METADATA_FILENAME``).
META_FILE = "meta.pt"


def _staging_folder(target: str, plans: Sequence[SavePlan]) -> str:
    """The hidden folder the ranks assemble ``target`` in, as the writer planned it."""
    staging = getattr(plans[0].storage_data, "staging", None) if plans else None
    if not isinstance(staging, str) or not getattr(plans[0].storage_data, "renames", False):
        raise RuntimeError(
            "stagesave.lightning cannot place meta.pt: this stagesave.dcp writer did not plan a "
            "staging folder beside the target (a local directory is required for Lightning's "
            "sharded checkpoints)"
        )
    return os.path.join(os.path.dirname(target), staging.rpartition("/")[2])


def _stagesave_cause(exc: CheckpointException) -> BaseException:
    """The stagesave error a DCP call wrapped (the lowest rank's), else DCP's own exception."""
    for rank in sorted(exc.failures):
        error: BaseException = exc.failures[rank][0]
        if isinstance(error, CheckpointError):
            cause: BaseException = error
            return cause
    return exc


class _ShardWriter(StagedStorageWriter):  # type: ignore[misc]
    """A ``StagedStorageWriter`` whose coordinator also puts ``meta.pt`` into the folder."""

    def __init__(self, checkpointer: Checkpointer, meta_checkpointer: Any) -> None:
        super().__init__(checkpointer=checkpointer)
        self._meta_checkpointer = meta_checkpointer
        self.meta: dict[str, Any] | None = None

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        if self.meta is None:
            raise RuntimeError("stagesave.lightning: a sharded save without Lightning's metadata")
        folder = _staging_folder(os.path.abspath(os.fspath(self.path or "")), plans)
        try:
            self._meta_checkpointer().save(self.meta, os.path.join(folder, META_FILE),
                                           metadata={"framework": "lightning"}).result()
        except BaseException:
            # No rank has written yet (that comes after this plan): the folder is ours alone.
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return plans


class ShardedCheckpoints:
    """The sharded saves and loads of one strategy, on its :class:`StagedCheckpointIO`."""

    def __init__(self) -> None:
        self._writer: _ShardWriter | None = None
        self._meta_ckpt: Checkpointer | None = None

    def _meta(self, plugin: StagedCheckpointIO) -> Checkpointer:
        if self._meta_ckpt is None:
            self._meta_ckpt = Checkpointer(
                max_pending=1, io_threads=1, pinned=False, checksum=plugin.checksum,
                direct_io=plugin.direct_io,
            )
        return self._meta_ckpt

    def _writer_for(self, plugin: StagedCheckpointIO) -> _ShardWriter:
        ckpt = plugin.checkpointer
        if self._writer is None or self._writer.checkpointer is not ckpt:
            self._writer = _ShardWriter(ckpt, lambda: self._meta(plugin))
        return self._writer

    def save(self, plugin: StagedCheckpointIO, state: dict[str, Any], meta: dict[str, Any], path: str) -> SaveHandle:
        """On every rank: stage this rank's shards of ``state`` into the folder ``path``.

        Returns once staged; the folder (with ``meta`` as ``meta.pt``) is committed once every
        rank's part is durable. Collectives run here, on the training thread, as in Lightning.

        Raises:
            stagesave.CheckpointError: staging failed here or on another rank, ``meta.pt``
                could not be written, or an earlier background save failed.
        """
        writer = self._writer_for(plugin)
        writer.meta = meta
        try:
            handle = sdcp.save(state, path, writer=writer)
        finally:
            writer.meta = None
        plugin.track(path, handle)
        return handle

    def load(
        self,
        plugin: StagedCheckpointIO,
        path: str,
        weights_only: bool | None,
        fill: Callable[[StagedStorageReader], None],
    ) -> dict[str, Any]:
        """On every rank: let ``fill`` load the sharded state from the folder; return ``meta.pt``.

        ``fill`` runs DCP loads with the reader it is given. A folder stagesave committed is
        checked byte for byte (with ``verify_on_load``); a plain Lightning folder (no
        manifests) is read as it is, still with the safe unpickler.

        Raises:
            stagesave.CheckpointNotFoundError: no ``meta.pt`` in the folder.
            stagesave.IntegrityError: a file does not match its manifest.
            stagesave.UnsafeCheckpointError: an item needs a class that is not allow-listed.
        """
        plugin.wait()  # a pending save of this folder commits first, on every rank
        meta_path = os.path.join(path, META_FILE)
        verify = False
        try:
            if plugin.verify_on_load:
                info = plugin.checkpointer.verify(meta_path)
                if info.status == "corrupt":
                    raise IntegrityError(f"checkpoint {path} is corrupt: {'; '.join(info.problems)}")
                verify = info.status == "verified"  # stagesave wrote it: the folder has a manifest
            meta = plugin.load_checkpoint(meta_path, weights_only=weights_only)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{path} is not a Lightning sharded checkpoint: it has no {META_FILE}"
            ) from exc
        reader = StagedStorageReader(path, verify=verify, trusted=weights_only is False,
                                     safe_globals=[*LIGHTNING_SAFE_GLOBALS, *plugin.safe_globals])
        try:
            fill(reader)
        except CheckpointException as exc:
            raise _stagesave_cause(exc) from exc
        return meta

    def close(self) -> None:
        """Give up saves that never reached DCP's ``finish()``; close the ``meta.pt`` writer."""
        writer, self._writer = self._writer, None
        meta, self._meta_ckpt = self._meta_ckpt, None
        if writer is not None:
            writer.abandon("the strategy was torn down before dcp.save reached finish()")
        if meta is not None:
            meta.close()
