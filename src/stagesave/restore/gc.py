"""Debris of crashed saves: finding it, and never removing anything else.

A save killed mid-way leaves debris the commit protocol (``_commit.py``) makes harmless but does
not clean up: temporaries (files and staging folders named as stagesave names them:
``.<name>.<pid>-<token>.stagesave-tmp``), format-1 manifests whose data file never appeared or
now carries its own proof, folders moved aside during a folder replacement, and, on S3,
multipart uploads never completed (they cost storage until aborted). Each kind is recognised by
the exact names stagesave gives it (a user's file that merely contains the marker is left
alone), by its content where it has one (a manifest must parse as stagesave's), *and* by proof
that no live save still owns it:

- a temporary is removed when the pid embedded in its name is not running on this host, or when
  nothing in it was modified for ``older_than_s`` (a live writer keeps touching its temporary);
  names without a pid (object stores) only age out. On a filesystem shared by several hosts, a
  pid says nothing about other hosts: pass ``check_pids=False`` there.
- a format-1 manifest (a sidecar ``<name>.<id>.stagesave.json``: written by stagesave before
  format 2, and by ``stagesave adopt``) is stale when it parses as stagesave's manifest of its
  data file and that file is missing, now carries its own proof (format 2), or is committed
  under another manifest. A file only named like one is a user's and is left alone. A manifest
  is never removed while a live temporary of the same data file exists; on stores without
  visible temporaries (S3 multipart) it must also be older than ``older_than_s``. A manifest
  that no longer matches its file is *evidence of corruption* and is kept.
- a folder moved aside (``.stagesave-aside``) whose mover is dead is moved back if the checkpoint
  it replaced is missing, else removed (the repair every save into that directory performs;
  reads never do it: ``latest()`` offers such a folder where it lies).

Symlinks are never followed, listed or removed (stores list regular files and real folders only).
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..ondisk.names import ASIDE_MARKER, TMP_MARKER, parse_aside_name, split_manifest_name
from ..stores import posix as fsops
from ..stores.base import Store
from .discovery import is_sidecar_of, resolve

__all__ = ["Debris", "GcReport", "collect_garbage", "find_debris", "match_temporary"]

#: The exact names stagesave gives its temporaries. Files: ``.<name>.<pid>-<8 hex>.stagesave-tmp``
#: (a local write, the backup link of a publish, a removal in progress), ``.<name>.<8 hex>.stagesave-tmp``
#: (fsspec stores: no pid) and the markers of sharded saves ``.dcp-rank-<r>.<pid>-<32 hex>.stagesave-tmp``.
#: Folders: the same names beside their target, or ``<name>.<pid>-<8 hex>.stagesave-tmp`` (no dot)
#: inside a ``staging_dir``. Anything else that merely contains the marker is a user's file.
_TMP_RE = re.compile(
    r"^\.(?P<data>.+)\.(?:(?P<pid>\d+)-)?(?P<token>[0-9a-f]{8}|[0-9a-f]{32})" + re.escape(TMP_MARKER) + r"$"
)
_STAGING_RE = re.compile(r"^(?P<data>[^.].*)\.(?P<pid>\d+)-(?P<token>[0-9a-f]{8})" + re.escape(TMP_MARKER) + r"$")
#: ``.<folder name>.<pid>-<8 hex>.stagesave-aside`` (``_names.aside_name``).
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


@dataclass
class GcReport:
    """What one gc pass found and did."""

    root: str
    dry_run: bool
    found: list[Debris] = field(default_factory=list)
    done: list[Debris] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Names that only resemble stagesave's (users' files), left alone, with why.
    ignored: list[tuple[str, str]] = field(default_factory=list)

    @property
    def reclaimed_bytes(self) -> int:
        return sum(d.size for d in self.done)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie counts as dead)."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # state is the field after the parenthesised command name
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def match_temporary(leaf: str, *, is_dir: bool) -> re.Match[str] | None:
    """The parts (``data``, ``pid``, ``token``) of a name stagesave gives its temporaries, or
    ``None`` for any other name (however similar)."""
    m = _TMP_RE.match(leaf)
    if m is None and is_dir:
        m = _STAGING_RE.match(leaf)
    return m


def _join(prefix: str, leaf: str) -> str:
    return f"{prefix}/{leaf}" if prefix else leaf


def _tree_newest_mtime(store: Store, name: str, depth: int = 0) -> tuple[float, int]:
    """Newest modification time and total size of the files in folder ``name``."""
    local = store.local_path(name)
    newest, total = 0.0, 0
    if local is not None:
        try:
            newest = os.lstat(local).st_mtime
        except OSError:
            pass
    for info in store.list(name):
        newest = max(newest, info.mtime)
        total += info.size
    if depth < MAX_DEPTH:
        for leaf in store.list_dirs(name):
            m, s = _tree_newest_mtime(store, _join(name, leaf), depth + 1)
            newest, total = max(newest, m), total + s
    return newest, total


class _Finder:
    def __init__(self, store: Store, older_than_s: float, check_pids: bool, now: float, max_depth: int) -> None:
        self.store = store
        self.max_depth = max_depth
        self.older_than_s = older_than_s
        self.check_pids = check_pids
        self.now = now
        self.local = store.local_path("") is not None
        self.found: list[Debris] = []
        self.kept: list[tuple[str, str]] = []
        #: Names that contain a stagesave marker but are not stagesave's (users' files): never touched.
        self.ignored: list[tuple[str, str]] = []

    def _owner_state(self, pid: str | None, age: float) -> tuple[bool, str]:
        """``(is_debris, reason)`` for something written by ``pid`` last modified ``age`` s ago."""
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
                self.ignored.append((info.name, "not named as stagesave names its temporaries (a user's file)"))
                continue
            age = max(0.0, self.now - info.mtime)
            debris, reason = self._owner_state(m.group("pid"), age)
            if debris:
                self.found.append(Debris(info.name, "temporary", "remove", reason, info.size, age))
            else:
                self.kept.append((info.name, reason))
                live_owners.add(m.group("data"))
        for leaf in self.store.list_dirs(prefix):
            sub = _join(prefix, leaf)
            if TMP_MARKER in leaf:
                m = match_temporary(leaf, is_dir=True)
                if m is None:
                    self.ignored.append((sub, "not named as stagesave names its temporaries (a user's folder)"))
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
        sub = _join(prefix, leaf)
        parsed = parse_aside_name(leaf)
        if parsed is None:
            self.ignored.append((sub, "not named as stagesave names folders it moves aside (a user's folder)"))
            return
        original, pid = parsed
        if self.local and pid_alive(pid):
            self.kept.append((sub, f"its mover (pid {pid}) is running"))
            return
        mtime, size = _tree_newest_mtime(self.store, sub)
        if original in self.store.list_dirs(prefix):
            reason = f"left aside when {_join(prefix, original)} was replaced, which is in place"
            self.found.append(Debris(sub, "aside-dir", "remove", reason, size, self.now - mtime))
        else:
            reason = f"the only copy of {_join(prefix, original)}, left aside by a crash"
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
            if not _is_manifest_of(self.store, info.name, data_leaf):
                self.ignored.append((info.name, f"named like a manifest, but not a stagesave manifest of {data_leaf}"))
                continue
            if data_leaf in live_owners or leaf in live_owners:
                self.kept.append((info.name, f"a save of {_join(prefix, data_leaf)} is in progress"))
                continue
            age = max(0.0, self.now - info.mtime)
            if not self.local and age < self.older_than_s:
                self.kept.append((info.name, f"written {age:.0f} s ago: its save may still be publishing"))
                continue
            reason = orphan_reason(self.store, prefix, data_leaf, info.name, data_leaf in present)
            if reason is None:
                continue
            self.found.append(Debris(info.name, "orphan-manifest", "remove", reason, info.size, age))


_is_manifest_of = is_sidecar_of


def orphan_reason(store: Store, prefix: str, data_leaf: str, manifest: str, present: bool) -> str | None:
    """Why ``manifest`` is debris, or ``None`` when it is the live manifest, evidence to keep, or
    not a stagesave manifest at all (a user's file that is only named like one)."""
    data = _join(prefix, data_leaf)
    if not _is_manifest_of(store, manifest, data_leaf):
        return None
    missing = f"its data file {data} does not exist (a save that never published it, or a file removed since)"
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
        return f"{data} is committed under another manifest (this one is from a save that did not publish)"
    return None


def find_debris(
    store: Store, *, older_than_s: float = 3600.0, check_pids: bool = True, now: float | None = None,
    max_depth: int = MAX_DEPTH,
) -> tuple[list[Debris], list[tuple[str, str]]]:
    """Every piece of debris under ``store``'s root (``max_depth`` folders down; 0: the root
    only), and the stagesave temporaries kept (with why).

    Multipart uploads are not included (see :func:`collect_garbage`).
    """
    found, kept, _ = _find(store, older_than_s, check_pids, time.time() if now is None else now, max_depth)
    return found, kept


def _find(
    store: Store, older_than_s: float, check_pids: bool, now: float, max_depth: int,
) -> tuple[list[Debris], list[tuple[str, str]], list[tuple[str, str]]]:
    finder = _Finder(store, older_than_s, check_pids, now, max_depth)
    finder.walk("", 0)
    return finder.found, finder.kept, finder.ignored


def _remove(store: Store, d: Debris) -> None:
    if d.kind == "temporary" or d.kind == "orphan-manifest":
        local = store.local_path(d.name)
        if local is not None:
            st = os.lstat(local)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{local} is no longer a regular file; left alone")
        if d.kind == "orphan-manifest":
            # Re-prove just before deleting: the data file may have been published meanwhile.
            prefix, _, leaf = d.name.rpartition("/")
            parsed = split_manifest_name(leaf)
            assert parsed is not None
            if orphan_reason(store, prefix, parsed[0], d.name, True) is None:
                raise OSError(f"{store.describe(d.name)} became the live manifest of its file; left alone")
        store.delete(d.name)
        return
    if d.kind == "temporary-dir" or (d.kind == "aside-dir" and d.action == "remove"):
        _remove_tree(store, d.name)
        return
    if d.kind == "aside-dir" and d.action == "restore":
        from ..saving.commit import restore_aside

        restore_aside(store, d.name.rpartition("/")[0])
        return
    raise ValueError(f"unknown debris kind {d.kind!r}")


def _remove_tree(store: Store, name: str, depth: int = 0) -> None:
    local = store.local_path(name)
    if local is not None:
        st = os.lstat(local)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"{local} is not a real folder (a symlink?); left alone")
        fsops.rmtree(local, ignore_errors=False)  # removes links inside, never follows them
        return
    for info in store.list(name):
        store.delete(info.name)
    if depth < MAX_DEPTH:
        for leaf in store.list_dirs(name):
            _remove_tree(store, _join(name, leaf), depth + 1)


def _multipart(
    store: Store, *, dry_run: bool, older_than_s: float, storage_options: dict[str, Any] | None, now: float
) -> tuple[list[Debris], list[str]]:
    """Stale multipart uploads under an ``s3://`` root: listed (dry run) or aborted."""
    if not store.url.startswith(("s3://", "s3a://")):
        return [], []
    abort_stale: Callable[..., list[str]] | None = None
    if not dry_run:
        try:
            from ..stores.s3 import abort_stale_multipart_uploads as abort_stale
        except ImportError:
            abort_stale = None
        if abort_stale is not None:
            aborted = abort_stale(
                store,
                older_than_s=older_than_s, storage_options=storage_options,
            )
            return [
                Debris(str(a), "multipart-upload", "abort", f"not completed for over {older_than_s:.0f} s")
                for a in aborted
            ], []
    fs = getattr(store, "fs", None)
    if fs is None or not hasattr(fs, "list_multipart_uploads"):
        return [], [f"cannot list multipart uploads under {store.url}: the store has no S3 client"]
    bucket, _, key_prefix = store.url.split("://", 1)[1].partition("/")
    key_prefix = f"{key_prefix.strip('/')}/" if key_prefix.strip("/") else ""
    out = []
    for up in fs.list_multipart_uploads(bucket):
        key = str(up.get("Key", ""))
        if not key.startswith(key_prefix):
            continue
        initiated = up.get("Initiated")
        age = now - initiated.timestamp() if hasattr(initiated, "timestamp") else float("inf")
        if age < older_than_s:
            continue
        debris = Debris(
            f"{key[len(key_prefix):]} (upload {up.get('UploadId', '?')})", "multipart-upload", "abort",
            f"not completed for {age:.0f} s", 0, age,
        )
        if not dry_run:
            fs.abort_mpu(bucket, key, up["UploadId"])
        out.append(debris)
    return out, []


def collect_garbage(
    store: Store,
    *,
    dry_run: bool = False,
    older_than_s: float = 3600.0,
    check_pids: bool = True,
    storage_options: dict[str, Any] | None = None,
    on_item: Callable[[Debris], None] | None = None,
) -> GcReport:
    """Find the debris under ``store`` and (unless ``dry_run``) remove it.

    A piece that cannot be removed is reported in ``errors`` and the pass goes on.
    """
    now = time.time()
    report = GcReport(store.url, dry_run)
    report.found, report.kept, report.ignored = _find(store, older_than_s, check_pids, now, MAX_DEPTH)
    for d in report.found:
        if dry_run:
            continue
        try:
            _remove(store, d)
        except (OSError, ValueError) as exc:
            report.errors.append(f"{store.describe(d.name)}: {exc}")
            continue
        report.done.append(d)
        if on_item is not None:
            on_item(d)
    try:
        uploads, problems = _multipart(
            store, dry_run=dry_run, older_than_s=older_than_s, storage_options=storage_options, now=now
        )
    except Exception as exc:  # noqa: BLE001 - the S3 client raises its own family
        uploads, problems = [], [f"multipart uploads under {store.url}: {type(exc).__name__}: {exc}"]
    report.found += uploads
    if not dry_run:
        report.done += uploads
    report.errors += problems
    return report
