"""One ``save_state`` of an FSDP run with ``SHARDED_STATE_DICT``: parts from every rank, one folder.

Every rank stages its shards as DCP folders through ``stagesave.dcp`` (``_fsdp.py``); the main
process stages the other files (scheduler, RNG states, custom objects) with
``Checkpointer.save_dir``. Each part commits on its own inside a private work folder, and the
checkpoint is published by one rename once every rank confirmed its parts: the core's
:mod:`stagesave.saving.assemble` does that on the writer threads. Rank 0 checks the target and
creates the work folder first and tells everyone, so that a refused save raises on every rank
before any collective of ``dcp.save``.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from stagesave import Checkpointer, SaveHandle
from stagesave.saving.assemble import (
    Assembly,
    create_work_folder,
    discard,
    first_error,
    folder_in,
    keep_newest,
    part_in,
    publish,
    write_ack,
)
from stagesave.stores import urls

from . import _dist, _fsdp
from ._hooks import run_save_hooks
from ._layout import state_files
from ._resources import Resources
from ._roots import AutoRoot, refuse_existing
from ._save import metadata, rng_states

__all__ = ["save_sharded"]


def _work_folder(
    checkpointer: Callable[[str], Checkpointer], auto: AutoRoot | None, target: str,
    iteration: int,
) -> tuple[str, bool]:
    """On rank 0: refuse what cannot be saved, create the work folder; ``(work, replace_invalid)``.

    Raises:
        ValueError: a URL target; a valid checkpoint or a plain folder at an automatic
            target; any existing folder at an explicit target.
    """
    if urls.is_url(target):
        raise ValueError(f"FSDP checkpoints through stagesave need a local folder, got {target}")
    replace_invalid = False
    if auto is not None:
        replace_invalid = refuse_existing(checkpointer("fsdp"), auto, target, iteration)
    elif os.path.lexists(target):
        raise ValueError(
            f"{target} already exists: stagesave publishes an FSDP checkpoint by renaming it into "
            "place and does not replace existing folders; remove it or save to a new folder"
        )
    # beside the target (the core's temporary name for it), so publishing is one rename
    return create_work_folder(target), replace_invalid


def save_sharded(
    accelerator: Any, checkpointer: Callable[[str], Checkpointer], res: Resources,
    auto: AutoRoot | None, target: str, iteration: int, safe: bool,
) -> SaveHandle | None:
    """Every rank stages its shards (DCP parts); the main process the other files.

    ``auto``: the automatic-naming root (``None``: an explicit folder). Returns rank 0's handle
    of the whole checkpoint (done once it is published), ``None`` on the other ranks.

    Raises:
        ValueError: the target cannot be saved to (on every rank).
        CheckpointError: staging failed on this rank.
    """
    acc = accelerator
    world, rank = int(acc.num_processes), int(acc.process_index)
    t0 = time.perf_counter()
    leaf = urls.leaf(target)
    decision: tuple[tuple[str, bool] | None, BaseException | None] = (None, None)
    if rank == 0:
        try:
            decision = (_work_folder(checkpointer, auto, target, iteration), None)
        except Exception as exc:  # noqa: BLE001, RUF100 - every process raises it below
            decision = (None, exc)
    plan, error = _dist.broadcast_from_main(decision, world)
    if error is not None:
        raise error
    assert plan is not None
    work, replace_invalid = plan
    ckpt = checkpointer("fsdp")
    writer = res.dcp_writer(ckpt)
    parts = _fsdp.part_names(acc)
    folder = folder_in(work, leaf)
    timeout = writer.commit_timeout
    handles: list[SaveHandle] = []
    try:
        handles = _fsdp.save_parts(acc, writer, part_in(work))
        hook_files = run_save_hooks(acc, [], leaf)
        states = rng_states(acc)
        if rank == 0:
            files = {**hook_files, **state_files(acc, [], safe, states, optimizers=False)}
            meta = metadata(acc, iteration, auto is not None, safe, fsdp={
                "parts": parts, "state_dict_type": "SHARDED_STATE_DICT",
                "fsdp_version": int(acc.state.fsdp_plugin.fsdp_version)})
            handles.append(ckpt.save_dir(files, folder, metadata=meta, nested=parts))
    except BaseException as failure:
        # Nothing will be published; the work folder goes once every rank is done with it.
        if rank == 0:
            ckpt.run_after(functools.partial(discard, work, world, timeout),
                           description=f"discarding {work}")
        else:
            ckpt.run_after(functools.partial(write_ack, work, rank, failure),
                           description=f"acknowledging {work}")
        raise
    if rank != 0:
        ckpt.run_after(lambda: write_ack(work, rank, first_error(handles)),
                       description=f"acknowledging {work}")
        return None
    assembly = Assembly(work, folder, [(part_in(work, p), p) for p in parts], handles, target,
                        replace_invalid, world, timeout, what="FSDP checkpoint")
    # retention's numbers are read here: the writer thread never touches the Accelerator
    keep = acc.project_configuration.total_limit if auto is not None else None
    root = auto.root if auto is not None else ""
    handle = ckpt.run_after(lambda: publish(assembly, lambda: keep_newest(root, keep)),
                            description=target)
    handle.telemetry.blocking_s = time.perf_counter() - t0
    handle.telemetry.bytes = sum(h.telemetry.bytes for h in handles)
    return handle
