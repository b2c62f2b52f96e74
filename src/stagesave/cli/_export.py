"""``stagesave export``: a checkpoint of any layout it knows turned into ONE torch file.

The layouts are small classes in ``_layouts.py`` (``LAYOUTS``, tried in order). A single torch
file is copied byte for byte (checked against its proof on the way, never unpickled: a
format-2 file's copy proves itself); whatever is not a byte copy is written as a fresh format-2
file (through ``Checkpointer.save``), so every export carries its own proof unless its source
had none. Either way the output is written under a temporary name and published atomically by
the core's commit (``saving/commit.py``): nothing appears under the output name until it is
complete.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..restore.discovery import CheckpointInfo
from ..stores.targets import is_url
from ._common import CliError, Env
from ._export_io import Output, nothing_exported
from ._found import resolve_target
from ._layouts import LAYOUTS, DcpFolder
from ._units import fmt_bytes

__all__ = ["add_parser", "export", "run"]


def export(
    env: Env, source: str, out_path: str, *, force: bool = False, trusted: bool = False
) -> tuple[str, str]:
    """Export ``source`` into the torch file ``out_path``; ``(layout name, output path)``.

    Raises:
        CheckpointNotFoundError: ``source`` does not exist.
        IntegrityError: a file does not match its proof (nothing is written).
        CliError: an unknown layout, or the output exists without ``force``.
    """
    target = env.target(source)
    try:
        ci: CheckpointInfo | None = resolve_target(target.store, target.name, target.is_dir)
    except FileNotFoundError:
        ci = None
    if ci is not None and ci.status == "corrupt":
        raise nothing_exported(target.where, ci.problems or ["its proof does not check out"])
    for layout in LAYOUTS:
        if layout.matches(target, ci):
            if ci is None and not isinstance(layout, DcpFolder):
                break
            out = Output(env, out_path, force)
            layout.export(env, target, ci, out, trusted)
            return layout.name, out.path
    known = ", ".join(layout.name for layout in LAYOUTS)
    raise CliError(f"{target.where} is not a checkpoint layout export knows ({known})")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="turn a checkpoint (torch/safetensors file, Accelerate or DCP folder) into one plain "
             "torch.save file",
        description="Write one torch.save file from a checkpoint: a stagesave/torch file (copied "
        "byte for byte, checked against its proof: a format-2 copy proves itself), a safetensors "
        "file, an Accelerate save_state folder (one key per file: model, optimizer, scheduler, "
        "random_states_0, ...), a stagesave sharded folder or a local torch.distributed.checkpoint "
        "folder (--trusted); all but byte copies are written as fresh format-2 files. Files with a "
        "proof are checked before anything is written; the output appears only once complete.",
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument("out", metavar="OUT.ckpt")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument(
        "--trusted",
        action="store_true",
        help="unpickle with the full unpickler (files needing classes off the safe allow-list; DCP "
             "metadata)",
    )
    p.set_defaults(func=run)


def run(env: Env, args: argparse.Namespace) -> int:
    layout, out = export(env, args.path, args.out, force=args.force, trusted=args.trusted)
    size = os.path.getsize(os.path.abspath(out)) if not is_url(out) else None
    env.say(f"exported {args.path} ({layout}) to {out}" + (f" ({fmt_bytes(size)})" if size else ""))
    return 0
