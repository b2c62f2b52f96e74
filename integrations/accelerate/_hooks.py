"""Running ``register_save_state_pre_hook`` hooks without exposing an uncommitted folder.

Accelerate calls each hook as ``hook(models, weights, output_dir)`` with the checkpoint folder
already created, and hooks may remove entries from ``weights`` or write extra files into the
folder (``save_pretrained`` of a sub-model, a ``config.json``, tokenizer files). The checkpoint
folder must not exist before it is committed, so hooks get a private scratch folder with the
same leaf name instead (:func:`stagesave.saving.scratch.files_written_by`); every file they
write there is carried into the checkpoint verbatim.
"""

from __future__ import annotations

from typing import Any

from stagesave.formats import Raw
from stagesave.saving.scratch import files_written_by

__all__ = ["run_save_hooks"]


def run_save_hooks(accelerator: Any, weights: list[Any], leaf: str) -> dict[str, Raw]:
    """Run the registered save pre-hooks; return the files they wrote (name -> content).

    Names are relative to the folder, with ``/`` between sub-folders. Empty sub-folders are
    not carried (a checkpoint holds files).
    """
    hooks = list(accelerator._save_model_state_pre_hook.values())
    if not hooks:
        return {}

    def write(output_dir: str) -> None:
        for hook in hooks:
            hook(accelerator._models, weights, output_dir)

    return files_written_by(write, leaf)
