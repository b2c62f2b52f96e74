"""Paths and URLs of checkpoint folders, and local copies of remote ones for loading.

Accelerate's ``load_state`` reads a local folder. A checkpoint at an fsspec URL is therefore
copied into a private temporary folder first (one read of the remote bytes), verified there
against the proofs its files carry, and handed to Accelerate.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from collections.abc import Mapping
from typing import Any

from stagesave.stores import posix as fsops

__all__ = ["download_folder", "is_url", "join", "leaf", "normalize", "parent"]


def is_url(path: str) -> bool:
    """Whether ``path`` is an fsspec URL (``file://`` counts as a local path)."""
    return "://" in path and not path.startswith("file://")


def normalize(path: str | os.PathLike[str]) -> str:
    """An absolute local path, or the URL without a trailing slash."""
    p = os.fspath(path)
    p = p.removeprefix("file://")
    if is_url(p):
        return p.rstrip("/")
    return os.path.abspath(os.path.expanduser(p))


def join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}" if is_url(root) else os.path.join(root, name)


def leaf(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2] if is_url(path) else os.path.basename(path)


def parent(path: str) -> str:
    return path.rstrip("/").rpartition("/")[0] if is_url(path) else os.path.dirname(path)


def download_folder(url: str, storage_options: Mapping[str, Any]) -> str:
    """Copy the checkpoint folder at ``url`` into a new local temporary folder; return its path.

    Hidden entries (stagesave's temporaries) are skipped. The caller removes the folder.

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
