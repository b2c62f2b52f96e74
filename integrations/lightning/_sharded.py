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

The folder holds exactly Lightning's files: ``.metadata`` (the carrier of the folder's proof,
stagesave's format 2, ``docs/format.md``), one ``__<rank>_0.distcp`` per rank (each with its own
proof) and ``meta.pt``. ``meta.pt`` is the plain ``torch.save`` file Lightning writes; the
coordinator's writer (``extra_files``, in the core) writes it durably into the folder while the
folder is still being assembled (DCP's global planning step, before any rank writes), and the
commit lists it, with its checksums, in the folder's proof: the rename that makes the folder
visible publishes it too, a committed folder always has it, and a failure to write it fails the
save on every rank before anything is staged. It is small and written synchronously; the shards
are the large part. The folder's proof also records ``framework``, ``epoch`` and
``global_step``, like every Lightning checkpoint's.

Lightning's own strategies load these folders without stagesave; loading here checks every
byte against the folder's proof and unpickles with stagesave's allow-list. Plain Lightning
folders (no proof) load too, unverified.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan

import stagesave.dcp as sdcp
from stagesave import (
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
    IntegrityError,
    LocalStore,
    SaveHandle,
)
from stagesave.dcp import StagedStorageReader, StagedStorageWriter
from stagesave.errors import UsageError
from stagesave.restore.discovery import folder_entries, resolve_dir, verify_entry
from stagesave.saving.plan import plan_torch_file

from ._options import LIGHTNING_SAFE_GLOBALS, lightning_metadata
from ._plugin import StagedCheckpointIO

__all__ = ["META_FILE", "ShardedCheckpoints"]

#: Lightning's name for the non-tensor part of a sharded checkpoint, inside the folder
#: (``lightning.fabric.utilities.load._METADATA_FILENAME``).
META_FILE = "meta.pt"


def _stagesave_cause(exc: CheckpointException) -> BaseException:
    """The stagesave error a DCP call wrapped (the lowest rank's), else DCP's own exception."""
    for rank in sorted(exc.failures):
        error: BaseException = exc.failures[rank][0]
        if isinstance(error, CheckpointError):
            cause: BaseException = error
            return cause
    return exc


def _meta_bytes(meta: dict[str, Any]) -> bytes:
    """``meta`` as Lightning writes it (``torch.save``), on the caller's thread.

    Raises:
        stagesave.UnsupportedObjectError: a value cannot be pickled (the message names it).
    """
    out = io.BytesIO()
    try:
        torch.save(meta, out)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError):
        plan_torch_file(meta)  # stagesave's planner names the value that cannot be saved
        raise
    return out.getvalue()


class _ShardWriter(StagedStorageWriter):
    """A ``StagedStorageWriter`` whose coordinator also puts ``meta.pt`` into the folder."""

    def __init__(self, checkpointer: Any) -> None:
        super().__init__(checkpointer=checkpointer)
        self.meta: dict[str, Any] | None = None

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.meta is None:
            raise UsageError("stagesave.lightning: a sharded save without Lightning's metadata")
        # the coordinator's stagesave.dcp writer commits it with the folder, in its proof
        self.extra_files = {META_FILE: _meta_bytes(self.meta)}
        return super().prepare_global_plan(plans)


def _meta_problems(store: LocalStore, info: CheckpointInfo) -> list[str]:
    """Check ``meta.pt`` of a committed format-2 folder against the folder's proof.

    Returns the problems (empty: intact). ``meta.pt`` with a proof of its own (a member) is
    checked when it is loaded; one listed in the folder's proof (Lightning's plain file) here.
    """
    entries, found = folder_entries(store, info)
    problems: list[str] = list(found)
    for name, _own, listed in entries:
        if name == META_FILE and listed is not None:
            problems += verify_entry(store, f"{info.name}/{META_FILE}", listed)
    return problems


class ShardedCheckpoints:
    """The sharded saves and loads of one strategy, on its :class:`StagedCheckpointIO`."""

    def __init__(self) -> None:
        self._writer: _ShardWriter | None = None

    def _writer_for(self, plugin: StagedCheckpointIO) -> _ShardWriter:
        ckpt = plugin.checkpointer
        if self._writer is None or self._writer.checkpointer is not ckpt:
            self._writer = _ShardWriter(ckpt)
        return self._writer

    def save(
        self, plugin: StagedCheckpointIO, state: dict[str, Any], meta: dict[str, Any], path: str
    ) -> SaveHandle:
        """On every rank: stage this rank's shards of ``state`` into the folder ``path``.

        Inside a fit it returns once staged; the folder (with ``meta`` as ``meta.pt``) is
        committed once every rank's part is durable. Anywhere else it returns once committed (as
        a single file does). Collectives run here, on the training thread, as in Lightning.

        Raises:
            stagesave.CheckpointError: staging failed here or on another rank, ``meta.pt``
                could not be written, or an earlier background save failed.
        """
        run = plugin._run
        asynchronous = run.asynchronous()
        writer = self._writer_for(plugin)
        writer.meta = meta
        writer.metadata = lightning_metadata(meta)  # recorded in the folder's proof
        try:
            handle = sdcp.save(state, path, writer=writer)
        finally:
            writer.meta = None
        plugin.track(path, handle)
        if asynchronous:
            # inside a fit, as for a file: the run keeps its checkpointer (this writer's kept
            # plans) until teardown, and top-k removals queue behind the saves instead of
            # waiting for them on the training thread
            run.mark_asynchronous()
            return handle
        try:  # outside a fit: committed when it returns, on every rank, as a file
            handle.result()
        finally:
            run.release_if_idle()
        return handle

    def load(
        self,
        plugin: StagedCheckpointIO,
        path: str,
        weights_only: bool | None,
        fill: Callable[[StagedStorageReader], None],
    ) -> dict[str, Any]:
        """On every rank: let ``fill`` load the sharded state from the folder; return ``meta.pt``.

        ``fill`` runs DCP loads with the reader it is given. A folder that carries a stagesave
        proof is checked against it: every file it lists is there (always), DCP reads no other
        (always), and with ``verify_on_load``
        byte for byte, ``meta.pt`` here and the shards as the reader reads them; a plain
        Lightning folder (no proof) is read as it is, still with the safe unpickler.

        Raises:
            stagesave.CheckpointNotFoundError: no ``meta.pt`` in the folder.
            stagesave.IntegrityError: the folder does not match its proof.
            stagesave.UnsafeCheckpointError: an item needs a class that is not allow-listed.
        """
        plugin.wait()  # a pending save of this folder commits first, on every rank
        path = os.path.abspath(path)
        meta_path = os.path.join(path, META_FILE)
        if not os.path.isfile(meta_path):
            raise CheckpointNotFoundError(
                f"{path} is not a Lightning sharded checkpoint: it has no {META_FILE}"
            )
        # The folder's own proof, if any (proofs only): a missing file is refused even without
        # verify_on_load, which adds the checksums; a file it does not list is the user's,
        # which DCP may not read (the reader refuses an item stored in one).
        real = os.path.realpath(path)  # a save_last="link" link: the folder it names
        store = LocalStore(os.path.dirname(real))
        info = resolve_dir(store, os.path.basename(real))
        problems = list(info.problems) if info.status == "corrupt" else []
        verify = plugin.verify_on_load and info.status == "committed"
        if verify and info.format == 2:
            problems += _meta_problems(store, info)
        if problems:
            raise IntegrityError(f"checkpoint {path} is corrupt: {'; '.join(problems)}")
        meta = plugin.load_checkpoint(meta_path, weights_only=weights_only)
        m = info.manifest if info.status == "committed" else None
        # without verify_on_load still: DCP reads only files the proof lists
        listed = frozenset(m.folder.names()) if m is not None and m.folder is not None else None
        reader = StagedStorageReader(path, verify=verify, trusted=weights_only is False,
                                     safe_globals=[*LIGHTNING_SAFE_GLOBALS, *plugin.safe_globals],
                                     listed=listed)
        try:
            fill(reader)
        except CheckpointException as exc:
            raise _stagesave_cause(exc) from exc
        return meta

    def close(self) -> None:
        """Give up saves that never reached DCP's ``finish()``."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.abandon(
                "the strategy was torn down before dcp.save reached finish()", raised=False
            )
