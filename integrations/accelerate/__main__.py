"""``python -m stagesave.accelerate SCRIPT [ARGS...]``: run a training script with stagesave on.

Every ``Accelerator`` the script constructs is passed to :func:`stagesave.accelerate.enable`
right after its ``__init__``, so a script that calls ``accelerator.save_state()`` gets
asynchronous checkpoints without a code change. With ``accelerate launch`` this is one setting
on the command line::

    accelerate launch --num_processes 2 -m stagesave.accelerate train.py --lr 3e-4

``-m MODULE`` instead of ``SCRIPT`` runs a module, as ``python -m`` would.
"""

from __future__ import annotations

import os
import runpy
import sys

from ._patch import enable_globally

_USAGE = "usage: python -m stagesave.accelerate SCRIPT [ARGS...]  |  -m MODULE [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    """Enable stagesave for every Accelerator, then run the script as ``__main__``.

    Raises:
        SystemExit: no script was given (exit status 2, with the usage line).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr)
        raise SystemExit(0 if args else 2)
    enable_globally()
    if args[0] == "-m":
        if len(args) < 2:
            print(_USAGE, file=sys.stderr)
            raise SystemExit(2)
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    script = args[0]
    sys.argv = [script, *args[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
