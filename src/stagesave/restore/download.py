"""Local copies of remote checkpoint folders, for readers that only read local files.

A framework's own loader (Accelerate's ``load_state``) reads a local folder. A checkpoint at an
fsspec URL is therefore copied into a private temporary folder first (one read of the remote
bytes), verified there against the proofs its files carry, and handed to the loader; the copy
is removed once the load is over.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from collections.abc import Mapping
from typing import Any

from ..stores import posix as fsops

__all__ = ["discard_download", "download_folder"]


def download_folder(url: str, storage_options: Mapping[str, Any]) -> str:
    """Copy the checkpoint folder at ``url`` into a new local temporary folder; return its path.

    Hidden entries (stagesave's temporaries) are skipped. The caller removes the copy with
    :func:`discard_download`.

    Raises:
        FileNotFoundError: nothing exists at ``url``.
    """
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **dict(storage_options))
    root = root.rstrip("/")
    names = [p for p in fs.find(root) if p.startswith(root + "/")]
    if not names:
        raise FileNotFoundError(f"no checkpoint folder at {url}")
    local = tempfile.mkdtemp(prefix="stagesave-restore-")
    try:
        target = os.path.join(local, posixpath.basename(root))
        fsops.makedirs(target)
        for name in names:
            rel = name[len(root) + 1 :]
            if any(part.startswith(".") for part in rel.split("/")):
                continue
            dest = os.path.join(target, *rel.split("/"))
            fsops.makedirs(os.path.dirname(dest), exist_ok=True)
            fs.get_file(name, dest)
    except BaseException:
        fsops.rmtree(local)
        raise
    return target


def discard_download(local: str) -> None:
    """Remove a temporary local copy made by :func:`download_folder`."""
    fsops.rmtree(os.path.dirname(local))
