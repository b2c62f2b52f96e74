"""Which tier of a tiered root a read goes to.

Reads choose, per checkpoint, the newest committed copy, preferring the local tier on a tie, so
``latest()`` restores from local disk when the local copy is valid and from the remote tier
otherwise (another node wrote a newer one, or the local disk was wiped). A checkpoint is a data
file with its manifests, or a folder checkpoint with everything inside it: all of it is read
from one tier. While the remote tier fails, reads skip it for ``retry_after_s``; a read of the
remote tier that takes longer than ``timeout_s`` counts as a failure.
"""

from __future__ import annotations

import builtins
import concurrent.futures as cf
import contextlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..ondisk.names import DIR_MANIFEST, split_manifest_name
from ..restore.resolve_file import resolve
from ..restore.resolve_folder import resolve_dir
from .base import Store

__all__ = ["LOCAL", "REMOTE", "TierRouter"]

T = TypeVar("T")

LOCAL, REMOTE = "local", "remote"


class TierRouter:
    """The tier each checkpoint of a tiered root is read from, and the remote tier's health.

    Args:
        local: The local tier.
        remote: The remote tier.
        retry_after_s: After a remote failure, reads skip the remote tier this long.
        timeout_s: A read of the remote tier that takes longer counts as a failure.
    """

    def __init__(self, local: Store, remote: Store, *, retry_after_s: float,
                 timeout_s: float) -> None:
        self.local = local
        self.remote = remote
        self.retry_after_s = retry_after_s
        self.timeout_s = timeout_s
        self._probe_pool = cf.ThreadPoolExecutor(max_workers=2,
                                                 thread_name_prefix="stagesave-probe")
        self._lock = threading.Lock()
        self._route: dict[str, str] = {}
        self._remote_down_until = 0.0

    # ------------------------------------------------------------------ checkpoints and routes
    def key(self, name: str) -> str:
        """The checkpoint a name belongs to: a data file (with its manifests) or a folder."""
        with self._lock:
            return self._key_unlocked(name)

    def _key_unlocked(self, name: str) -> str:
        parent, _, leaf = name.rpartition("/")
        if leaf == DIR_MANIFEST:
            return f"dir:{parent}"
        parsed = split_manifest_name(leaf)
        if parsed is not None:
            return f"{parent}/{parsed[0]}" if parent else parsed[0]
        parts = name.split("/")
        for i in range(len(parts) - 1, 0, -1):  # the innermost folder checkpoint holding it
            key = "dir:" + "/".join(parts[:i])
            if key in self._route:
                return key
        return name

    def routed(self, name: str) -> str | None:
        """The tier (``LOCAL``/``REMOTE``) the checkpoint of ``name`` is routed to, if chosen."""
        with self._lock:
            return self._route.get(self._key_unlocked(name))

    def tier(self, name: str) -> Store:
        """The store reads of ``name`` go to now (the local tier until a route is chosen)."""
        return self.remote if self.routed(name) == REMOTE else self.local

    def set_local(self, name: str) -> None:
        """``name`` is being written on the local tier: read it from there."""
        key = self.key(name)
        with self._lock:
            self._route[key] = LOCAL

    def _probe(self, store: Store, key: str) -> tuple[bool, tuple[float, float] | None]:
        """(exists, (seq, created) if committed) of one checkpoint in one tier."""
        try:
            if key == "dir:":  # the root itself is never a folder checkpoint
                return False, None
            if key.startswith("dir:"):
                ci = resolve_dir(store, key[4:])
                exists = ci.manifest is not None or ci.status == "corrupt"
            else:
                ci = resolve(store, key)
                exists = True
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return False, None
        order = (float(ci.seq if ci.seq is not None else -1), ci.created)
        return exists, order if ci.status == "committed" else None

    def decide(self, key: str) -> str:
        """Route ``key`` to the tier with the newest committed copy (local on a tie)."""
        local_exists, local_created = self._probe(self.local, key)
        remote_exists, remote_created = False, None
        # the remote tier down: route by the local tier alone
        with contextlib.suppress(OSError, TimeoutError):
            remote_exists, remote_created = self.remote_call(lambda: self._probe(self.remote, key))
        if local_created is not None and (remote_created is None
                                          or local_created >= remote_created):
            tier = LOCAL
        elif remote_created is not None:
            tier = REMOTE
        else:
            tier = LOCAL if local_exists or not remote_exists else REMOTE
        if key.startswith("dir:") and not (local_exists or remote_exists):
            with self._lock:
                self._route.pop(key, None)  # not (or no longer) a folder checkpoint
            return tier  # its files keep their own routes
        with self._lock:
            self._route[key] = tier
        return tier

    def for_read(self, name: str) -> tuple[Store, Store | None]:
        """The tier to read ``name`` from, and the one to try when it is not there (if any)."""
        key = self.key(name)
        if key == name:
            self.decide(key)  # the first read of a checkpoint: choose the tier afresh
        elif key.startswith("dir:") and name.rpartition("/")[0] == key[4:]:
            with self._lock:
                known = key in self._route
            if not known:
                self.decide(key)
        store = self.tier(name)
        other = self.remote if store is self.local else self.local
        if other is self.remote and not self.remote_usable():
            return store, None
        return store, other

    def folder_tier(self, prefix: str) -> Store | None:
        """The one tier to read a folder checkpoint (or a folder inside one) from, else ``None``.

        Listing a folder is where reading a folder checkpoint starts: its tier is chosen afresh
        there, as a file's is when it is first read.
        """
        if not prefix:
            return None
        with self._lock:
            outer = self._key_unlocked(prefix)
        if not outer.startswith("dir:"):
            self.decide(f"dir:{prefix}")
        with self._lock:
            tier = self._route.get(self._key_unlocked(f"{prefix}/x"))
        return None if tier is None else (self.remote if tier == REMOTE else self.local)

    # ------------------------------------------------------------------ the remote tier's health
    def remote_usable(self) -> bool:
        return time.monotonic() >= self._remote_down_until

    def remote_failed(self) -> None:
        """The remote tier failed: reads skip it for ``retry_after_s``."""
        self._remote_down_until = time.monotonic() + self.retry_after_s

    def remote_list(self, fn: Callable[[], builtins.list[Any]]) -> builtins.list[Any]:
        """A listing of the remote tier, or nothing (said on stderr) while the remote fails."""
        try:
            result: builtins.list[Any] = self.remote_call(fn)
        except (OSError, TimeoutError) as exc:
            print(f"stagesave: listing the remote tier {self.remote.url} failed ({exc}); "
                  f"using the local tier only for {self.retry_after_s:.0f} s", file=sys.stderr)
            return []
        return result

    def remote_call(self, fn: Callable[[], T]) -> T:
        """A read of the remote tier, given up after ``timeout_s``.

        Reads of the remote tier sit on paths that must stay fast while the remote is down (the
        local commit lists its directory), and a store's own retry budget can be long: past the
        deadline the remote counts as down for ``retry_after_s`` (the call itself is left to
        finish in the background).

        Raises:
            TimeoutError: the deadline passed, or the remote is known to be down.
            OSError: the remote failed.
        """
        if not self.remote_usable():
            raise TimeoutError(f"the remote tier {self.remote.url} failed recently")
        future = self._probe_pool.submit(fn)
        done, _ = cf.wait([future], timeout=self.timeout_s)
        if not done:
            self.remote_failed()
            raise TimeoutError(
                f"the remote tier {self.remote.url} did not answer within {self.timeout_s:.0f} s"
            )
        try:
            return future.result()
        except FileNotFoundError:
            raise
        except OSError:
            self.remote_failed()
            raise

    def close(self) -> None:
        self._probe_pool.shutdown(wait=False)
