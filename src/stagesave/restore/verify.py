"""Verification: every byte of a checkpoint (file or folder) checked against its proof.

One chunk verifier serves loads, ``verify()``, ``latest()`` and resume checks: chunks are read
through one :class:`~stagesave.stores.base.Reader` (the same version whose proof was judged),
each I/O thread reusing one scratch buffer, and compared with the digests of the proof.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Callable
from typing import Any

from ..errors import (
    CheckpointNotFoundError,
    IntegrityError,
    StorageError,
    oserror_to_checkpoint_error,
)
from ..ondisk.manifest import FileEntry, Manifest
from ..saving import inflight
from ..stores.base import Reader, Store
from . import from_memory, kept_images, proof
from .info import CheckpointInfo, replaced
from .resolve_file import resolve_reader
from .resolve_folder import FolderEntry, folder_entries, resolve_dir
from .verified_memo import remember_verified, verified_before

__all__ = [
    "IoThreads", "check_chunks", "check_file", "folder_files_problems", "is_folder",
    "open_reader", "raise_if_corrupt", "replaced", "verify_checkpoint", "verify_entry",
]

#: The I/O threads of the Checkpointer a read runs for (created on first use).
IoThreads = Callable[[], cf.Executor]


def save_token(manifest: Any) -> Any:
    """What tells one save of a folder from another: its proof's random token (format 1: time)."""
    return manifest.folder.token if manifest.folder is not None else manifest.created_ns


def is_folder(store: Store, name: str) -> bool:
    """Whether ``name`` is a folder checkpoint rather than a file."""
    local = store.local_path(name)
    if local is not None:
        return os.path.isdir(local)
    try:
        store.info(name)
        return False
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return bool(store.list(name)) or bool(store.list_dirs(name))


def open_reader(store: Store, name: str, where: str) -> Reader:
    """Open the file ``name`` stands for (a link inside the root: its target) for reading.

    Raises:
        CheckpointNotFoundError: no such file. CheckpointError: it cannot be read (e.g. a
            symbolic link out of the root, which is never followed).
    """
    judged = store.canonical(name)
    try:
        return store.open(judged)
    except IsADirectoryError as exc:
        raise CheckpointNotFoundError(
            f"no checkpoint file at {where}: it is a folder (a folder checkpoint's files load "
            "one by one, e.g. its optimizer.bin; Accelerate's load_state reads them all)"
        ) from exc
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise CheckpointNotFoundError(f"no checkpoint at {where}") from exc
    except OSError as exc:
        if replaced(exc):
            raise  # replaced while read: the caller reads the new version
        raise oserror_to_checkpoint_error(exc, f"cannot read checkpoint {where}") from exc


def check_chunks(
    reader: Reader, manifest: Any, io: IoThreads, view: memoryview | None = None,
) -> list[str]:
    """Check every chunk of one file through ``reader`` (or in ``view``, already read)."""
    if view is not None:
        return proof.chunk_problems(reader, manifest, io(),
                                    read=lambda lo, n: view[lo : lo + n])
    scratch = threading.local()

    def read(lo: int, n: int) -> memoryview:
        # One reused buffer per I/O thread: no allocation (and page faults) per chunk.
        buf = getattr(scratch, "buf", None)
        if buf is None or len(buf) < n:
            buf = scratch.buf = bytearray(n)
        got = reader.readinto(lo, memoryview(buf)[:n])
        return memoryview(buf)[:got]

    return proof.chunk_problems(reader, manifest, io(), read=read)


def verify_checkpoint(
    store: Store, name: str, io: IoThreads, *, reuse: bool = False,
) -> CheckpointInfo:
    """Check a checkpoint (file or folder) against its proof, reading every byte.

    ``reuse``: a file verified moments ago by this process, unchanged, is not read again.
    """
    inflight.wait_path(store.describe(name))
    if is_folder(store, name):
        # Its files are listed, then opened one by one: a folder replaced meanwhile (another
        # process saving over it) is verified again, never reported as damaged. Replaced
        # means: another save's proof is there now, or the listing and the proof it was
        # judged against were of two saves (a listing taken just before the replacement,
        # the proof read just after: the same proof, listed again, is whole).
        for _ in range(3):
            resolved = resolve_dir(store, name)
            listed_whole = resolved.status == "committed"
            info = _verify_folder(store, name, io, reuse, resolved)
            if info.status != "corrupt" or info.manifest is None:
                return info
            again = resolve_dir(store, name)
            if again.manifest is None:
                return info
            if save_token(again.manifest) != save_token(info.manifest):
                continue
            if not listed_whole and again.status == "committed":
                continue
            return info
        return info
    for attempt in range(3):
        try:
            return _verify_file(store, name, io, reuse)
        except StorageError as exc:  # replaced while being read (S3): verify the new version
            if not replaced(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _verify_file(store: Store, name: str, io: IoThreads, reuse: bool) -> CheckpointInfo:
    """One pass of :func:`verify_checkpoint` over a file checkpoint, read through one reader."""
    reader = open_reader(store, name, store.describe(name))
    judged = reader.name
    with reader:
        info = resolve_reader(store, judged, reader)
        if judged != name:
            info.path, info.name, info.judged = store.describe(name), name, judged
        if info.status != "committed" or info.manifest is None:
            return info
        info.problems = check_file(reader, info.manifest, io, reuse)
    info.status = "corrupt" if info.problems else "verified"
    return info


def _verify_folder(
    store: Store, name: str, io: IoThreads, reuse: bool, info: CheckpointInfo,
) -> CheckpointInfo:
    """One pass of :func:`verify_checkpoint` over a folder checkpoint (``info``: as resolved
    just before): every file of it checked."""
    if info.status != "committed" or info.manifest is None:
        return info
    entries, problems = folder_entries(store, info)
    problems += folder_files_problems(
        store, name, entries, lambda reader, proof: check_file(reader, proof, io, reuse))
    folder = info.manifest.folder
    for sub in folder.nested if folder is not None else ():
        inner = verify_checkpoint(store, f"{name}/{sub}", io)
        if inner.status != "verified":
            problems += inner.problems or [f"{inner.path} is {inner.status}"]
    info.problems = problems
    info.status = "corrupt" if problems else "verified"
    return info


def folder_files_problems(
    store: Store, name: str, entries: list[FolderEntry],
    check: Callable[[Reader, Manifest], list[str]],
) -> list[str]:
    """Every file of folder ``name`` (its ``entries``, :func:`.resolve_folder.folder_entries`)
    checked by ``check(reader, proof)``: against its own proof, or the one its folder's proof
    lists for it (after its size)."""
    problems: list[str] = []
    for fname, own, listed in entries:
        full = f"{name}/{fname}"
        try:
            with store.open(full) as reader:
                if own is not None:
                    problems += check(reader, own)
                elif listed is not None:
                    if reader.size != listed.size:
                        problems.append(f"{reader.where} is {reader.size} bytes, its folder's "
                                        f"proof says {listed.size}")
                    else:
                        problems += check(reader, Manifest([listed], 0))
        except OSError as exc:
            problems.append(f"{store.describe(full)}: {exc.strerror or exc}")
    return problems


def check_file(reader: Reader, manifest: Any, io: IoThreads, reuse: bool) -> list[str]:
    """Every chunk of one file checked (unless ``reuse`` and verified moments ago, unchanged,
    or ``reuse`` and a writer agent's snapshot of it in memory matches it: the bytes the load
    that follows uses); a match is remembered for the load that follows, and inside
    :func:`.kept_images.keeping` its bytes are kept for that load."""
    entry = manifest.files[0]
    if reuse and verified_before(reader, entry):
        return []
    if reuse and from_memory.checked_snapshot(reader, manifest, io()) is not None:
        return []  # a resume loads the agent's snapshot, whose bytes match this proof
    kept = kept_images.keep_while_checking(reader, manifest, io())
    problems = check_chunks(reader, manifest, io) if kept is None else kept
    if not problems:
        remember_verified(reader, entry)
    return problems


def verify_entry(
    store: Store, name: str, entry: FileEntry, pool: cf.Executor | None = None,
) -> list[str]:
    """Recompute every chunk digest of ``name`` against ``entry``; the problems (empty: intact)."""
    try:
        reader = store.open(name)
    except OSError as exc:
        return [f"{store.describe(name)}: {exc.strerror or exc}"]
    with reader:
        if reader.size != entry.size:
            return [f"{reader.where} is {reader.size} bytes, its proof says {entry.size}"]
        return proof.chunk_problems(reader, Manifest([entry], 0), pool)


def raise_if_corrupt(problems: list[str], path: str) -> None:
    """Refuse to load a checkpoint whose verification found ``problems``.

    Raises:
        IntegrityError: ``problems`` is not empty; the message names the first.
    """
    if problems:
        raise IntegrityError(
            f"checkpoint {path} is corrupt: {problems[0]}"
            + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")
            + ". It was not loaded; use the previous checkpoint (stagesave.latest skips corrupt "
            "ones)."
        )
