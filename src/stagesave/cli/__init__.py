"""The ``stagesave`` command line: plan, ls, inspect, verify, export, adopt, migrate, gc, bench,
report.

Each command lives in its own module with an ``add_parser`` and a ``run``; ``_app.py`` wires them
together and turns every failure into one line on stderr and a non-zero exit (``--debug`` shows
the traceback instead).
"""

from __future__ import annotations

from ._app import main

__all__ = ["main"]
