"""Which Accelerators save asynchronously, and why the others keep Accelerate's own methods.

Runs that Accelerate saves through other machinery (DeepSpeed, Megatron-LM, XLA, FSDP with
other state dict types) keep Accelerate's synchronous methods, announced by one
:class:`SynchronousFallbackWarning`.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from stagesave.stores import urls

from . import _fsdp
from ._config import Options, is_switched_off

__all__ = ["SynchronousFallbackWarning", "fallback_reason", "synchronous_reason"]

logger = logging.getLogger("stagesave.accelerate")

#: What Accelerate needs from an ``Accelerator`` for the asynchronous path.
_REQUIRED_ATTRS = (
    "_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects",
    "_save_model_state_pre_hook", "project_configuration", "scaler", "step", "get_state_dict",
)


class SynchronousFallbackWarning(UserWarning):
    """Issued once when an Accelerator keeps Accelerate's own synchronous save_state/load_state."""


def fallback_reason(accelerator: Any, options: Options) -> str | None:
    """Why ``accelerator`` keeps Accelerate's synchronous methods (``None``: it need not)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    missing = [a for a in _REQUIRED_ATTRS if not hasattr(accelerator, a)]
    if missing:
        from importlib.metadata import version

        return (
            f"this Accelerate version ({version('accelerate')}) lacks {', '.join(missing)}, "
            "which stagesave reads to reproduce save_state's layout"
        )
    if kind == DistributedType.FSDP:
        reason = _fsdp.unsupported_reason(accelerator)
        remote = options.destination is not None and urls.is_url(options.destination)
        if reason is None and (options.local_tier or remote):
            reason = (
                "FSDP checkpoints are assembled from their DCP parts by renames in a local "
                "folder; URL destinations and local_tier are not supported with FSDP"
            )
        return reason
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        return (
            f"{kind.value} runs save model and optimizer shards through {kind.value}'s own "
            "functions, which stagesave does not stage"
        )
    if kind == DistributedType.XLA:
        return "XLA runs need xm.mark_step() and XLA-side saving, which stagesave does not do"
    return None


def synchronous_reason(accelerator: Any, options: Options) -> str | None:
    """Why an ``AcceleratorCheckpointer`` keeps Accelerate's own methods (``None``: it need not).

    Switched off by ``STAGESAVE_ACCELERATE``: logged; any other reason: one
    :class:`SynchronousFallbackWarning`, for the code that built the checkpointer.
    """
    if is_switched_off():
        logger.info("stagesave.accelerate is switched off by STAGESAVE_ACCELERATE; "
                    "using Accelerate's save_state")
        return "switched off by STAGESAVE_ACCELERATE"
    reason = fallback_reason(accelerator, options)
    if reason is not None:
        warnings.warn(
            f"stagesave.accelerate: {reason}; save_state and load_state stay "
            "Accelerate's own synchronous methods for this Accelerator (no checkpoint "
            "is written asynchronously).",
            SynchronousFallbackWarning,
            stacklevel=4,
        )
    return reason
