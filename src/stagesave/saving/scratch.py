"""Files a callback writes into a folder, carried into a checkpoint verbatim.

Frameworks let user code write extra files into a checkpoint folder while it is saved (Accelerate's
``register_save_state_pre_hook`` hooks: ``save_pretrained`` of a sub-model, a ``config.json``,
tokenizer files). A stagesave folder must not exist before it is committed, so such code writes
into a private scratch folder with the checkpoint's leaf name instead; every file it leaves there
becomes a :class:`stagesave.formats.Raw` entry of the folder (sub-folders included: the folder's
proof lists each with its size and chunk checksums), and the scratch folder is removed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

from ..formats import Raw
from ..stores import posix as fsops

__all__ = ["files_written_by"]


def files_written_by(write: Callable[[str], None], leaf: str) -> dict[str, Raw]:
    """Call ``write(folder)`` on an empty scratch folder named ``leaf``; return what it wrote.

    Names are relative to the folder, with ``/`` between sub-folders. Empty sub-folders are not
    carried (a checkpoint holds files). The scratch folder is removed, whatever happens.
    """
    scratch = tempfile.mkdtemp(prefix="stagesave-hooks-")
    try:
        output_dir = os.path.join(scratch, leaf)
        fsops.makedirs(output_dir)
        write(output_dir)
        carried: dict[str, Raw] = {}
        for top, _, names in os.walk(output_dir):
            for name in sorted(names):
                path = os.path.join(top, name)
                rel = os.path.relpath(path, output_dir).replace(os.sep, "/")
                with open(path, "rb") as f:
                    carried[rel] = Raw(f.read())
        return carried
    finally:
        fsops.rmtree(scratch)
