"""Where automatic naming puts checkpoints, and where folders are assembled before they appear.

The root is a local folder (``<project_dir>/checkpoints`` by default), an fsspec URL, or a URL
with a local directory as a fast tier in front of it (``stagesave.TieredStore``: the commit is
local, the upload to the URL is background, restore prefers a valid local copy).

Accelerate's own ``load_state()`` and ``total_limit`` list *every* entry of ``checkpoints/``,
hidden ones included, and sort them by the first number in the name, so a temporary of an
unfinished save must never sit there. Folders for a local root, or for the local tier of a
tiered one, are therefore assembled in ``<parent of that folder>/.stagesave-staging`` (checked to
be on the same filesystem, so the commit stays one rename) and renamed into place; a tiered root
uploads each folder once it is in place.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from stagesave import CheckpointInfo
from stagesave import _fsops as fsops

from . import _remote

__all__ = ["STAGING_DIR", "AutoRoot", "staging_dir_for"]

#: Folder beside the checkpoints root where local folders are assembled.
STAGING_DIR = ".stagesave-staging"


@dataclass(frozen=True)
class AutoRoot:
    """The automatic-naming root: ``root`` (path or URL), fronted by ``local_tier`` when set."""

    root: str
    local_tier: str | None = None

    @property
    def tiered(self) -> bool:
        return self.local_tier is not None

    @property
    def list_arg(self) -> str | None:
        """What to pass to ``Checkpointer.list``/``latest`` (``None``: the tiered root itself)."""
        return None if self.tiered else self.root

    @property
    def local_root(self) -> str | None:
        """The local folder checkpoints commit in (the local tier, a local root; ``None`` at a URL)."""
        if self.local_tier is not None:
            return self.local_tier
        return None if _remote.is_url(self.root) else self.root

    @property
    def plain_root(self) -> str:
        """Where plain Accelerate folders (written without stagesave) would be."""
        return self.local_tier if self.local_tier is not None else self.root

    def name(self, leaf: str) -> str:
        """The checkpoint's name for the Checkpointer (relative to a tiered root)."""
        return leaf if self.tiered else _remote.join(self.root, leaf)

    def local_folder(self, leaf: str) -> str | None:
        """The local folder a checkpoint of that name occupies (``None`` at a URL)."""
        if self.local_tier is not None:
            return os.path.join(self.local_tier, leaf)
        return None if _remote.is_url(self.root) else os.path.join(self.root, leaf)

    def folder_of(self, info: CheckpointInfo, tier: str | None = None) -> str:
        """The folder (path or URL) of a checkpoint listed under this root, on ``tier``
        (``"local"`` or ``"remote"``; the tiered store's choice for that checkpoint)."""
        leaf = _remote.leaf(info.name)
        if self.local_tier is not None and tier != "remote":
            return os.path.join(self.local_tier, leaf)
        return _remote.join(self.root, leaf)


def staging_dir_for(root: str) -> str | None:
    """``<parent of root>/.stagesave-staging`` (created), or ``None`` if it cannot serve.

    ``None`` (with a warning) when the folder cannot be created or lies on another filesystem
    than ``root``: the core then assembles folders in hidden siblings inside ``root``.
    """
    staging = os.path.join(os.path.dirname(root), STAGING_DIR)
    try:
        fsops.makedirs(root, exist_ok=True)
        fsops.makedirs(staging, exist_ok=True)
        same = os.stat(staging).st_dev == os.stat(root).st_dev
    except OSError as exc:
        warnings.warn(f"stagesave: cannot use {staging} to assemble checkpoints ({exc}); unfinished "
                      f"saves leave hidden temporaries in {root} instead", stacklevel=4)
        return None
    if not same:
        warnings.warn(f"stagesave: {staging} is on another filesystem than {root}; unfinished saves "
                      f"leave hidden temporaries in {root} instead", stacklevel=4)
        return None
    return staging
