"""Turning what users pass (a path, a URL, a store) into a store and a name inside it."""

from __future__ import annotations

import os
import threading
from typing import Any

from .base import Store
from .fsspec import FsspecStore
from .local import LocalStore

__all__ = ["StoreResolver", "is_url", "open_store"]


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def open_store(
    target: Store | str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    direct_io: bool = True,
) -> Store:
    """The store whose root is ``target``: itself if a store, else chosen by the URL's scheme."""
    if isinstance(target, Store):
        return target
    url = os.fspath(target)
    if url.startswith(("s3://", "s3a://")):
        from .s3 import S3Store  # the fast path: parallel multipart uploads

        return S3Store(url, storage_options)
    if is_url(url):
        return FsspecStore(url, storage_options)
    return LocalStore(url.removeprefix("file://"), direct_io=direct_io)


class StoreResolver:
    """Caches one store per directory so repeated saves reuse connections."""

    def __init__(
        self,
        root: Store | str | os.PathLike[str] | None,
        *,
        storage_options: dict[str, Any] | None = None,
        direct_io: bool = True,
    ) -> None:
        self.storage_options = dict(storage_options or {})
        self.direct_io = direct_io
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()
        self.root: Store | None
        if root is None:
            self.root = None
        elif isinstance(root, Store):
            self.root = root
        else:
            self.root = self.store_for(os.fspath(root))

    def store_for(self, url: str) -> Store:
        """The store whose root is the directory ``url``."""
        url = url.removeprefix("file://")
        key = url.rstrip("/") if is_url(url) else os.path.abspath(os.path.expanduser(url))
        with self._lock:
            store = self._stores.get(key)
            if store is None:
                store = open_store(key, self.storage_options, direct_io=self.direct_io)
                self._stores[key] = store
            return store

    def split(self, path: str | os.PathLike[str]) -> tuple[Store, str]:
        """``(store, name)`` for a checkpoint path; relative paths resolve against the root."""
        p = os.fspath(path)
        p = p.removeprefix("file://")
        if self.root is not None and not is_url(p) and not os.path.isabs(p):
            return self.root, p.replace(os.sep, "/")
        if is_url(p):
            head, _, leaf = p.rstrip("/").rpartition("/")
            return self.store_for(head), leaf
        full = os.path.abspath(os.path.expanduser(p))
        return self.store_for(os.path.dirname(full)), os.path.basename(full)

    def dir_store(self, root: Store | str | os.PathLike[str] | None) -> Store:
        """The store for a directory argument (``None``: the checkpointer's root)."""
        if root is None:
            if self.root is None:
                raise ValueError("no root given and the Checkpointer has none")
            return self.root
        if isinstance(root, Store):
            return root
        r = os.fspath(root)
        if self.root is not None and not is_url(r) and not os.path.isabs(r):
            base = self.root.url
            r = os.path.join(base, r) if not is_url(base) else f"{base}/{r}"
        return self.store_for(r)

    def close(self) -> None:
        with self._lock:
            stores = list(self._stores.values())
            self._stores.clear()
        for s in stores:
            s.close()
