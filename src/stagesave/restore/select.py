"""Choosing what a resume loads: the newest checkpoint that is complete and intact.

Candidates come from the listing newest first; each is checked as the resume will load it (every
byte with ``verify``), and one that fails is skipped with a warning naming it and what is wrong.
A checkpoint replaced by another process while it is checked is checked again (the directory
listed again), never reported as damaged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

from ..errors import CheckpointError, StorageError, oserror_to_checkpoint_error
from ..ondisk.names import ASIDE_MARKER
from ..ondisk.signing import current as signing_keys
from ..saving import inflight
from ..stores.base import Store
from .discovery import scan
from .info import CheckpointInfo
from .plain import plain_problem
from .resolve_file import resolve
from .resolve_folder import resolve_dir
from .verify import IoThreads, is_folder, open_reader, replaced, verify_checkpoint

__all__ = ["Settle", "latest_in", "resume_choice"]

#: How many times :func:`latest_in` lists the directory again when a candidate is replaced
#: while it is being checked.
RELISTS = 3

#: Waits for this process's pending saves, removals and link updates under a directory.
Settle = Callable[[Store], None]


def latest_in(
    store: Store, verify: bool, io: IoThreads, settle: Settle, exclude: str = "",
) -> CheckpointInfo | None:
    """The newest checkpoint in ``store``'s directory that a resume can load.

    ``exclude``: a leaf name not to offer.

    Raises:
        CheckpointError: the directory cannot be listed.
    """
    settle(store)
    for attempt in range(RELISTS):
        try:
            found = [i for i in scan(store, warn=True, settle=True)
                     if not exclude or i.name != exclude]
        except CheckpointError:
            raise
        except OSError as exc:
            raise oserror_to_checkpoint_error(
                exc, f"cannot list checkpoints in {store.describe('')}") from exc
        try:
            return _first_usable(store, found, verify, io, skip_replaced=attempt == RELISTS - 1)
        except StorageError as exc:
            if not replaced(exc):
                raise
            # Replaced while it was checked: what is newest may have changed; list again.
    raise AssertionError("unreachable")


def resume_choice(
    store: Store, name: str, verify: bool, io: IoThreads, settle: Settle,
    dir_store: Callable[[str], Store],
) -> CheckpointInfo | bool | None:
    """What a resume pointed at ``name`` as *the newest checkpoint* should load.

    Returns ``True`` when ``name`` itself is usable, otherwise (after a warning) the newest
    usable checkpoint beside it, or ``None``. ``dir_store`` gives the store of a directory.
    """
    inflight.wait_path(store.describe(name))
    try:
        info = resolve_dir(store, name) if is_folder(store, name) else resolve(store, name)
    except FileNotFoundError:
        info = None
        warnings.warn(f"skipping checkpoint {store.describe(name)}: it does not exist",
                      stacklevel=3)
    if info is not None:
        if info.valid:
            if _first_usable(store, [info], verify, io, skip_replaced=True) is not None:
                return True
        else:
            problems = "; ".join(info.problems) or f"it is {info.status}"
            warnings.warn(f"skipping checkpoint {info.path}: {problems}", stacklevel=3)
    parent, _, leaf = name.rpartition("/")
    directory = store if not parent else dir_store(store.describe(parent))
    chosen = latest_in(directory, verify, io, settle, exclude=leaf)
    if chosen is not None:
        warnings.warn(f"resuming from {chosen.path} instead of {store.describe(name)}, which "
                      "cannot be loaded (see the warning above)", stacklevel=3)
    return chosen


def _first_usable(
    store: Store, found: Iterable[CheckpointInfo], verify: bool, io: IoThreads, *,
    skip_replaced: bool,
) -> CheckpointInfo | None:
    """The first of ``found`` (newest first) that :func:`_usable` accepts.

    Raises:
        StorageError: a candidate was replaced while it was being read (unless
            ``skip_replaced``: then it is skipped with a warning).
    """
    keys = signing_keys()
    for info in found:
        if not info.valid:
            continue
        if keys is not None and keys.require and info.format != 2:  # format 1 or no proof at all
            warnings.warn(f"skipping checkpoint {info.path}: not signed, and signatures are "
                          "required", stacklevel=3)
            continue
        try:
            chosen = _usable(store, info, verify, io)
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed since the listing
        except StorageError as exc:
            if not (skip_replaced and replaced(exc)):
                raise
            warnings.warn(f"skipping checkpoint {info.path}: another process kept replacing it "
                          "while it was being checked", stacklevel=3)
            continue
        if chosen is not None:
            if ASIDE_MARKER in chosen.name:
                warnings.warn(f"offering {chosen.path}: the only copy of a checkpoint, left aside "
                              "by a crash while it was being replaced; the next save into this "
                              "directory (or `stagesave gc`) moves it back", stacklevel=3)
            return chosen
    return None


def _usable(
    store: Store, info: CheckpointInfo, verify: bool, io: IoThreads,
) -> CheckpointInfo | None:
    """``info`` as checked for a resume (``verify``: every byte), or ``None`` after a warning."""
    problems: list[str] = []
    if info.format == 0 and not info.is_dir:  # no proof: at least it must load as what it is
        reader = open_reader(store, info.name, info.path)
        with reader:
            problem = plain_problem(reader, full=verify)
        problems = [problem] if problem else []
    elif verify:
        checked = verify_checkpoint(store, info.name, io, reuse=True)
        checked.tier = info.tier
        if checked.status == "verified":
            return checked
        problems = checked.problems or [f"{checked.path} is {checked.status}"]
    elif info.format == 2 and info.manifest is None and not info.is_dir:
        resolved = resolve(store, info.name)
        resolved.tier = info.tier
        if resolved.status != "corrupt":
            return resolved
        problems = resolved.problems
    if problems:
        warnings.warn(f"skipping checkpoint {info.path}: {'; '.join(problems)}", stacklevel=4)
        return None
    return info
