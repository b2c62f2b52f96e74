"""Accelerate 1.x's checkpoint folder, file by file, as states for ``Checkpointer.save_dir``.

This mirrors ``accelerate.checkpointing.save_accelerator_state`` and ``save_custom_state``
(names, numbering, which process writes what) so that Accelerate's own ``load_state`` reads the
result unchanged. The one deliberate difference is where per-process files come from: Accelerate
lets every process write into a shared folder, whereas a stagesave folder is committed whole by
one writer. The writer therefore receives every process's RNG state (gathered on the training
thread, see ``_dist.py``) and writes ``random_states_<rank>.pkl`` for each; ``scaler.pt`` and
``dl_state_dict.bin``, which Accelerate lets every process overwrite with the same name, come
from the writer itself.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from stagesave.formats import Safetensors

__all__ = ["METADATA_KEY", "collect_rng_state", "model_file_name", "state_files"]

#: Key of the adapter's entry in the ``metadata`` of the folder's proof
#: (``save_dir(metadata=...)``).
METADATA_KEY = "accelerate"

_MODEL = "pytorch_model"
_SAFE_MODEL = "model"
_OPTIMIZER = "optimizer"
_SCHEDULER = "scheduler"
_SAMPLER = "sampler"
_SCALER = "scaler.pt"
_RNG = "random_states"


def model_file_name(index: int, safe_serialization: bool) -> str:
    """``model.safetensors``/``pytorch_model.bin``, then ``model_1.safetensors`` ..."""
    stem = _SAFE_MODEL if safe_serialization else _MODEL
    ext = "safetensors" if safe_serialization else "bin"
    return f"{stem}.{ext}" if index == 0 else f"{stem}_{index}.{ext}"


def _numbered(stem: str, index: int, ext: str = "bin") -> str:
    return f"{stem}.{ext}" if index == 0 else f"{stem}_{index}.{ext}"


def collect_rng_state(step: int) -> dict[str, Any]:
    """This process's RNG states, exactly the dict Accelerate pickles into
    ``random_states_<rank>.pkl``."""
    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    from accelerate.utils import get_torch_accelerator_backend, is_torch_xla_available

    device_type, device_module = get_torch_accelerator_backend()
    if device_type is not None:
        key = f"torch_{device_type}_manual_seed"
        if device_module is getattr(torch, "accelerator", None):
            if hasattr(torch.accelerator, "random"):
                states[key] = torch.accelerator.random.get_rng_state()
            else:
                states[key] = torch.get_device_module(device_type).get_rng_state()
        elif device_type == "mps":
            states[key] = device_module.get_rng_state()
        else:
            states[key] = device_module.get_rng_state_all()
    if is_torch_xla_available():
        import torch_xla.core.xla_model as xm

        states["xm_seed"] = xm.get_rng_state()
    return states


def _model_content(state: Any, safe_serialization: bool) -> Any:
    if not safe_serialization:
        return state
    from accelerate.utils import clean_state_dict_for_safetensors

    # Accelerate's `save` cleans aliasing only for OrderedDicts (what `state_dict()` returns).
    tensors = clean_state_dict_for_safetensors(state) if isinstance(state, OrderedDict) else state
    return Safetensors(tensors, {"format": "pt"})


def state_files(
    accelerator: Any,
    weights: list[Any],
    safe_serialization: bool,
    rng_states: dict[int, dict[str, Any]],
    *,
    optimizers: bool = True,
) -> dict[str, Any]:
    """Every file of the folder Accelerate's ``save_state`` would write, name -> content.

    ``weights`` are the model state dicts after the save pre-hooks ran (hooks may remove some,
    as Accelerate allows); ``rng_states`` maps process index to :func:`collect_rng_state`.
    ``optimizers=False`` leaves out ``optimizer*.bin`` (FSDP saves optimizers as DCP folders,
    and its ``weights`` are empty for the same reason).
    """
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    files: dict[str, Any] = {}
    for i, state in enumerate(weights):
        files[model_file_name(i, safe_serialization)] = _model_content(state, safe_serialization)
    for i, opt in enumerate(accelerator._optimizers if optimizers else ()):
        files[_numbered(_OPTIMIZER, i)] = opt.state_dict()
    for i, scheduler in enumerate(accelerator._schedulers):
        files[_numbered(_SCHEDULER, i)] = scheduler.state_dict()
    for i, dataloader in enumerate(accelerator._dataloaders):
        if isinstance(dataloader.dataset, IterableDatasetShard):
            sampler = dataloader.get_sampler()
            if isinstance(sampler, SeedableRandomSampler):
                files[_numbered(_SAMPLER, i)] = sampler
        if getattr(dataloader, "use_stateful_dataloader", False):
            files[_numbered("dl_state_dict", i)] = dataloader.state_dict()
    if accelerator.scaler is not None:
        files[_SCALER] = accelerator.scaler.state_dict()
    for rank in sorted(rng_states):
        files[f"{_RNG}_{rank}.pkl"] = rng_states[rank]
    for i, obj in enumerate(accelerator._custom_objects):
        files[f"custom_checkpoint_{i}.pkl"] = obj.state_dict()
    return files
