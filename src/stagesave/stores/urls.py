"""Checkpoint locations that are either local paths or fsspec URLs, handled alike.

An adapter receives folders as the user wrote them (``~/runs/x``, ``file:///runs/x``,
``s3://bucket/run/``). These helpers give each one canonical spelling and join, split and
name them without caring which kind it is: ``file://`` counts as a local path, and a URL keeps
its scheme and loses its trailing slash.
"""

from __future__ import annotations

import os

from .targets import is_url

__all__ = ["is_url", "join", "leaf", "normalize", "parent", "s3_bucket_and_prefix"]


def normalize(path: str | os.PathLike[str]) -> str:
    """An absolute local path, or the URL without a trailing slash."""
    p = os.fspath(path)
    p = p.removeprefix("file://")
    if is_url(p):
        return p.rstrip("/")
    return os.path.abspath(os.path.expanduser(p))


def join(root: str, name: str) -> str:
    """``name`` inside the folder ``root`` (path or URL)."""
    return f"{root.rstrip('/')}/{name}" if is_url(root) else os.path.join(root, name)


def leaf(path: str) -> str:
    """The last component of a path or URL."""
    return path.rstrip("/").rpartition("/")[2] if is_url(path) else os.path.basename(path)


def parent(path: str) -> str:
    """The folder holding ``path`` (path or URL)."""
    return path.rstrip("/").rpartition("/")[0] if is_url(path) else os.path.dirname(path)


def s3_bucket_and_prefix(url: str) -> tuple[str, str]:
    """The bucket and key prefix of an ``s3://`` (or ``s3a://``) root.

    Raises:
        ValueError: not such a URL, no bucket, or credentials in it (never echoed).
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("s3", "s3a"):
        raise ValueError("an S3 checkpoint root must look like s3://bucket/prefix")
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        # Never echo it: it may hold a secret.
        raise ValueError(
            "credentials in an s3:// URL are not supported (and would leak into logs); "
            "pass them in storage_options (key=..., secret=...)"
        )
    if not bucket:
        raise ValueError("an S3 checkpoint root must name a bucket: s3://bucket/prefix")
    return bucket, prefix.strip("/")
