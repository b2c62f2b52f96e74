"""The staging buffer of a run's first save, made before that save (issue 20).

The first ``save_state`` of a process otherwise makes its host staging buffer as it copies:
memory reserved and every page mapped inside the save, which then blocks several times longer
than the saves after it (BENCHMARKS.md). Once every optimizer of the Accelerator stepped (their
state exists then; also after a ``load_state``) the checkpointer measures the state a
``save_state`` would write and has the Checkpointer make a buffer of that size on a thread
(:meth:`stagesave.Checkpointer.prepare_buffer`), while training goes on.

Only where that save will come through stagesave and be alike: an asynchronous checkpointer
(not Accelerate's synchronous path, not FSDP's sharded saves, not ``device_staging``), on the
process that writes the folder, with no save hook that may change what is saved.
``prepare_buffer`` (the option): ``None`` makes it when the Accelerator trains on an
accelerator, whose host cores are free during a step; on a CPU-only run making it took cores
from training (measured for Lightning fits, BENCHMARKS.md). A failure to decide or measure is
logged and the first save makes its buffer as before: it never breaks training.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from stagesave.saving.sizing import checkpoint_bytes

from ._save import writes

__all__ = ["first_save_bytes", "makes_buffer_ahead"]

log = logging.getLogger("stagesave.accelerate")


def makes_buffer_ahead(accelerator: Any, option: bool | None) -> bool:
    """Whether this process makes its first save's buffer ahead (``option``: the
    ``prepare_buffer`` option; ``None``: when training runs on an accelerator). Not when a save
    hook (``register_save_state_pre_hook``) may change what is saved (e.g. adapters only: the
    models' size would hold far more memory than the save needs)."""
    wanted = accelerator.device.type != "cpu" if option is None else option
    return (bool(wanted) and writes(accelerator)
            and not getattr(accelerator, "_save_model_state_pre_hook", None))


def first_save_bytes(accelerator: Any) -> int:
    """About the size of the folder a ``save_state`` writes now: the prepared models' and
    optimizers' state tensors and those of the modules registered for checkpointing
    (schedulers, RNG states and the rest fit the fixed allowance)."""

    def values() -> Iterator[Any]:
        for model in accelerator._models:
            yield from model.state_dict().values()
        for prepared in accelerator._optimizers:
            optimizer = getattr(prepared, "optimizer", prepared)
            for per_param in optimizer.state.values():
                yield from per_param.values() if isinstance(per_param, dict) else ()
        for obj in getattr(accelerator, "_custom_objects", ()):
            # modules only (an EMA copy of the weights): another object's state_dict may gather
            # from every process, and only this one asks here
            if isinstance(obj, torch.nn.Module):
                yield from obj.state_dict().values()

    return checkpoint_bytes(values())


def logged(what: str, exc: BaseException) -> None:
    """Report a failure of the buffer ahead (the first save makes its buffer as before)."""
    log.warning("stagesave: could not make the first save's staging buffer ahead (%s: %r); the "
                "first save makes it", what, exc)
