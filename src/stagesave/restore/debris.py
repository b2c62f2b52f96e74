"""Finding the debris of crashed saves, by name, by content and by proof that its owner is gone.

What counts as debris, and why nothing else is ever touched, is told in :mod:`.gc`, which
removes what :func:`find_debris` finds.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from ..ondisk.names import ASIDE_MARKER, TMP_MARKER, parse_aside_name, split_manifest_name
from ..stores.base import Store
from .info import join
from .liveness import pid_alive
from .resolve_file import is_sidecar_of, resolve

__all__ = ["MAX_DEPTH", "Debris", "find_all", "find_debris", "match_temporary", "orphan_reason"]

#: The exact names stagesave gives its temporaries. Files:
#: ``.<name>.<pid>-<8 hex>.stagesave-tmp`` (a local write, the backup link of a publish, a removal
#: in progress), ``.<name>.<8 hex>.stagesave-tmp`` (fsspec stores: no pid) and the markers of
#: sharded saves ``.dcp-rank-<r>.<pid>-<32 hex>.stagesave-tmp``. Folders: the same names beside
#: their target, or ``<name>.<pid>-<8 hex>.stagesave-tmp`` (no dot) inside a ``staging_dir``.
#: Anything else that merely contains the marker is a user's file.
_TMP_RE = re.compile(
    r"^\.(?P<data>.+)\.(?:(?P<pid>\d+)-)?(?P<token>[0-9a-f]{8}|[0-9a-f]{32})"
    + re.escape(TMP_MARKER) + r"$"
)
_STAGING_RE = re.compile(
    r"^(?P<data>[^.].*)\.(?P<pid>\d+)-(?P<token>[0-9a-f]{8})" + re.escape(TMP_MARKER) + r"$"
)
#: How deep gc descends into sub-folders of the root (checkpoint folders nest one or two levels).
MAX_DEPTH = 8


@dataclass(frozen=True)
class Debris:
    """One leftover of a crashed save.

    ``kind`` is ``"temporary"``, ``"temporary-dir"``, ``"orphan-manifest"``, ``"aside-dir"`` or
    ``"multipart-upload"``; ``action`` what gc does with it (``"remove"``, ``"restore"``,
    ``"abort"``); ``reason`` why it is debris.
    """

    name: str
    kind: str
    action: str
    reason: str
    size: int = 0
    age_s: float = 0.0


def match_temporary(leaf: str, *, is_dir: bool) -> re.Match[str] | None:
    """The parts (``data``, ``pid``, ``token``) of a name stagesave gives its temporaries, or
    ``None`` for any other name (however similar)."""
    m = _TMP_RE.match(leaf)
    if m is None and is_dir:
        m = _STAGING_RE.match(leaf)
    return m


def _tree_newest_mtime(store: Store, name: str, depth: int = 0) -> tuple[float, int]:
    """Newest modification time and total size of the files in folder ``name``."""
    local = store.local_path(name)
    newest, total = 0.0, 0
    if local is not None:
        with contextlib.suppress(OSError):
            newest = os.lstat(local).st_mtime
    for info in store.list(name):
        newest = max(newest, info.mtime)
        total += info.size
    if depth < MAX_DEPTH:
        for leaf in store.list_dirs(name):
            m, s = _tree_newest_mtime(store, join(name, leaf), depth + 1)
            newest, total = max(newest, m), total + s
    return newest, total


class _Finder:
    """One walk of a store's tree: what is debris, what is kept (and why), what is a user's."""

    def __init__(
        self, store: Store, older_than_s: float, check_pids: bool, now: float, max_depth: int,
    ) -> None:
        self.store = store
        self.max_depth = max_depth
        self.older_than_s = older_than_s
        self.check_pids = check_pids
        self.now = now
        self.local = store.local_path("") is not None
        self.found: list[Debris] = []
        self.kept: list[tuple[str, str]] = []
        #: Names that contain a stagesave marker but are not stagesave's (users' files): never
        #: touched.
        self.ignored: list[tuple[str, str]] = []

    def _owner_state(self, pid: str | None, age: float) -> tuple[bool, str]:
        """``(is_debris, reason)`` for something written by ``pid`` last modified ``age`` s
        ago."""
        if pid is not None and self.check_pids and self.local and not pid_alive(int(pid)):
            return True, f"its writer (pid {pid}) is not running on this host"
        if age >= self.older_than_s:
            return True, f"untouched for {age:.0f} s (threshold {self.older_than_s:.0f} s)"
        if pid is not None and self.check_pids and self.local:
            return False, f"its writer (pid {pid}) is running"
        return False, f"modified {age:.0f} s ago, under the {self.older_than_s:.0f} s threshold"

    def walk(self, prefix: str, depth: int) -> None:
        files = self.store.list(prefix)
        live_owners: set[str] = set()
        for info in files:
            leaf = info.name.rpartition("/")[2]
            if TMP_MARKER not in leaf:
                continue
            m = match_temporary(leaf, is_dir=False)
            if m is None:
                self.ignored.append((info.name, ("not named as stagesave names its temporaries "
                                                 "(a user's file)")))
                continue
            age = max(0.0, self.now - info.mtime)
            debris, reason = self._owner_state(m.group("pid"), age)
            if debris:
                self.found.append(Debris(info.name, "temporary", "remove", reason, info.size, age))
            else:
                self.kept.append((info.name, reason))
                live_owners.add(m.group("data"))
        for leaf in self.store.list_dirs(prefix):
            sub = join(prefix, leaf)
            if TMP_MARKER in leaf:
                m = match_temporary(leaf, is_dir=True)
                if m is None:
                    self.ignored.append((sub, ("not named as stagesave names its temporaries "
                                               "(a user's folder)")))
                    continue
                mtime, size = _tree_newest_mtime(self.store, sub)
                age = max(0.0, self.now - mtime)
                debris, reason = self._owner_state(m.group("pid"), age)
                if debris:
                    self.found.append(Debris(sub, "temporary-dir", "remove", reason, size, age))
                else:
                    self.kept.append((sub, reason))
                    live_owners.add(m.group("data"))
            elif ASIDE_MARKER in leaf:
                self._aside(prefix, leaf)
            elif not leaf.startswith(".") and depth < self.max_depth:
                self.walk(sub, depth + 1)
        self._orphans(prefix, files, live_owners)

    def _aside(self, prefix: str, leaf: str) -> None:
        sub = join(prefix, leaf)
        parsed = parse_aside_name(leaf)
        if parsed is None:
            self.ignored.append((sub, ("not named as stagesave names folders it moves aside "
                                       "(a user's folder)")))
            return
        original, pid = parsed
        if self.local and pid_alive(pid):
            self.kept.append((sub, f"its mover (pid {pid}) is running"))
            return
        mtime, size = _tree_newest_mtime(self.store, sub)
        if original in self.store.list_dirs(prefix):
            reason = f"left aside when {join(prefix, original)} was replaced, which is in place"
            self.found.append(Debris(sub, "aside-dir", "remove", reason, size, self.now - mtime))
        else:
            reason = f"the only copy of {join(prefix, original)}, left aside by a crash"
            self.found.append(Debris(sub, "aside-dir", "restore", reason, 0, self.now - mtime))

    def _orphans(self, prefix: str, files: list[Any], live_owners: set[str]) -> None:
        present = {f.name.rpartition("/")[2] for f in files}
        for info in files:
            leaf = info.name.rpartition("/")[2]
            if TMP_MARKER in leaf:
                continue
            parsed = split_manifest_name(leaf)
            if parsed is None:
                continue
            data_leaf = parsed[0]
            if not is_sidecar_of(self.store, info.name, data_leaf):
                self.ignored.append((info.name, (f"named like a manifest, but not a stagesave "
                                                 f"manifest of {data_leaf}")))
                continue
            if data_leaf in live_owners or leaf in live_owners:
                self.kept.append((info.name,
                                  f"a save of {join(prefix, data_leaf)} is in progress"))
                continue
            age = max(0.0, self.now - info.mtime)
            if not self.local and age < self.older_than_s:
                self.kept.append((info.name, (f"written {age:.0f} s ago: its save may still "
                                              f"be publishing")))
                continue
            reason = orphan_reason(self.store, prefix, data_leaf, info.name, data_leaf in present)
            if reason is None:
                continue
            self.found.append(Debris(info.name, "orphan-manifest", "remove", reason, info.size,
                                     age))


def orphan_reason(
    store: Store, prefix: str, data_leaf: str, manifest: str, present: bool,
) -> str | None:
    """Why ``manifest`` is debris, or ``None`` when it is the live manifest, evidence to keep, or
    not a stagesave manifest at all (a user's file that is only named like one)."""
    data = join(prefix, data_leaf)
    if not is_sidecar_of(store, manifest, data_leaf):
        return None
    missing = (f"its data file {data} does not exist (a save that never published it, or a file "
               f"removed since)")
    if not present:
        try:
            store.info(data)
        except (FileNotFoundError, IsADirectoryError):
            return missing
        return None
    try:
        ci = resolve(store, data)
    except (FileNotFoundError, IsADirectoryError):
        return missing
    if ci.status == "committed" and ci.format == 2:
        return f"{data} carries its own proof now (format 2): this format-1 manifest is stale"
    if ci.status == "committed" and ci.manifest_name is not None and ci.manifest_name != manifest:
        return (f"{data} is committed under another manifest (this one is from a save that did "
                f"not publish)")
    return None


def find_debris(
    store: Store, *, older_than_s: float = 3600.0, check_pids: bool = True,
    now: float | None = None, max_depth: int = MAX_DEPTH,
) -> tuple[list[Debris], list[tuple[str, str]]]:
    """Every piece of debris under ``store``'s root (``max_depth`` folders down; 0: the root
    only), and the stagesave temporaries kept (with why).

    Multipart uploads are not included (see :func:`stagesave.restore.gc.collect_garbage`).
    """
    when = time.time() if now is None else now
    found, kept, _ = find_all(store, older_than_s, check_pids, when, max_depth)
    return found, kept


def find_all(
    store: Store, older_than_s: float, check_pids: bool, now: float, max_depth: int,
) -> tuple[list[Debris], list[tuple[str, str]], list[tuple[str, str]]]:
    """``(found, kept, ignored)``: the debris, the temporaries kept (with why), and the names
    that only resemble stagesave's (users' files, left alone)."""
    finder = _Finder(store, older_than_s, check_pids, now, max_depth)
    finder.walk("", 0)
    return finder.found, finder.kept, finder.ignored
