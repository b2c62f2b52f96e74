"""Files a checkpoint folder holds that are not part of the checkpoint: they survive its commit.

Accelerate writes its files among whatever a folder holds, and users save beside them (a
tokenizer, a config, ``save_model``, logs), also while the save is still in flight. A folder
checkpoint is published by swapping a complete folder into place (:func:`.publish.
rename_into_place`); a swap would take such files away with the folder it replaces. So:

* Where the folder there holds files its checkpoint does not own (or no checkpoint at all), or
  is this process's working directory (a swap would leave the process in a removed folder), the
  new checkpoint is published *into* it (:func:`publish_into`): the old checkpoint's carrier
  goes first (from then on the old checkpoint is invalid), every new file is renamed over the
  one of its name, the old checkpoint's files the new one lacks are removed, and the new
  carrier comes last. Its proof pins every member's version, so the folder is valid only once
  all are in place; a crash in those few renames leaves no valid checkpoint there (the old one
  was being replaced) and the user's files where they were. The user's files never move.
* Otherwise the folder is swapped, and files that appeared in the old folder between the look
  and the swap are moved into the new one (:func:`keep_arrivals`).

A file of the user's that has the name of one the checkpoint writes is replaced by the
checkpoint's, with a warning naming it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

from .._crash import crash_point
from ..ondisk.names import DIR_MANIFEST
from ..restore.proof import read_proof
from ..restore.resolve_folder import resolve_dir
from ..stores import posix as fsops
from ..stores.base import Store
from ..stores.local import LocalStore

__all__ = ["Occupant", "holds_cwd", "keep_arrivals", "occupant", "publish_into", "remove_own"]


@dataclass(frozen=True)
class Occupant:
    """What a folder holds: a checkpoint's files and the rest (relative, ``/``-separated)."""

    #: The files of the checkpoint there (none without a readable proof).
    owned: frozenset[str] = frozenset()
    #: Its sub-folders that are folder checkpoints of their own (owned whole).
    nested: tuple[str, ...] = ()
    #: The file whose removal makes that checkpoint invalid (format 2: its carrier; format 1:
    #: its folder manifest).
    carrier: str | None = None
    #: Everything else: files, links, empty folders.
    foreign: tuple[str, ...] = ()

    def owns(self, rel: str) -> bool:
        return rel in self.owned or rel in self.nested or rel.startswith(
            tuple(n + "/" for n in self.nested)
        )


def entries(path: str) -> list[str]:
    """Every file, link and empty folder under ``path`` (links never followed), sorted."""
    out: list[str] = []
    for d, dirs, names in os.walk(path):
        rel = os.path.relpath(d, path).replace(os.sep, "/")
        at = "" if rel == "." else rel + "/"
        out += [at + n for n in names]
        out += [at + x for x in dirs if os.path.islink(os.path.join(d, x))]
        if not dirs and not names and at:
            out.append(at[:-1])
    return sorted(out)


def occupant(store: Store, directory: str, path: str) -> Occupant:
    """What the local folder ``path`` (``directory`` in ``store``) holds.

    A file counts as the checkpoint's only while it is the version its proof names (a member's
    own proof carries the folder's token and the CRC the carrier pins, a listed file has the
    listed size): a file of the user's written over one of them is the user's.
    """
    info = resolve_dir(store, directory)
    m = info.manifest
    owned: set[str] = set()
    nested: tuple[str, ...] = ()
    carrier = None
    if m is not None and m.folder is not None:
        f = m.folder
        nested, carrier = tuple(f.nested), f.carrier
        owned = {carrier} | {e.name for e in f.listed if _size(path, e.name) == e.size}
        owned |= {x.name for x in f.members
                  if _pinned(os.path.join(path, x.name), f.token, x.proof_crc)}
    elif m is not None and info.format == 1:
        owned = {e.name for e in m.files if _size(path, e.name) == e.size} | {DIR_MANIFEST}
        carrier = DIR_MANIFEST
    held = Occupant(frozenset(owned), nested, carrier)
    foreign = tuple(e for e in entries(path) if not held.owns(e))
    return Occupant(held.owned, nested, carrier, foreign)


def _size(folder: str, rel: str) -> int | None:
    p = os.path.join(folder, rel)
    return os.lstat(p).st_size if _inside(folder, rel) and os.path.isfile(p) else None


def _pinned(path: str, token: str, proof_crc: int) -> bool:
    """Whether ``path`` is the member of the folder save ``token`` its carrier pins."""
    got = _folder_proof(path)
    return got is not None and got[0] == token and got[1] == proof_crc


def _folder_proof(path: str) -> tuple[str, int | None] | None:
    """``(folder token, proof CRC)`` of a regular file of a stagesave folder save (its proof
    read without its tensor index), ``None`` for anything else."""
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        with LocalStore(os.path.dirname(path)).open(os.path.basename(path)) as reader:
            got = read_proof(reader, os.path.basename(path), index=False)
    except (OSError, ValueError):
        return None
    m = got.manifest
    if m is None or m.folder is None:
        return None
    return m.folder.token, got.proof_crc


def _inside(top: str, rel: str) -> bool:
    """Whether every folder on the way from ``top`` to ``rel`` is a real folder (a link to a
    folder elsewhere is never followed: what lies behind it is not in the checkpoint folder)."""
    d = top
    for part in rel.split("/")[:-1]:
        d = os.path.join(d, part)
        if os.path.islink(d) or not os.path.isdir(d):
            return False
    return True


def _make_way(top: str, rel: str, replaced: list[str]) -> str:
    """Real folders from ``top`` to ``rel``'s parent: an entry of the user's in the way (a link,
    a file) is removed itself, never what a link points to. Returns the parent."""
    d = top
    for i, part in enumerate(rel.split("/")[:-1]):
        d = os.path.join(d, part)
        if os.path.islink(d) or (os.path.lexists(d) and not os.path.isdir(d)):
            replaced.append("/".join(rel.split("/")[: i + 1]))
            fsops.unlink(d)
        if not os.path.lexists(d):
            fsops.mkdir(d)
    return os.path.dirname(os.path.join(top, rel))


def holds_cwd(path: str) -> bool:
    """Whether ``path`` is this process's working directory or one of its parents."""
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:
        return False
    real = os.path.realpath(path)
    return cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep)


def publish_into(src: str, dst: str, old: Occupant) -> None:
    """Publish the complete folder ``src`` into the existing folder ``dst`` (module docstring),
    then remove ``src``."""
    new = occupant(LocalStore(os.path.dirname(src)), os.path.basename(src), src)
    if new.carrier is None:
        raise ValueError(f"{src} holds no checkpoint to publish")
    touched = {dst}
    if old.carrier is not None and _inside(dst, old.carrier):
        with contextlib.suppress(FileNotFoundError):
            fsops.unlink(os.path.join(dst, old.carrier))
        fsops.fsync_dir(os.path.dirname(os.path.join(dst, old.carrier)))
    replaced: list[str] = []
    # nested checkpoints not in the staged folder are moved in by the caller after the commit:
    # the old ones of those names go, as with a swap
    later = {n for n in new.nested if not os.path.lexists(os.path.join(src, n))}
    for rel in _units(new):
        if rel not in later:
            touched.add(_move_in(src, dst, rel, old, replaced))
            crash_point("into_folder")
    gone = [n for n in old.nested if n not in new.nested or n in later]
    for rel in sorted(old.owned - new.owned) + gone:
        touched.add(_remove(dst, rel))
    _fsync_all(touched)  # every member durable in place before the carrier names them
    _fsync_all({_move_in(src, dst, new.carrier, old, replaced)})
    fsops.rmtree(src)
    _warn_replaced(dst, replaced)


def _move_in(src: str, dst: str, rel: str, old: Occupant, replaced: list[str]) -> str:
    """Rename ``src/rel`` over ``dst/rel``; the folder it landed in."""
    parent = _make_way(dst, rel, replaced)
    target = os.path.join(dst, rel)
    if os.path.lexists(target) and not old.owns(rel) and not _member_of_a_save(target):
        replaced.append(rel)
    if os.path.isdir(target) and not os.path.islink(target):
        fsops.rmtree(target)
    fsops.rename(os.path.join(src, rel), target)
    return parent


def _fsync_all(folders: set[str]) -> None:
    for d in sorted(folders, key=len, reverse=True):
        if os.path.isdir(d):
            fsops.fsync_dir(d)


def remove_own(path: str, held: Occupant) -> None:
    """Remove the checkpoint ``held`` describes from the local folder ``path``, its carrier
    first (from then on it is invalid), and keep everything else there."""
    rels = ([held.carrier] if held.carrier else []) + sorted(held.owned - {held.carrier})
    touched = {path}
    for i, rel in enumerate([*rels, *held.nested]):
        touched.add(_remove(path, rel))
        if i == 0:
            _fsync_all(touched)  # the carrier's removal is durable before the rest goes
            crash_point("during_retention")
    _fsync_all(touched)


def _remove(top: str, rel: str) -> str:
    """Remove ``top/rel`` (a file, link or folder; never through a link on the way) and the
    folders it leaves empty; the folder to fsync."""
    target = os.path.join(top, rel)
    if not _inside(top, rel):
        return top
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(target) and not os.path.islink(target):
            fsops.rmtree(target)
        else:
            fsops.unlink(target)
    return _prune_empty(os.path.dirname(target), top)


def _units(new: Occupant) -> list[str]:
    """What :func:`publish_into` renames before the carrier: nested folders whole, then files."""
    files = sorted(f for f in new.owned if f != new.carrier and f not in new.nested)
    return list(new.nested) + files


def keep_arrivals(old_path: str, dst: str, old: Occupant) -> None:
    """After a swap: move what appeared in the replaced folder (now at ``old_path``) since it
    was looked at, and is not its checkpoint's, into the new folder ``dst``."""
    replaced: list[str] = []
    for rel in entries(old_path):
        if old.owns(rel):
            continue
        target = os.path.join(dst, rel)
        if os.path.lexists(target):
            replaced.append(rel)  # the checkpoint's file of that name stays
            continue
        parent = os.path.dirname(target)
        if not os.path.isdir(parent):
            fsops.makedirs(parent, exist_ok=True)
        fsops.rename(os.path.join(old_path, rel), target)
        fsops.fsync_dir(parent)
    _warn_replaced(dst, replaced)


def _member_of_a_save(path: str) -> bool:
    """Whether ``path`` is a file of a stagesave folder save (one a crash left behind without
    its carrier, say): not the user's."""
    return _folder_proof(path) is not None


def _prune_empty(d: str, top: str) -> str:
    """Remove ``d`` and its parents up to ``top`` while they are empty; the first one kept."""
    while d != top and d.startswith(top + os.sep):
        try:
            fsops.rmdir(d)
        except OSError:
            return d
        d = os.path.dirname(d)
    return top


def _warn_replaced(dst: str, names: list[str]) -> None:
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        warnings.warn(
            f"stagesave: the checkpoint saved into {dst} replaced files of the same names that "
            f"were not part of a checkpoint (files of yours, or links): {shown}",
            stacklevel=2,
        )
