"""Sharded checkpoints through ``torch.distributed.checkpoint``, staged like every other save.

Every rank calls DCP's synchronous ``dcp.save`` with a :class:`StagedStorageWriter`; it returns
once this rank's shards are copied into its reused host buffer. Each rank then writes its own
file in the background, each file carrying its own proof, and a coordinator commits the folder
after every rank's file is durable by writing ``.metadata`` last, with the proof of the whole
folder, coordinating through the store only (never a collective in a background thread)::

    import torch.distributed.checkpoint as dcp
    from stagesave.dcp import StagedStorageReader, StagedStorageWriter

    writer = StagedStorageWriter(checkpointer=stagesave.Checkpointer("/ckpt", keep_last=3))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="/ckpt/step-100",
             storage_writer=writer)                        # returns after staging
    ...
    latest = writer.checkpointer.latest()                  # a verified folder, or None
    dcp.load(state, checkpoint_id=latest.path, storage_reader=StagedStorageReader())

The folder holds exactly the files torch's ``FileSystemWriter`` writes and is a genuine DCP
checkpoint (torch's ``FileSystemReader`` reads it without stagesave); it loads on any number of
ranks (DCP's planner reshards), and :func:`to_state_dict` / :func:`export` turn it into one plain
``torch.save`` file.
"""

from __future__ import annotations

import os
from typing import IO, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save

from ..errors import CheckpointError
from ..handle import SaveHandle
from ..saving.plan import gc_paused
from ._coordinator import check_extra_files
from ._exchange import Outcome, planned_save, steady_save
from ._planner import SplitReplicatedPlanner
from ._protocol import CommitTimeoutError
from ._reader import StagedStorageReader
from ._steady_planner import SteadySavePlanner
from ._writer import StagedStorageWriter

__all__ = [
    "CommitTimeoutError",
    "SplitReplicatedPlanner",
    "StagedStorageReader",
    "StagedStorageWriter",
    "SteadySavePlanner",
    "export",
    "load",
    "save",
    "to_state_dict",
]


def _full_save(steady: Outcome, path: Any, writer: StagedStorageWriter, planner: SavePlanner,
               process_group: dist.ProcessGroup | None) -> None:
    """A save planned from the state :func:`steady_save` set up (a first save, a changed
    structure): :func:`planned_save` under a process group with the writer's own planner,
    else ``dcp.save``."""
    if steady.dist is not None:
        planned_save(steady.state, writer, planner, steady.dist)
    else:
        _dcp_save(steady.state, checkpoint_id=path, storage_writer=writer, planner=planner,
                  process_group=process_group)


def _stagesave_error(exc: CheckpointException) -> BaseException | None:
    """The stagesave error inside DCP's wrapper: this rank's first, else the lowest rank's."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    failures = exc.failures
    order = ([rank] if rank in failures else []) + sorted(r for r in failures if r != rank)
    for r in order:
        err = failures[r][0]
        if isinstance(err, CheckpointError):
            return err
    return None


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    writer: StagedStorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> SaveHandle:
    """``dcp.save`` through ``writer``; returns this rank's handle (``result()`` = committed).

    ``planner``: default ``writer.planner`` (DCP's default planner, reusing its plans while the
    state's structure is the same: :class:`SteadySavePlanner`).

    Without ``writer`` a private one is made for this call, and the call waits for the commit.
    If ``dcp.save`` raises, the writer's pending commit is abandoned at once (instead of at its
    ``commit_timeout``) and a stagesave error is re-raised as itself rather than DCP's wrapper.

    Raises:
        CheckpointError: staging or (without ``writer``) the background write failed.
        torch.distributed.checkpoint.api.CheckpointException: another failure inside DCP.
    """
    own = writer is None
    w = StagedStorageWriter() if writer is None else writer
    check_extra_files(w.extra_files)  # a bad name is a ValueError now, not DCP's wrapped one
    plans = w.planner if planner is None else planner
    try:
        try:
            with gc_paused():  # DCP's planning makes ~10 objects per item: no collection now
                steady = steady_save(state_dict, path, w, plans, process_group)
                if steady.handle is None:
                    _full_save(steady, path, w, plans, process_group)
        except CheckpointException as exc:
            w.abandon(error=exc)
            w.exchanged.forget()
            inner = _stagesave_error(exc)
            if inner is not None:
                raise inner from exc
            raise
        except BaseException as exc:
            w.abandon(error=exc)
            w.exchanged.forget()
            raise
        handle = w.last_handle
        assert handle is not None
        if own:
            handle.result()
        return handle
    finally:
        if own:
            w.close()


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    reader: StagedStorageReader | None = None,
    planner: LoadPlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """``dcp.load`` of a stagesave folder into ``state_dict`` (in place, resharding as needed).

    Raises:
        CheckpointError: not committed, corrupt, unsafe; re-raised as itself, not DCP's wrapper.
        torch.distributed.checkpoint.api.CheckpointException: another failure inside DCP.
    """
    r = StagedStorageReader() if reader is None else reader
    try:
        with gc_paused():  # DCP's load planning makes ~10 objects per item: no collection now
            _dcp_load(state_dict, checkpoint_id=path, storage_reader=r, planner=planner,
                      process_group=process_group)
    except CheckpointException as exc:
        inner = _stagesave_error(exc)
        if inner is not None:
            raise inner from exc
        raise


def to_state_dict(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    trusted: bool = False,
    **reader_options: Any,
) -> dict[str, Any]:
    """The whole checkpoint as one plain state dict in this process (every shard gathered).

    Raises:
        CheckpointError: as :func:`load`.
    """
    reader = StagedStorageReader(path, verify=verify, trusted=trusted, **reader_options)
    reader.open()
    state: dict[str, Any] = {}
    try:
        with gc_paused():
            _load_state_dict(state, storage_reader=reader,
                             planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
                             no_dist=True)
    except CheckpointException as exc:
        inner = _stagesave_error(exc)
        if inner is not None:
            raise inner from exc
        raise
    return state


def export(
    path: str | os.PathLike[str], out: str | os.PathLike[str] | IO[bytes], **options: Any
) -> None:
    """Write the whole checkpoint to ``out`` as one plain ``torch.save`` file.

    ``options`` as in :func:`to_state_dict`.
    """
    torch.save(to_state_dict(path, **options), out)
