"""Finding checkpoints: list a directory, order it, tell each checkpoint's status.

A listing judges each file by its proof (:mod:`.resolve_file`) and each folder by its carrier's
(:mod:`.resolve_folder`); a plain file only by whether it would load (:mod:`.plain`). Newest
first, by the order of :meth:`CheckpointInfo.order` (:mod:`.info`).

A listing costs one directory read plus, for each file not seen before, one read of its last
few KiB (:func:`stagesave.restore.proof.peek`): what was learnt is cached per directory and reused
while a file's name, size and version stay the same, so ``latest()`` and the sequence number of
a new save stay linear in the number of checkpoints, and cheap when few changed.

Reading never writes. A folder left aside by a crash between the two renames of a replacement
(``.<name>.<pid>-<hex>.stagesave-aside``, its final name missing) is the only copy of that
checkpoint: a listing offers it where it lies, and the next write into the directory (or
``stagesave gc``) moves it back. A listing that meets the aside folder of a live mover waits for
the directory's commit lock (the mover holds it across both renames) and looks again.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

from ..ondisk.names import (
    ASIDE_MARKER,
    MANIFEST_SUFFIX,
    is_temporary,
    parse_aside_name,
    split_manifest_name,
)
from ..stores.base import ObjectInfo, Store
from . import resolve_folder
from .info import CHECKPOINT_SUFFIXES, CheckpointInfo, join, reread
from .liveness import pid_alive
from .plain import plain_problem
from .proof import peek, read_proof
from .resolve_file import from_proof, is_sidecar_of, resolve, resolve_reader
from .resolve_folder import MAX_FOLDER_DEPTH, folder_entries, list_tree, resolve_dir
from .verified_memo import VERIFIED_TTL_S, forget_verified, remember_verified, verified_before
from .verify import raise_if_corrupt, verify_entry

# Its own: forget, next_seq, scan. The rest is re-exported for callers that still import it
# from here; its home is the module it is imported from above.
__all__ = [
    "CHECKPOINT_SUFFIXES", "MAX_FOLDER_DEPTH", "VERIFIED_TTL_S", "CheckpointInfo", "folder_entries",
    "forget", "forget_verified", "is_sidecar_of", "list_tree", "next_seq", "plain_problem",
    "raise_if_corrupt", "remember_verified", "reread", "resolve", "resolve_dir", "resolve_reader",
    "scan", "verified_before", "verify_entry",
]


@dataclass
class _Seen:
    signature: Any
    info: CheckpointInfo


_cache_lock = threading.Lock()
_cache: dict[tuple[str, str], dict[str, _Seen]] = {}


def _cache_key(store: Store, directory: str) -> tuple[str, str]:
    return (f"{type(store).__name__}:{store.url}", directory)


def _peek_file(
    store: Store, name: str, f: ObjectInfo, sidecars: list[str],
) -> CheckpointInfo | None:
    """What a listing learns of one file: its summary, or the proof of a file without one."""
    try:
        return reread(lambda: _peek_file_once(store, name, f, sidecars))
    except OSError as exc:  # e.g. a symbolic link out of the root: listed, never followed
        path = store.describe(name)
        return CheckpointInfo(path, name, "corrupt", f.mtime, f.size,
                              problems=[f"{path}: {exc.strerror or exc}"])


def _peek_file_once(
    store: Store, name: str, f: ObjectInfo, sidecars: list[str],
) -> CheckpointInfo | None:
    path = store.describe(name)
    leaf = name.rpartition("/")[2]
    try:
        with store.open(name) as reader:
            p = peek(reader)
            if p.format == 2:
                s = p.summary
                if s is None:
                    return CheckpointInfo(path, name, "corrupt", reader.mtime, reader.size,
                                          problems=[p.problem or ""], problems_from_manifest=True,
                                          format=2)
                if s.folder is not None:
                    return None  # a loose file of a folder save: not a checkpoint by itself
                return CheckpointInfo(path, name, "committed", s.created_ns / 1e9, reader.size,
                                      seq=s.seq, format=2)
            if sidecars:
                return resolve_reader(store, name, reader, sidecars)
            if leaf.endswith(".safetensors"):
                got = read_proof(reader, leaf)
                if got.manifest is not None and got.manifest.folder is not None:
                    return None  # a loose file of a folder save: not a checkpoint by itself
                if got.format == 2:
                    return from_proof(store, name, path, reader, got)
            if p.problem:
                return CheckpointInfo(path, name, "corrupt", reader.mtime, reader.size,
                                      problems=[p.problem])
            return CheckpointInfo(path, name, "unverified", reader.mtime, reader.size)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None  # removed while we listed


def _folder_signature(store: Store, sub: str, listing: list[ObjectInfo]) -> Any:
    return tuple(sorted((f.name, f.size, f.version or f.mtime) for f in listing))


def scan(
    store: Store, directory: str = "", *, warn: bool = False, full: bool = False,
    settle: bool = False,
) -> list[CheckpointInfo]:
    """Every checkpoint in ``directory`` of ``store`` (files and folders), newest first.

    Format-2 files are judged by their summaries (``full``: by their whole proof, with the
    manifest filled in); folders by their carrier's proof. A folder left aside by a dead mover
    whose final name is missing is listed where it lies (its ``name`` is the aside name).
    ``settle`` (readers; never under the commit lock, which it may wait for): when a live
    process is between the two renames of a replacement, wait for its commit lock and look
    again.
    """
    found, live_mover = _scan(store, directory, warn=warn, full=full, movers_done=False)
    if live_mover is not None and settle:
        with store.commit_lock(join(directory, live_mover)):
            pass  # the mover held it across its two renames: they are done (or it died)
        found, _ = _scan(store, directory, warn=warn, full=full, movers_done=True)
    return found


def _scan(
    store: Store, directory: str, *, warn: bool, full: bool, movers_done: bool,
) -> tuple[list[CheckpointInfo], str | None]:
    """:func:`scan`, and the aside folder of a live mover whose final name is missing, if any
    (``movers_done``: the commit lock was free since, so such a folder is offered too)."""
    files = store.list(directory)
    key = _cache_key(store, directory)
    with _cache_lock:
        seen = dict(_cache.get(key, {}))
    fresh: dict[str, _Seen] = {}
    out: list[CheckpointInfo] = []
    sidecar_of: dict[str, list[str]] = {}
    for f in files:
        parsed = split_manifest_name(f.name.rpartition("/")[2])
        if parsed is not None:
            sidecar_of.setdefault(parsed[0], []).append(f.name)
    live_mover: str | None = None
    local = store.local_path(directory)
    for leaf in store.list_dirs(directory):
        if leaf.endswith(ASIDE_MARKER):
            aside = parse_aside_name(leaf)
            if aside is None or local is None or os.path.lexists(os.path.join(local, aside[0])):
                # not ours; or debris beside its checkpoint, back in place (gc removes it)
                continue
            if pid_alive(aside[1], ours_alive=False) and not movers_done:
                live_mover = leaf  # between its two renames: the caller may wait for it
                continue
        elif leaf.startswith(".") or is_temporary(leaf):
            continue
        sub = join(directory, leaf)
        listing = resolve_folder.list_tree(store, sub)
        sig = _folder_signature(store, sub, listing)
        old = seen.get(leaf + "/")
        if old is not None and old.signature == sig:
            ci = old.info
        else:
            ci = resolve_dir(store, sub, listing)
            if ci.status == "corrupt":
                # Listed just before another process replaced it and its proof read just after,
                # the folder's sizes disagree with a proof that is whole: list it again.
                listing = resolve_folder.list_tree(store, sub)
                sig = _folder_signature(store, sub, listing)
                ci = resolve_dir(store, sub, listing)
        fresh[leaf + "/"] = _Seen(sig, ci)
        if ci.status == "unverified":
            continue  # a plain folder: not listed as a checkpoint (it may be torn)
        out.append(ci)
    for f in files:
        leaf = f.name.rpartition("/")[2]
        if leaf.endswith(MANIFEST_SUFFIX) or is_temporary(leaf):
            continue
        sidecars = sidecar_of.get(leaf, [])
        sig = (f.size, f.version or f.mtime, tuple(sorted(sidecars)))
        old = seen.get(leaf)
        if old is not None and old.signature == sig and not full:
            ci = old.info
        else:
            got = _peek_file(store, f.name, f, sidecars)
            if got is None:
                continue
            ci = got
            if full and ci.format == 2 and ci.manifest is None and ci.status == "committed":
                ci = resolve(store, f.name)
        fresh[leaf] = _Seen(sig, ci)
        if (ci.manifest is None and not ci.problems_from_manifest and ci.format == 0
                and not leaf.endswith(CHECKPOINT_SUFFIXES)):
            continue  # a plain file that is not named like a checkpoint (notes, logs, configs)
        out.append(ci)
    with _cache_lock:
        _cache[key] = fresh
    if warn:
        for ci in out:
            if ci.status == "corrupt":
                warnings.warn(f"skipping checkpoint {ci.path}: {'; '.join(ci.problems)}",
                              stacklevel=3)
    tier_of = getattr(store, "tier_of", None)
    if tier_of is not None:  # a tiered root: say where each checkpoint is read from
        for ci in out:
            ci.tier = tier_of(ci.name)
    out.sort(key=CheckpointInfo.order, reverse=True)
    return out, live_mover


def next_seq(store: Store, directory: str) -> int:
    """The sequence number of the next save in ``directory``: one more than any committed there.

    Call it under the directory's commit lock so that two processes saving into one directory
    number their saves in the order they commit.
    """
    found = scan(store, directory)
    return 1 + max((c.seq for c in found if c.seq is not None), default=0)


def forget(store: Store, directory: str) -> None:
    """Drop what the listing cache knows of ``directory`` (tests; a store that changed under us)."""
    with _cache_lock:
        _cache.pop(_cache_key(store, directory), None)

