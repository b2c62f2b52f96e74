"""What a save checks on the caller's time, before anything is staged: a clear error now,
never a failure in the background later."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ..errors import CheckpointError, CheckpointPermissionError, UnsupportedObjectError
from ..ondisk.checksum import DIGEST_HEX_LEN
from ..ondisk.manifest import MAX_DEPTH, plain_json
from ..ondisk.names import (
    ALIGNMENT,
    MAX_FOLDER_DEPTH,
    MAX_MANIFEST_BYTES,
    TMP_MARKER,
    check_target_name,
)
from ..stores.base import Store, check_name
from ..stores.local import makedirs_durable
from ..stores.targets import StoreResolver
from .plan import FileImage
from .publish import FILE_THERE

__all__ = [
    "MAX_METADATA_BYTES", "check_folder_names", "check_folder_writable", "check_inside_root",
    "check_options", "check_proof_fits", "check_same_filesystem", "checked_metadata",
    "proof_bound", "target",
]

#: The user's metadata, as JSON, at most this many bytes: it is written into every file's proof,
#: which a loader refuses above :data:`~stagesave.ondisk.names.MAX_MANIFEST_BYTES`.
MAX_METADATA_BYTES = 8 << 20


def check_same_filesystem(
    store: Store, dname: str, staging_dir: str | os.PathLike[str] | None
) -> str | None:
    """``staging_dir`` as a string, refused if the folder cannot be renamed from it (the
    target's local parent: a local root, or a tiered root's local tier)."""
    if staging_dir is None:
        return None
    target_parent = store.local_path(dname.rpartition("/")[0])
    if target_parent is None:
        raise ValueError(
            "staging_dir only applies to local targets (a local root or a tiered root's local tier)"
        )
    makedirs_durable(os.fspath(staging_dir))
    if os.stat(staging_dir).st_dev != os.stat(target_parent).st_dev:
        raise ValueError(
            f"staging_dir {os.fspath(staging_dir)} is on another filesystem than {target_parent}: "
            "the finished folder is renamed into place, which needs the same filesystem"
        )
    return os.fspath(staging_dir)


def checked_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """The user's metadata, refused now (not in the background) if it cannot go into a proof.

    Raises:
        UnsupportedObjectError: not a dict of JSON values (NaN and infinities are not JSON).
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise UnsupportedObjectError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        encoded = json.dumps(metadata, allow_nan=False)
        plain_json(json.loads(encoded), "metadata", "metadata")
    except (TypeError, ValueError, RecursionError) as exc:  # ManifestError is a ValueError too
        raise UnsupportedObjectError(
            f"metadata must hold JSON values (str, numbers, bool, None, lists, dicts) nested at "
            f"most {MAX_DEPTH} deep: {exc}"
        ) from exc
    if len(encoded) > MAX_METADATA_BYTES:
        raise UnsupportedObjectError(
            f"metadata is {len(encoded)} bytes as JSON, more than the {MAX_METADATA_BYTES} a "
            "checkpoint's proof may carry: keep large values in the state or a file of their own"
        )
    return dict(metadata)


def proof_bound(storages: int, size: int, *, chunk_bytes: int, algorithm: str) -> int:
    """At least as many bytes as the proof of a ``size``-byte file of ``storages`` storages
    keyed by numbers (a torch file's) takes besides its metadata, escaped once as a JSON
    string: every number as wide as the file's size. (A safetensors file's storages are keyed
    by its tensors' names: its planner measures its proof and header exactly and refuses them
    past the readers' limits, ``plan_safetensors.plan_safetensors_file``.)"""
    chunks = -(-size // chunk_bytes) + 1
    per_storage = len(str(max(storages, 1))) + 2 * len(str(size)) + 12
    return 4096 + storages * per_storage + chunks * (DIGEST_HEX_LEN.get(algorithm, 64) + 5)


def check_proof_fits(files: Sequence[tuple[int, int]], *, chunk_bytes: int, algorithm: str,
                     metadata: dict[str, Any]) -> None:
    """Refuse a save whose proof a loader would refuse as too large.

    ``files``: each file's storages and size. A proof lists its file's storages (key, offset,
    bytes) and chunk digests beside the metadata, a folder's carrier also the other files (and
    a raw file's chunks); a loader reads at most
    :data:`~stagesave.ondisk.names.MAX_MANIFEST_BYTES` of it. The sum of the files'
    :func:`proof_bound` and the metadata (escaped) bounds every proof of the save.

    Raises:
        UnsupportedObjectError: a proof could exceed the limit (the save would be unloadable).
    """
    bound = 2 * len(json.dumps(metadata)) + sum(
        proof_bound(n, size, chunk_bytes=chunk_bytes, algorithm=algorithm) for n, size in files)
    if bound > MAX_MANIFEST_BYTES:
        storages = sum(n for n, _ in files)
        chunks = sum(-(-size // chunk_bytes) + 1 for _, size in files)
        raise UnsupportedObjectError(
            f"this save would carry a proof of up to {bound / 2**20:.0f} MiB ({storages} "
            f"storages, {chunks} checksum chunks), more than the {MAX_MANIFEST_BYTES >> 20} MiB "
            "a loader reads: save fewer, larger tensors (flatten small ones into one), use a "
            "larger chunk_bytes, or split the state over several files"
        )


def check_inside_root(store: Store, name: str) -> None:
    """Refuse a target whose directory a symbolic link puts outside the store's root.

    Readers never follow a link out of the root (``LocalStore`` refuses it), so such a save
    could never be loaded, verified or found by ``latest()``: it is refused before anything is
    written. Links that stay inside the root work end to end; a link as the target's own name
    is replaced by the new file, never followed.

    Raises:
        CheckpointPermissionError: the target's directory resolves outside the root.
    """
    local, root = store.local_path(name), store.local_path("")
    if local is None or root is None:
        return
    real_root = os.path.realpath(root)
    parent = os.path.realpath(os.path.dirname(local))
    if parent != real_root and not parent.startswith(real_root.rstrip(os.sep) + os.sep):
        raise CheckpointPermissionError(
            f"refusing to save {local}: its directory is a symbolic link to {parent}, outside the "
            f"checkpoint root {root}, and stagesave never reads through links out of the root. Use "
            f"the link's target as the root (or pass an absolute path), or a directory inside "
            f"{root}."
        )


def check_options(*, keep_last: int | None, io_threads: int, chunk_bytes: int) -> None:
    """Refuse a Checkpointer's numeric options that cannot work.

    Raises:
        ValueError: which option, and what it must be.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if io_threads < 1:
        raise ValueError(f"io_threads must be >= 1, got {io_threads}")
    if chunk_bytes < ALIGNMENT or chunk_bytes % ALIGNMENT:
        raise ValueError(
            f"chunk_bytes must be a positive multiple of {ALIGNMENT}, got {chunk_bytes}"
        )


def target(targets: StoreResolver, path: str | os.PathLike[str]) -> tuple[Store, str]:
    """``(store, name)`` of a save's target, refused now if it could never be committed or
    read back.

    Raises:
        ValueError: the root itself, a temporary's or reserved name.
            CheckpointPermissionError: a directory linked outside the root.
    """
    store, name = targets.split(path)
    if name.strip("/") in ("", "."):
        raise ValueError(
            f"invalid checkpoint name {os.fspath(path)!r}: it names the root "
            f"{store.describe('')} itself; name a file or folder inside it"
        )
    check_target_name(name)
    check_inside_root(store, name)
    return store, name


def check_folder_names(files: dict[str, Any]) -> None:
    """Refuse a folder save without files or with a file name that cannot be a member.

    Raises:
        ValueError: which name, and why.
    """
    if not files:
        raise ValueError("save_dir needs at least one file")
    for fname in files:
        try:
            check_name(fname)
            check_target_name(fname)
            if fname.count("/") > MAX_FOLDER_DEPTH:
                raise ValueError(f"it lies in more than {MAX_FOLDER_DEPTH} nested folders, "
                                 "deeper than a reader looks for a checkpoint's files")
        except ValueError as exc:
            raise ValueError(f"invalid file name {fname!r} in directory checkpoint: {exc}") from exc


def check_folder_writable(store: Store, dname: str, images: list[FileImage]) -> None:
    """Check that the folder's parent takes its files (by a sibling name: the folder itself
    must not appear before its commit)."""
    local = store.local_path(dname)
    if (local is not None and os.path.lexists(local) and not os.path.isdir(local)
            and not os.path.islink(local)):  # (a link is replaced, never what it points to)
        raise CheckpointError(f"cannot write folder checkpoint {store.describe(dname)}: "
                              f"{FILE_THERE}")
    total = sum((im.size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT for im in images)
    parent, _, leaf = dname.rpartition("/")
    sibling = f"{parent}/.{leaf}{TMP_MARKER}" if parent else f".{leaf}{TMP_MARKER}"
    try:
        store.check_writable(sibling, total)
    except CheckpointError as exc:  # named as the user named it, not by the hidden sibling
        hidden, shown = store.describe(sibling), store.describe(dname)
        exc.args = tuple(a.replace(hidden, shown) if isinstance(a, str) else a for a in exc.args)
        if isinstance(exc, OSError) and isinstance(exc.strerror, str):
            exc.strerror = exc.strerror.replace(hidden, shown)
        raise
