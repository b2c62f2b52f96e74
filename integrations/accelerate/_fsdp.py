"""Accelerate's FSDP sharded checkpoints through ``stagesave.dcp``.

Under FSDP with ``SHARDED_STATE_DICT`` Accelerate's ``save_state`` writes each model and each
optimizer as a DCP folder (``pytorch_model_fsdp_<i>``, ``optimizer_<i>``) with the synchronous
``dcp.save`` and torch's ``FileSystemWriter``, on every rank. Here every rank calls the same
synchronous ``dcp.save`` on the same state dicts, built the way Accelerate 1.x builds them
(``save_fsdp_model``/``save_fsdp_optimizer``: FSDP1's ``state_dict_type`` context, FSDP2's
``StateDictOptions``), but with a :class:`~stagesave.dcp.StagedStorageWriter`: it returns once
this rank's shards are in its host buffer, and the ranks' files are written and committed in the
background. Loading mirrors ``load_fsdp_model``/``load_fsdp_optimizer`` with a
:class:`~stagesave.dcp.StagedStorageReader`, so DCP metadata and non-tensor items are unpickled
under stagesave's allow-list. The folders are genuine DCP folders: Accelerate's own
``load_state`` reads them too.

Other FSDP state dict types (``FULL_STATE_DICT``, ``LOCAL_STATE_DICT``) and per-node saves keep
Accelerate's synchronous path (see ``_support.fallback_reason``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from stagesave import SaveHandle

if TYPE_CHECKING:
    import stagesave.dcp as sdcp

__all__ = ["load_parts", "load_sharded", "part_names", "save_parts", "unsupported_reason"]

#: Accelerate's names (``accelerate.utils.constants``): ``<name>_<index>`` DCP folders.
FSDP_MODEL_NAME = "pytorch_model_fsdp"
OPTIMIZER_NAME = "optimizer"

#: Accelerate's private helpers this module mirrors Accelerate with (checked before use).
_HELPERS = (
    "_get_model_state_dict", "_set_model_state_dict", "_prepare_sd_options", "_unwrap_optimizer",
)


def unsupported_reason(accelerator: Any) -> str | None:
    """Why this FSDP Accelerator cannot save through ``stagesave.dcp`` (``None``: it can)."""
    from accelerate.utils import fsdp_utils

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:
        return "this FSDP Accelerator has no fsdp_plugin to read the state dict type from"
    state_dict_type = getattr(plugin, "state_dict_type", None)
    kind = getattr(state_dict_type, "name", str(state_dict_type))
    if kind != "SHARDED_STATE_DICT":
        return (
            f"FSDP runs with state_dict_type={kind} save through Accelerate's own torch.save calls "
            "(stagesave stages FSDP checkpoints with SHARDED_STATE_DICT, through stagesave.dcp)"
        )
    if accelerator.project_configuration.save_on_each_node:
        return (
            "FSDP runs with save_on_each_node=True write a DCP folder per node, which stagesave "
            "does not commit"
        )
    missing = [h for h in _HELPERS if not hasattr(fsdp_utils, h)]
    if missing:
        from importlib.metadata import version

        return (
            f"this Accelerate version ({version('accelerate')}) lacks accelerate.utils.fsdp_utils."
            f"{', '.join(missing)}, which stagesave uses to build FSDP state dicts as Accelerate "
            "does"
        )
    return None


def part_names(accelerator: Any) -> list[str]:
    """The DCP folders of one checkpoint, in the order :func:`save_parts` writes them."""
    models = [f"{FSDP_MODEL_NAME}_{i}" for i in range(len(accelerator._models))]
    return models + [f"{OPTIMIZER_NAME}_{i}" for i in range(len(accelerator._optimizers))]


@contextmanager
def _state_dict_context(plugin: Any, model: Any) -> Iterator[Any]:
    """FSDP1's ``state_dict_type`` context (FSDP2 needs none); yields the FSDP2 options."""
    from accelerate.utils.fsdp_utils import _prepare_sd_options

    if plugin.fsdp_version == 1:
        from torch.distributed.fsdp.fully_sharded_data_parallel import (
            FullyShardedDataParallel as FSDP,
        )

        ctx: Any = FSDP.state_dict_type(
            model, plugin.state_dict_type, plugin.state_dict_config, plugin.optim_state_dict_config
        )
    else:
        ctx = nullcontext()
    with ctx:
        yield _prepare_sd_options(plugin)


def _optimizer_state(plugin: Any, model: Any, optimizer: Any, options: Any) -> Any:
    if plugin.fsdp_version == 2:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        from accelerate.utils.fsdp_utils import _unwrap_optimizer

        return get_optimizer_state_dict(model, _unwrap_optimizer(optimizer), options=options)
    from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

    return FSDP.optim_state_dict(model, optimizer)


def save_parts(accelerator: Any, writer: sdcp.StagedStorageWriter, base: str) -> list[SaveHandle]:
    """On every rank: stage each model and optimizer as a DCP folder under ``base``.

    Returns this rank's handles (on the coordinator, each completes when its folder commits).
    Collectives run here, on the calling thread, as in Accelerate's own ``save_state``.

    Raises:
        CheckpointError: staging failed on this rank (the other ranks' ``dcp.save`` raise too).
    """
    import stagesave.dcp as sdcp
    from accelerate.utils.fsdp_utils import _get_model_state_dict

    plugin = accelerator.state.fsdp_plugin
    handles = []
    for i, model in enumerate(accelerator._models):
        with _state_dict_context(plugin, model) as options:
            state = _get_model_state_dict(model, sd_options=options)
            path = f"{base}/{FSDP_MODEL_NAME}_{i}"
            handles.append(sdcp.save({"model": state}, path, writer=writer))
    for i, optimizer in enumerate(accelerator._optimizers):
        model = accelerator._models[i]
        with _state_dict_context(plugin, model) as options:
            state = _optimizer_state(plugin, model, optimizer, options)
            path = f"{base}/{OPTIMIZER_NAME}_{i}"
            handles.append(sdcp.save({"optimizer": state}, path, writer=writer))
    return handles


def load_parts(accelerator: Any, folder: str) -> None:
    """On every rank: load each model's and optimizer's DCP folder in ``folder`` in place.

    The caller has already proven the folders against their proofs (every byte, with
    ``verify_on_load``) before anything is loaded, so a corrupt checkpoint never half-loads;
    the reader therefore does not hash a second time. It still unpickles DCP's ``.metadata``
    and non-tensor items under stagesave's allow-list, which plain Accelerate folders get too,
    and reads no file a part's proof does not list (files beside it are the user's).

    Raises:
        CheckpointError: a folder is missing, or an item is not allow-listed.
    """
    import stagesave.dcp as sdcp
    from accelerate.utils.fsdp_utils import (
        _get_model_state_dict,
        _set_model_state_dict,
        _unwrap_optimizer,
    )

    plugin = accelerator.state.fsdp_plugin

    def reader(part: str) -> sdcp.StagedStorageReader:
        # a part's proof (read, not hashed): DCP reads no file beside it
        from stagesave.restore.resolve_folder import resolve_dir
        from stagesave.stores.local import LocalStore

        try:
            m = resolve_dir(LocalStore(folder), part).manifest
        except OSError:
            m = None  # no such part: DCP's load says so
        listed = frozenset(m.folder.names()) if m is not None and m.folder is not None else None
        return sdcp.StagedStorageReader(verify=False, listed=listed)

    for i, model in enumerate(accelerator._models):
        with _state_dict_context(plugin, model) as options:
            state = {"model": _get_model_state_dict(model, sd_options=options)}
            part = f"{FSDP_MODEL_NAME}_{i}"
            sdcp.load(state, f"{folder}/{part}", reader=reader(part))
            _set_model_state_dict(model, state["model"], sd_options=options)
    for i, optimizer in enumerate(accelerator._optimizers):
        model = accelerator._models[i]
        with _state_dict_context(plugin, model) as options:
            optim = {"optimizer": _optimizer_state(plugin, model, optimizer, options)}
            part = f"{OPTIMIZER_NAME}_{i}"
            sdcp.load(optim, f"{folder}/{part}", reader=reader(part))
            if plugin.fsdp_version == 1:
                from torch.distributed.fsdp.fully_sharded_data_parallel import (
                    FullyShardedDataParallel as FSDP,
                )

                optimizer.load_state_dict(FSDP.optim_state_dict_to_load(
                    model=model, optim=optimizer, optim_state_dict=optim["optimizer"]
                ))
            else:
                from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

                set_optimizer_state_dict(
                    model, _unwrap_optimizer(optimizer), optim["optimizer"], options=options
                )


def load_sharded(accelerator: Any, folder: str, load_rest: Callable[[], None]) -> None:
    """The DCP parts through stagesave's reader, the rest through Accelerate's ``load_state``.

    ``load_rest()`` (Accelerate's own method) runs with no models and optimizers registered
    for its duration (exactly what it loads through ``load_fsdp_model``/``load_fsdp_optimizer``);
    under FSDP its hooks receive an empty model list either way.
    """
    acc = accelerator
    load_parts(acc, folder)
    models, optimizers = acc._models, acc._optimizers
    acc._models, acc._optimizers = [], []
    try:
        load_rest()
    finally:
        acc._models, acc._optimizers = models, optimizers
