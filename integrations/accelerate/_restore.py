"""Choosing and proving the checkpoint ``load_state`` hands to Accelerate.

Accelerate's own ``load_state()`` takes the highest-numbered entry of ``checkpoints/``, complete
or not. Here a candidate must carry a stagesave proof that matches its files (each torch and
safetensors file carries its own; one of them, the carrier, also names every file of the folder
and records the save's metadata) and, with ``verify_on_load``, every checksum; corrupt ones are
skipped with a warning naming the damage.
Only when no stagesave checkpoint exists at all does Accelerate's choice among plain folders
apply (a run that started without stagesave keeps resuming). This runs on rank 0 only; the
result travels to the other processes as a :class:`LoadPlan`.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stagesave import Checkpointer, CheckpointInfo
from stagesave.errors import CheckpointNotFoundError, IntegrityError
from stagesave.restore.download import discard_download, download_folder
from stagesave.stores import urls

from ._layout import METADATA_KEY
from ._trust import unlisted_problem

__all__ = ["FOLDER_RE", "LoadPlan", "fsdp_parts", "parts_problems", "plan_explicit", "plan_newest"]

#: Accelerate's automatic folder names.
FOLDER_RE = re.compile(r"^checkpoint_(\d+)$")


@dataclass(frozen=True)
class LoadPlan:
    """What to load: ``folder`` as named (path or URL), ``local`` the folder Accelerate reads.

    ``iteration`` is the ``ProjectConfiguration.iteration`` that saved it (``None`` when unknown);
    ``from_proof`` says whether it came from the metadata of the checkpoint's stagesave proof
    (else from the folder's name). ``names`` are the files its proof lists, the only ones
    Accelerate may read (``None``: a plain Accelerate folder, which has no proof).
    """

    folder: str
    local: str
    remote: bool
    iteration: int | None
    from_proof: bool
    names: frozenset[str] | None = None


def _metadata(info: CheckpointInfo | None) -> dict[str, Any]:
    """The adapter's entry in the metadata of a checkpoint's proof (format 2: recorded by the
    folder's carrier; format 1: by its ``checkpoint.stagesave.json``); empty when there is none."""
    if info is None or info.manifest is None:
        return {}
    meta = info.manifest.metadata.get(METADATA_KEY, {})
    return meta if isinstance(meta, dict) else {}


def fsdp_parts(info: CheckpointInfo | None) -> list[str]:
    """The DCP folders an FSDP checkpoint's proof names (empty for other checkpoints)."""
    fsdp = _metadata(info).get("fsdp")
    parts = fsdp.get("parts") if isinstance(fsdp, dict) else None
    return [p for p in parts if isinstance(p, str)] if isinstance(parts, list) else []


def parts_problems(
    ckpt: Checkpointer, folder: str, info: CheckpointInfo, verify: bool
) -> list[str]:
    """What is wrong with the DCP folders of an FSDP checkpoint (each proves itself)."""
    parts = fsdp_parts(info)
    if not parts:
        return []
    problems = []
    listed = {} if verify else {urls.leaf(c.name): c for c in ckpt.list(folder)}
    for part in parts:
        path = os.path.join(folder, part)
        if verify:
            try:
                found: CheckpointInfo | None = ckpt.verify(path)
            except FileNotFoundError:
                found = None
        else:
            found = listed.get(part)
        if found is None or found.manifest is None:
            problems.append(f"{path} is missing or carries no stagesave proof")
        elif found.status == "corrupt":
            problems.extend(found.problems)
    return problems


def _proven_names(info: CheckpointInfo | None) -> frozenset[str] | None:
    """The files a checkpoint's proof lists (relative to its folder), ``None`` without a proof."""
    m = info.manifest if info is not None else None
    if m is None:
        return None
    if m.folder is None:  # format 1: the folder's manifest names every file
        return frozenset(f.name for f in m.files)
    return frozenset(m.folder.names()) | frozenset(m.folder.nested)


def _listed(ckpt: Checkpointer, local: str) -> CheckpointInfo | None:
    """What listing (proofs only, no checksums) says about the folder ``local``."""
    parent, leaf = os.path.split(os.path.abspath(local))
    return next((c for c in ckpt.list(parent) if c.is_dir and urls.leaf(c.name) == leaf), None)


def _iteration_of(info: CheckpointInfo | None, folder: str) -> int | None:
    meta = _metadata(info)
    if isinstance(meta.get("iteration"), int):
        return int(meta["iteration"])
    m = FOLDER_RE.match(urls.leaf(folder))
    return int(m.group(1)) if m else None


#: ``(local folder, the files its proof lists)`` -> files Accelerate would read that it does
#: not list (:func:`._trust.unlisted_reads` for the Accelerator loading).
Unlisted = Callable[[str, frozenset[str]], list[str]]


def _prove(
    ckpt: Checkpointer, folder: str, verify: bool, storage_options: dict[str, object], *,
    skip_corrupt: bool, info: CheckpointInfo | None = None, unlisted: Unlisted | None = None,
) -> LoadPlan | None:
    """Verify ``folder`` (a local copy of it when remote); ``None`` if corrupt and skipped.
    A folder holding a file Accelerate would read that its proof does not list (``unlisted``)
    cannot be loaded: skipped or refused the same way (with its own message).

    Raises:
        IntegrityError: corrupt (or not loadable) and not ``skip_corrupt``.
        ValueError: a remote folder does not exist.
    """
    remote = urls.is_url(folder)
    local = folder
    if remote:
        try:
            local = download_folder(folder, storage_options)
        except FileNotFoundError as exc:
            raise ValueError(f"Tried to find {folder} but folder does not exist") from exc
    try:
        # without verify_on_load, still the proof's list of files: a folder missing a file it
        # names is refused (what listing checks, reading proofs only)
        checked: CheckpointInfo | None
        if verify:
            checked = ckpt.verify(local)
        else:
            checked = info if info is not None else _listed(ckpt, local)
        problem = ""
        if checked is not None and checked.status != "corrupt" and checked.manifest is not None:
            parts = parts_problems(ckpt, local, checked, verify)
            if parts:
                checked.status, checked.problems = "corrupt", parts
            elif unlisted is not None:  # intact, but a file of the user's is in the way
                shadows = unlisted(local, _proven_names(checked) or frozenset())
                problem = unlisted_problem(shadows[0]) if shadows else ""
        if checked is not None and checked.status == "corrupt":
            problem = "is corrupt: " + "; ".join(checked.problems)
        if problem:
            if not skip_corrupt:
                raise IntegrityError(f"checkpoint {folder} {problem}. It was not loaded.")
            why = problem.removeprefix("is corrupt: ")
            warnings.warn(f"stagesave: skipping checkpoint {folder}: {why}", stacklevel=7)
            if remote:
                discard_download(local)
            return None
    except BaseException:
        if remote:
            discard_download(local)
        raise
    source = checked if checked is not None and checked.manifest is not None else info
    return LoadPlan(folder, local, remote, _iteration_of(source, folder),
                    source is not None and source.manifest is not None, _proven_names(source))


def plan_explicit(
    ckpt: Checkpointer, input_dir: str | os.PathLike[str], verify: bool,
    storage_options: dict[str, object], unlisted: Unlisted | None = None,
) -> LoadPlan:
    """The folder the user named, proven (a plain Accelerate folder is loaded as it is).

    Raises:
        ValueError: it does not exist (Accelerate's message).
        IntegrityError: its files do not match their proof.
    """
    folder = urls.normalize(input_dir)
    if not urls.is_url(folder) and not os.path.isdir(folder):
        raise ValueError(f"Tried to find {os.fspath(input_dir)} but folder does not exist")
    plan = _prove(ckpt, folder, verify, storage_options, skip_corrupt=False, unlisted=unlisted)
    assert plan is not None
    return plan


def plan_newest(
    ckpt: Checkpointer, root: str | None, verify: bool, storage_options: dict[str, object],
    folder_of: Callable[[CheckpointInfo], str], plain_root: str,
    unlisted: Unlisted | None = None,
) -> LoadPlan:
    """The newest valid checkpoint folder under ``root`` (``None``: the checkpointer's root).

    ``folder_of`` names the folder of a listed checkpoint (path or URL); ``plain_root`` is
    where plain Accelerate folders are looked for when there is no stagesave checkpoint.

    Raises:
        CheckpointNotFoundError: no checkpoint at all under ``root``.
    """
    # Warns about each torn or invalid folder it passes over (proofs only: ``_prove`` below reads
    # the bytes of the one chosen, once). It repairs nothing: a folder left aside by a crash
    # mid-replacement is listed where it lies, until the next save or `stagesave gc`.
    ckpt.latest(root, verify=False)
    for info in ckpt.list(root):
        if info.is_dir and info.valid:
            plan = _prove(ckpt, folder_of(info), verify, storage_options, skip_corrupt=True,
                          info=info, unlisted=unlisted)
            if plan is not None:
                return plan
    return _plain_accelerate_folder(plain_root)


def _plain_accelerate_folder(root: str) -> LoadPlan:
    numbered = []
    if not urls.is_url(root) and os.path.isdir(root):
        for name in os.listdir(root):
            m = FOLDER_RE.match(name)
            if m and os.path.isdir(os.path.join(root, name)):
                numbered.append((int(m.group(1)), name))
    if not numbered:
        raise CheckpointNotFoundError(f"no valid checkpoint under {root} to resume from")
    number, name = max(numbered)
    folder = os.path.join(root, name)
    warnings.warn(
        f"stagesave: no stagesave checkpoint under {root}; resuming from {folder}, a plain "
        "Accelerate folder that cannot be verified",
        stacklevel=6,
    )
    return LoadPlan(folder, folder, False, number, False)
