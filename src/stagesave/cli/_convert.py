"""The old home of ``export`` and ``adopt``, kept for importers of this path until they move.

``export`` is now ``_export.py`` (with its two ends in ``_export_io.py`` and its layouts in
``_layouts.py``), ``adopt`` is ``_adopt.py``.
"""

from __future__ import annotations

from ._adopt import adopt_file
from ._export import export
from ._export_io import Output
from ._layouts import LAYOUTS

__all__ = ["LAYOUTS", "Output", "adopt_file", "export"]
