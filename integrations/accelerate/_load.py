"""One ``load_state`` on every process: rank 0 chooses, everyone reads the same folder.

Rank 0 picks and proves the checkpoint (``_restore.py``) once every writer's saves are
committed, and the choice (or the error) travels to every process, so that all of them load the
same folder or raise the same error. A checkpoint at a URL is read from a local copy: rank 0's on
its host, a fresh one on every other host (:mod:`stagesave.restore.download`), removed once
nobody reads it any more. Accelerate's reads run inside :func:`._trust.guarded`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from stagesave import Checkpointer
from stagesave.restore import kept_images
from stagesave.restore.download import discard_download, download_folder

from . import _dist
from ._config import Options
from ._fsdp import load_sharded
from ._resources import Resources
from ._restore import LoadPlan, Unlisted, plan_explicit, plan_newest
from ._roots import AutoRoot, tier_of
from ._trust import guarded, refuse_unlisted_reads

__all__ = ["choose_plan", "load_everywhere"]


def choose_plan(
    input_dir: str | os.PathLike[str] | None, options: Options, config: Any,
    checkpointer: Callable[[str], Checkpointer], auto_root: Callable[[], AutoRoot],
    res: Resources, unlisted: Unlisted | None = None,
) -> LoadPlan:
    """On rank 0: the folder ``input_dir`` names, or under automatic naming the newest valid one.

    ``config`` is the Accelerator's ``ProjectConfiguration``; ``checkpointer(kind)`` and
    ``auto_root()`` as in the save path; ``res`` holds the tiered store, once there is one;
    ``unlisted`` finds files Accelerate would read that a proof does not list (such a folder
    cannot be loaded: skipped by a resume, refused when named).

    Raises:
        ValueError: no ``input_dir`` without automatic naming; ``input_dir`` does not exist.
        CheckpointNotFoundError: automatic naming found no checkpoint at all.
        IntegrityError: the named checkpoint is corrupt.
    """
    storage = dict(options.storage_options)
    if input_dir is not None:
        return plan_explicit(checkpointer("plain"), input_dir, options.verify_on_load, storage,
                             unlisted)
    if not config.automatic_checkpoint_naming:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    auto = auto_root()
    return plan_newest(
        checkpointer("auto"), auto.list_arg, options.verify_on_load, storage,
        lambda info: auto.folder_of(info, tier_of(res.tiered, info)), auto.plain_root,
        unlisted,
    )


def load_everywhere(
    accelerator: Any, choose: Callable[[], LoadPlan], read: Callable[[str], None], fsdp: bool,
    storage_options: Mapping[str, Any], trusted: bool,
) -> LoadPlan:
    """``choose()`` on rank 0, then ``read(local_folder)`` on every process; the plan loaded.

    ``read`` is Accelerate's own ``load_state``; under FSDP (``fsdp``) the DCP parts are
    loaded first, through stagesave's reader (:func:`._fsdp.load_sharded`). Under automatic
    naming (or from a stagesave proof) ``ProjectConfiguration.iteration`` continues after the
    loaded checkpoint.

    Raises:
        Whatever ``choose`` raised on rank 0 (on every process), or ``read`` raised here.
    """
    # what rank 0's choice verifies is kept in memory for the read that follows, not read twice
    with kept_images.keeping():
        return _load_everywhere(accelerator, choose, read, fsdp, storage_options, trusted)


def _load_everywhere(
    accelerator: Any, choose: Callable[[], LoadPlan], read: Callable[[str], None], fsdp: bool,
    storage_options: Mapping[str, Any], trusted: bool,
) -> LoadPlan:
    acc = accelerator
    world, rank = int(acc.num_processes), int(acc.process_index)
    _dist.barrier(world)  # every writer's saves are committed before anyone chooses
    chosen: tuple[LoadPlan | None, BaseException | None] = (None, None)
    if rank == 0:
        try:
            chosen = (choose(), None)
        except Exception as exc:  # noqa: BLE001, RUF100 - every process raises it below
            chosen = (None, exc)
    received: tuple[LoadPlan | None, BaseException | None]
    received = _dist.broadcast_from_main(chosen, world)
    plan, error = received
    if error is not None:
        raise error
    assert plan is not None
    local, own_copy = plan.local, None
    if plan.remote:
        if os.path.isdir(local):  # rank 0's copy, on this host
            own_copy = local if rank == 0 else None
        else:  # another host: fetch this host's own copy
            local = own_copy = download_folder(plan.folder, storage_options)
    try:
        refuse_unlisted_reads(acc, local, plan.names, fsdp, plan.folder)
        with guarded(local, plan.names, trusted):
            if fsdp:
                load_sharded(acc, local, functools.partial(read, local))
            else:
                read(local)
        _dist.barrier(world)  # nobody removes a copy another process still reads
    finally:
        if own_copy is not None:
            discard_download(own_copy)
    config = acc.project_configuration
    if plan.iteration is not None and (config.automatic_checkpoint_naming or plan.from_proof):
        config.iteration = plan.iteration + 1
    return plan
