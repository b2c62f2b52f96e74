"""Where automatic naming puts checkpoints.

The root is a local folder (``<project_dir>/checkpoints`` by default), an fsspec URL, or a URL
with a local directory as a fast tier in front of it (``stagesave.TieredStore``: the commit is
local, the upload to the URL is background, restore prefers a valid local copy).

A folder is assembled under the core's temporary name, a dot-name beside its target
(``.checkpoint_<N>.<pid>-<token>.stagesave-tmp``), and renamed into place by its commit: stagesave
creates nothing in ``project_dir`` or above the folder the checkpoints go to. Accelerate's own
``load_state()`` and ``total_limit`` (which list every entry of ``checkpoints/``, hidden ones
included) are replaced by stagesave's while it is enabled, and those never take a temporary for a
checkpoint. Earlier versions assembled folders in ``<parent>/.stagesave-staging``;
:data:`STAGING_DIR` names that folder so that old debris can be found (``stagesave gc`` cleans it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from stagesave import CheckpointInfo

from . import _remote

__all__ = ["STAGING_DIR", "AutoRoot"]

#: Legacy: the folder beside the checkpoints root where stagesave up to issue 17 assembled
#: folders. Nothing creates it any more; a run killed mid-save by such a version may have left
#: debris there, which ``stagesave gc <project_dir>/.stagesave-staging`` removes.
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
