"""Reading DCP's ``.metadata`` without running code from it.

DCP stores its metadata as a plain pickle (``FileSystemReader`` loads it with ``pickle.load``),
and unpickling can run arbitrary code. What a genuine ``.metadata`` needs is small and fixed: the
metadata dataclasses, ``torch.Size``, dtypes, the layout helper and a path class. This unpickler
resolves exactly those and refuses anything else, naming it; ``trusted=True`` is the opt-out for
checkpoints from planners that store their own classes in the metadata.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as _fs
import torch.distributed.checkpoint.metadata as _md
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import ManifestError, UnsafeCheckpointError

__all__ = ["StorageInfo", "load_metadata"]

#: Where DCP's metadata places an item: ``(relative_path, offset, length)``. torch keeps the class
#: private; this is the one place stagesave names it.
StorageInfo = _fs._StorageInfo

_ALLOWED: dict[tuple[str, str], Any] = {
    **{(_md.__name__, n): getattr(_md, n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )},
    (_fs.__name__, "_StorageInfo"): StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    # never instantiate a concrete foreign path
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"refusing to read {self.where}: the DCP metadata needs {module}.{name}, which is not "
            "one of the classes DCP metadata is made of, and unpickling it could run code. If you "
            "trust the checkpoint's source completely, pass trusted=True."
        )


def load_metadata(data: bytes, where: str, *, trusted: bool = False) -> Metadata:
    """Unpickle DCP metadata bytes read from ``where``.

    Raises:
        UnsafeCheckpointError: the pickle needs a class off the allow-list (and not ``trusted``).
        ManifestError: the bytes are not a DCP ``Metadata`` pickle.
    """
    try:
        obj = pickle.loads(data) if trusted else _MetadataUnpickler(data, where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # any parse failure means the same thing
        raise ManifestError(
            f"cannot read {where}: not a readable DCP metadata pickle ({exc})"
        ) from exc
    if not isinstance(obj, Metadata) or not isinstance(getattr(obj, "storage_data", None), dict):
        raise ManifestError(f"cannot read {where}: it holds a {type(obj).__name__}, not DCP "
                            "metadata with storage data")
    return obj
