"""What Lightning hands the plugin, in the core's terms: the classes a load may allow, and the
metadata every Lightning checkpoint's proof records."""

from __future__ import annotations

import argparse
import importlib
import pathlib
from typing import Any

__all__ = ["LIGHTNING_SAFE_GLOBALS", "import_global", "lightning_metadata", "save_metadata"]

#: Plain-data classes that Lightning checkpoints commonly hold besides tensors and numpy arrays
#: (``save_hyperparameters()`` of a ``Path`` or a ``Namespace``), allowed on top of the core's
#: allow-list. Lightning's ``AttributeDict`` cannot be: torch's safe unpickler refuses item
#: assignment on dict subclasses, and Lightning stores hyper-parameters as a plain ``dict``.
LIGHTNING_SAFE_GLOBALS: tuple[Any, ...] = (
    pathlib.PosixPath,
    pathlib.WindowsPath,
    pathlib.PurePosixPath,
    pathlib.PureWindowsPath,
    argparse.Namespace,
)

_STORAGE_OPTION_KEYS = ("metadata",)


def import_global(name: str) -> Any:
    """The class or function a ``safe_globals`` entry names (``"my_pkg.config.TrainConfig"``).

    Raises:
        ValueError: ``name`` does not name an importable attribute.
    """
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(
            f"safe_globals entry {name!r} does not name an importable class or function; "
            "give a dotted path such as 'my_pkg.config.TrainConfig'"
        ) from exc


def lightning_metadata(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What every Lightning checkpoint's proof records: the framework, the epoch and the step."""
    metadata: dict[str, Any] = {"framework": "lightning"}
    for field in ("epoch", "global_step"):
        value = checkpoint.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            metadata[field] = value
    return metadata


def save_metadata(checkpoint: dict[str, Any], storage_options: Any, owner: str) -> dict[str, Any]:
    """The metadata of one save: :func:`lightning_metadata` plus ``storage_options["metadata"]``.

    Raises:
        TypeError: ``storage_options`` has keys other than ``"metadata"`` (``owner`` names the
            class in the message).
    """
    metadata = lightning_metadata(checkpoint)
    if storage_options is None:
        return metadata
    if isinstance(storage_options, dict):
        unknown = set(storage_options) - set(_STORAGE_OPTION_KEYS)
    else:
        unknown = {0}
    if unknown:
        raise TypeError(
            f"{owner} accepts storage_options={{'metadata': {{...}}}} only, got "
            f"{storage_options!r}; set fsspec options with StagedCheckpointIO(storage_options=...)"
        )
    metadata.update(storage_options.get("metadata") or {})
    return metadata
