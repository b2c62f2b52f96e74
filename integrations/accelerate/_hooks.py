"""Running ``register_save_state_pre_hook`` hooks without exposing an uncommitted folder.

Accelerate calls each hook as ``hook(models, weights, output_dir)`` with the checkpoint folder
already created, and hooks may remove entries from ``weights`` or write extra files into the
folder (``save_pretrained`` of a sub-model, a ``config.json``, tokenizer files). The checkpoint
folder must not exist before it is committed, so hooks get a private scratch folder with the
same leaf name instead; every file they write there is carried into the checkpoint verbatim
(:class:`stagesave.formats.Raw`, sub-folders included: the folder's proof lists each with its
size and chunk checksums), and the scratch folder is removed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stagesave.formats import Raw
from stagesave.stores import posix as fsops

__all__ = ["run_save_hooks"]


@contextmanager
def run_save_hooks(accelerator: Any, weights: list[Any], leaf: str) -> Iterator[dict[str, Raw]]:
    """Run the registered save pre-hooks; yield the files they wrote (name -> content).

    Names are relative to the folder, with ``/`` between sub-folders. Empty sub-folders are
    not carried (a checkpoint holds files).
    """
    hooks = list(accelerator._save_model_state_pre_hook.values())
    if not hooks:
        yield {}
        return
    scratch = tempfile.mkdtemp(prefix="stagesave-hooks-")
    try:
        output_dir = os.path.join(scratch, leaf)
        fsops.makedirs(output_dir)
        for hook in hooks:
            hook(accelerator._models, weights, output_dir)
        carried: dict[str, Raw] = {}
        for top, _, names in os.walk(output_dir):
            for name in sorted(names):
                path = os.path.join(top, name)
                rel = os.path.relpath(path, output_dir).replace(os.sep, "/")
                with open(path, "rb") as f:
                    carried[rel] = Raw(f.read())
        yield carried
    finally:
        fsops.rmtree(scratch)
