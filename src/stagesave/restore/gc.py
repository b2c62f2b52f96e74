"""Debris of crashed saves: finding it, and never removing anything else.

A save killed mid-way leaves debris the commit protocol (``saving/commit.py``) makes harmless
but does not clean up: temporaries (files and staging folders named as stagesave names them:
``.<name>.<pid>-<token>.stagesave-tmp``), format-1 manifests whose data file never appeared or
now carries its own proof, folders moved aside during a folder replacement, and, on S3,
multipart uploads never completed (they cost storage until aborted). Each kind is recognised by
the exact names stagesave gives it (a user's file that merely contains the marker is left
alone), by its content where it has one (a manifest must parse as stagesave's), *and* by proof
that no live save still owns it (:mod:`.debris` finds it, :mod:`.liveness` says whether a pid
runs):

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
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..ondisk.names import split_manifest_name
from ..stores import posix as fsops
from ..stores.base import Store
from .debris import MAX_DEPTH, Debris, find_all, find_debris, match_temporary, orphan_reason
from .info import join

__all__ = ["Debris", "GcReport", "collect_garbage", "find_debris", "match_temporary"]


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
                raise OSError(f"{store.describe(d.name)} became the live manifest of its file; "
                              f"left alone")
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
            _remove_tree(store, join(name, leaf), depth + 1)


def _multipart(
    store: Store, *, dry_run: bool, older_than_s: float, storage_options: dict[str, Any] | None,
    now: float,
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
                Debris(str(a), "multipart-upload", "abort",
                       f"not completed for over {older_than_s:.0f} s")
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
            f"{key[len(key_prefix):]} (upload {up.get('UploadId', '?')})", "multipart-upload",
            "abort",
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
    report.found, report.kept, report.ignored = find_all(store, older_than_s, check_pids, now,
                                                         MAX_DEPTH)
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
            store, dry_run=dry_run, older_than_s=older_than_s, storage_options=storage_options,
            now=now,
        )
    except Exception as exc:  # noqa: BLE001, RUF100 - the S3 client raises its own family
        uploads, problems = [], [(f"multipart uploads under {store.url}: "
                                  f"{type(exc).__name__}: {exc}")]
    report.found += uploads
    if not dry_run:
        report.done += uploads
    report.errors += problems
    return report
