"""Running ``register_save_state_pre_hook`` hooks without exposing an uncommitted folder.

Accelerate calls each hook as ``hook(models, weights, output_dir)`` with the checkpoint folder
already created, and hooks may remove entries from ``weights`` or write extra files into the
folder (``save_pretrained`` of a sub-model, typically). The checkpoint folder must not exist
before it is committed, so hooks get a private scratch folder with the same leaf name instead;
the safetensors files they write there are carried into the checkpoint (tensors and metadata
unchanged), and the scratch folder is removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stagesave.errors import UnsupportedObjectError
from stagesave.formats import Safetensors

__all__ = ["run_save_hooks"]


def _carry(path: str, rel: str) -> Safetensors:
    """The content of a safetensors file a hook wrote, to be saved again by stagesave.

    Raises:
        UnsupportedObjectError: the file is not safetensors (stagesave's directory checkpoints
            hold torch and safetensors files; arbitrary bytes are not supported yet).
    """
    if not rel.endswith(".safetensors"):
        raise UnsupportedObjectError(
            f"a save_state pre-hook wrote {rel!r} into the checkpoint folder; stagesave can carry "
            "safetensors files written by hooks, but not other files. Make the hook write "
            "safetensors only (or store that data with accelerator.register_for_checkpointing), "
            "or call stagesave.accelerate.disable(accelerator) to use Accelerate's synchronous save."
        )
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    return Safetensors(load_file(path), metadata)


@contextmanager
def run_save_hooks(accelerator: Any, weights: list[Any], leaf: str) -> Iterator[dict[str, Any]]:
    """Run the registered save pre-hooks; yield the files they wrote (name -> content).

    The scratch folder lives until the block ends, so the carried tensors (memory-mapped by
    safetensors) stay readable while the caller stages them.
    """
    hooks = list(accelerator._save_model_state_pre_hook.values())
    if not hooks:
        yield {}
        return
    scratch = tempfile.mkdtemp(prefix="stagesave-hooks-")
    try:
        output_dir = os.path.join(scratch, leaf)
        os.makedirs(output_dir)
        for hook in hooks:
            hook(accelerator._models, weights, output_dir)
        carried: dict[str, Any] = {}
        for top, _, names in os.walk(output_dir):
            for name in sorted(names):
                path = os.path.join(top, name)
                rel = os.path.relpath(path, output_dir).replace(os.sep, "/")
                carried[rel] = _carry(path, rel)
        yield carried
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
