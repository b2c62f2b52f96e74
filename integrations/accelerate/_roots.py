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
import warnings
from dataclasses import dataclass

from stagesave import Checkpointer, CheckpointInfo, TieredStore
from stagesave.stores import urls

from ._restore import parts_problems

__all__ = [
    "CHECKPOINTS_DIR",
    "FOLDER_PREFIX",
    "STAGING_DIR",
    "AutoRoot",
    "checkpoints_root",
    "refuse_existing",
    "tier_of",
]

#: Accelerate's automatic naming: ``<project_dir>/checkpoints/checkpoint_<iteration>``.
CHECKPOINTS_DIR = "checkpoints"
FOLDER_PREFIX = "checkpoint_"

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
        """The local folder checkpoints commit in (the local tier, a local root; ``None`` at a
        URL)."""
        if self.local_tier is not None:
            return self.local_tier
        return None if urls.is_url(self.root) else self.root

    @property
    def plain_root(self) -> str:
        """Where plain Accelerate folders (written without stagesave) would be."""
        return self.local_tier if self.local_tier is not None else self.root

    def name(self, leaf: str) -> str:
        """The checkpoint's name for the Checkpointer (relative to a tiered root)."""
        return leaf if self.tiered else urls.join(self.root, leaf)

    def local_folder(self, leaf: str) -> str | None:
        """The local folder a checkpoint of that name occupies (``None`` at a URL)."""
        if self.local_tier is not None:
            return os.path.join(self.local_tier, leaf)
        return None if urls.is_url(self.root) else os.path.join(self.root, leaf)

    def folder_of(self, info: CheckpointInfo, tier: str | None = None) -> str:
        """The folder (path or URL) of a checkpoint listed under this root, on ``tier``
        (``"local"`` or ``"remote"``; the tiered store's choice for that checkpoint)."""
        leaf = urls.leaf(info.name)
        if self.local_tier is not None and tier != "remote":
            return os.path.join(self.local_tier, leaf)
        return urls.join(self.root, leaf)


def checkpoints_root(destination: str | None, project_dir: str | os.PathLike[str] | None) -> str:
    """Where automatic naming puts ``checkpoint_<N>`` folders: ``destination``, else
    ``<project_dir>/checkpoints`` (a normalized path or URL).

    Raises:
        ValueError: neither ``destination`` nor ``project_dir`` is set.
    """
    if destination is not None:
        return urls.normalize(destination)
    if project_dir is None:
        raise ValueError(
            "automatic checkpoint naming needs ProjectConfiguration(project_dir=...) or the "
            "stagesave option destination="
        )
    return urls.normalize(os.path.join(project_dir, CHECKPOINTS_DIR))


def refuse_existing(ckpt: Checkpointer, auto: AutoRoot, target: str, iteration: int) -> bool:
    """Accelerate's rule for automatic names, with torn folders replaced instead of fatal.

    Returns whether an invalid checkpoint is there (to be replaced). A folder whose files
    carry no stagesave proof may be Accelerate's own (local); at a URL only a crashed
    stagesave save leaves one (its carrier, the object written last, never came).

    Raises:
        ValueError: a valid checkpoint, or a plain local folder stagesave cannot prove, is
            already at ``target``.
    """
    local = auto.local_folder(urls.leaf(target))
    if local is not None and not os.path.lexists(local):
        return False
    try:
        info = ckpt.verify(target)
    except FileNotFoundError:
        return False
    if info.valid and info.manifest is not None and local is not None:
        problems = parts_problems(ckpt, local, info, verify=True)  # an FSDP folder's DCP parts
        if problems:
            info.status, info.problems = "corrupt", problems
    refuse = (
        f"Checkpoint directory {local or target} ({iteration}) already exists. Please manually "
        "override `self.save_iteration` with what iteration to start with."
    )
    if info.valid and info.manifest is not None:
        raise ValueError(refuse)
    if info.status == "unverified" and local is not None:
        raise ValueError(f"{refuse} (It has no stagesave proof, so stagesave does not replace it.)")
    problem = "; ".join(info.problems) or "incomplete"
    warnings.warn(
        f"stagesave: replacing the invalid checkpoint {local or target} ({problem})", stacklevel=6
    )
    return True


def tier_of(tiered: TieredStore | None, info: CheckpointInfo) -> str | None:
    """The tier the tiered store reads a listed folder from (``None`` without a local tier).

    Asked with the name of the file that proves the folder (format 2: its carrier; format 1:
    its ``checkpoint.stagesave.json``): ``CheckpointInfo.tier`` reads ``"local"`` for every
    folder directly in a tiered root (the store routes folders by a file inside them).
    """
    if tiered is None:
        return None
    m = info.manifest
    name: str | None
    if m is not None and m.folder is not None:
        name = f"{info.name}/{m.folder.carrier}"
    else:
        name = info.manifest_name
    return str(tiered.tier_of(name or info.name))
