"""One ``save_state`` of a replicated (non-FSDP) run: Accelerate's files, one writer, one commit.

Every file comes from the writing process (the main process, or each node's local main process
with ``save_on_each_node``); the others contribute their RNG state, gathered on the training
thread (``_dist.py``). The folder is handed to ``Checkpointer.save_dir``, which assembles it under
a dot-name beside the target and renames it into place once every file is durable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stagesave import Checkpointer, SaveHandle
from stagesave.stores import urls

from . import _dist
from ._hooks import run_save_hooks
from ._layout import METADATA_KEY, collect_rng_state, state_files
from ._roots import FOLDER_PREFIX, AutoRoot, refuse_existing

__all__ = ["metadata", "rng_states", "save_replicated", "target_of", "writes"]


def target_of(
    config: Any, auto_root: Callable[[], AutoRoot], output_dir: Any
) -> tuple[str, AutoRoot | None, int]:
    """``(target, auto, iteration)`` of a save under the Accelerator's ``ProjectConfiguration``:
    ``auto`` is the automatic-naming root (``auto_root()``, asked only then), ``None`` for an
    explicit ``output_dir``.

    Raises:
        ValueError: no ``output_dir`` without automatic naming.
    """
    iteration = int(config.iteration)
    if config.automatic_checkpoint_naming:
        auto = auto_root()
        return auto.name(f"{FOLDER_PREFIX}{iteration}"), auto, iteration
    if output_dir is None:
        raise ValueError(
            "save_state needs output_dir unless "
            "ProjectConfiguration(automatic_checkpoint_naming=True)"
        )
    return urls.normalize(output_dir), None, iteration


def writes(accelerator: Any) -> bool:
    """Whether this process writes the folder (its node's, with ``save_on_each_node``)."""
    if accelerator.project_configuration.save_on_each_node:
        return bool(accelerator.is_local_main_process)
    return bool(accelerator.is_main_process)


def metadata(
    accelerator: Any, iteration: int, automatic: bool, safe_serialization: bool, **extra: Any
) -> dict[str, Any]:
    """The save's ``{"accelerate": {...}}`` entry in the metadata of the folder's proof."""
    return {
        METADATA_KEY: {
            "iteration": iteration,
            "step": int(accelerator.step),
            "num_processes": int(accelerator.num_processes),
            "safe_serialization": bool(safe_serialization),
            "automatic_checkpoint_naming": automatic,
            **extra,
        }
    }


def rng_states(accelerator: Any) -> dict[int, Any]:
    """Every process's RNG state on the processes that write (``{}`` on the others)."""
    acc = accelerator
    return _dist.gather_to_writers(
        collect_rng_state(int(acc.step)), int(acc.process_index), int(acc.num_processes),
        bool(acc.project_configuration.save_on_each_node),
    )


def save_replicated(
    accelerator: Any, checkpointer: Callable[[str], Checkpointer], auto: AutoRoot | None,
    target: str, iteration: int, safe: bool,
) -> SaveHandle | None:
    """Every file comes from the writing process; the others contribute their RNG state.

    ``checkpointer(kind)`` gives the Checkpointer for ``"auto"`` or ``"plain"`` saves; ``auto``
    is the automatic-naming root (``None``: an explicit folder). Returns the save's handle,
    ``None`` on processes that write nothing.
    """
    acc = accelerator
    weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
    hook_files = run_save_hooks(acc, weights, urls.leaf(target))
    states = rng_states(acc)
    if not writes(acc):
        return None
    automatic = auto is not None
    ckpt = checkpointer("auto" if automatic else "plain")
    if auto is not None:
        refuse_existing(ckpt, auto, target, iteration)
    # (an explicit local target's parent is created by save_dir's check of the target)
    files = {**hook_files, **state_files(acc, weights, safe, states)}
    # assembled under a dot-name beside the target, renamed into place by the commit
    return ckpt.save_dir(files, target, metadata=metadata(acc, iteration, automatic, safe))
