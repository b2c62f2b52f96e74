"""Finding checkpoints: list a directory, order it, tell each checkpoint's status.

A file is *committed* when it exists under its final name and carries a valid proof (format 2:
inside the file; format 1: a sidecar ``<name>.<serialization_id>.stagesave.json`` naming its size
and id); *unverified* when it has none (a plain torch file: loadable, not provable); *corrupt*
when its proof is broken or, on verification, a chunk's digest differs. A folder is committed
when its carrier's proof names exactly the files it holds (format 2), or its
``checkpoint.stagesave.json`` does (format 1).

"Newest" is the sequence number each format-2 save records (one more than the highest committed
in its directory), never the wall clock: format-2 checkpoints order by it, above everything
else; format-1 and plain files, which have none, order by their recorded time or mtime.

A listing costs one directory read plus, for each file not seen before, one read of its last
few KiB (:func:`stagesave.restore.proof.peek`): what was learnt is cached per directory and reused
while a file's name, size and version stay the same, so ``latest()`` and the sequence number of
a new save stay linear in the number of checkpoints, and cheap when few changed.

Reading never writes. A folder left aside by a crash between the two renames of a replacement
(``.<name>.<pid>-<hex>.stagesave-aside``, its final name missing) is the only copy of that
checkpoint: a listing offers it where it lies, and the next write into the directory (or
``stagesave gc``) moves it back. A listing that meets the aside folder of a live mover waits for
the directory's commit lock (the mover holds it across both renames) and looks again.

A file without a proof is offered for a resume only if it would load as a torch file
(:func:`plain_problem`); verification then checks its zip records' CRC-32s, the only proof it has.
A verification of a local file is remembered (:func:`remember_verified`) by the identity of the
inode it read (device, inode, size, mtime and ctime in nanoseconds) and the proof it matched, so
that the load that follows ``latest()`` does not read and hash the same bytes again; any change
of the file, in place or by a rename over it, changes that identity.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import json
import os
import struct
import threading
import time
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import IntegrityError, ManifestError
from ..ondisk.manifest import FileEntry, Manifest, parse_manifest
from ..ondisk.names import (
    ASIDE_MARKER,
    DIR_MANIFEST,
    MANIFEST_SUFFIX,
    MAX_MANIFEST_BYTES,
    is_temporary,
    parse_aside_name,
    split_manifest_name,
)
from ..stores.base import ObjectInfo, Reader, Store
from .proof import FileProof, chunk_problems, peek, read_proof

__all__ = [
    "CheckpointInfo", "next_seq", "plain_problem", "raise_if_corrupt", "remember_verified", "resolve", "resolve_dir",
    "resolve_reader", "scan", "verified_before", "verify_entry",
]

#: Plain files with these suffixes are listed as (unverified) checkpoints.
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".tar", ".safetensors")


@dataclass
class CheckpointInfo:
    """A checkpoint found in a store."""

    path: str
    name: str
    status: str  # "committed" | "verified" | "unverified" | "corrupt"
    created: float
    size: int
    manifest: Manifest | None = None
    #: Format 1: the sidecar manifest that proves it (``None`` for format 2: the file itself).
    manifest_name: str | None = None
    problems: list[str] = field(default_factory=list)
    tier: str | None = None
    is_dir: bool = False
    #: Whether the checkpoint has a stagesave proof (matching or not).
    problems_from_manifest: bool = False
    #: The name that was judged: the target when ``name`` is a link inside the root.
    judged: str | None = None
    #: Format 2: the save's sequence number in its directory.
    seq: int | None = None
    #: 2: proof inside the file(s); 1: sidecar manifests; 0: no proof (a plain file).
    format: int = 0

    @property
    def valid(self) -> bool:
        return self.status in ("committed", "verified", "unverified")

    def order(self) -> tuple[int, float, float, str]:
        """Sort key, larger is newer: format 2 by sequence number, above everything else.

        Sequence number 0 marks a checkpoint migrated from format 1: it orders with those, by
        its original time (they all predate the first format-2 save of their directory).
        """
        if self.seq:
            return (1, float(self.seq), self.created, self.name)
        return (0, self.created, 0.0, self.name)


def _join(directory: str, leaf: str) -> str:
    return f"{directory}/{leaf}" if directory else leaf


T = TypeVar("T")


def reread(fn: Callable[[], T], attempts: int = 4) -> T:
    """``fn()``, started again when the object it reads was replaced meanwhile (S3: a ranged read
    of one version found another), so that a replacement is never reported as damage."""
    for attempt in range(attempts):
        try:
            return fn()
        except OSError as exc:
            if getattr(exc, "s3_code", None) != "PreconditionFailed" or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------- single files
def _read_sidecar(store: Store, name: str) -> Manifest:
    info = store.info(name)
    if info.size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"invalid manifest {store.describe(name)}: {info.size} bytes exceeds the limit")
    return parse_manifest(store.read_range(name, 0, info.size), store.describe(name))


def is_sidecar_of(store: Store, manifest: str, data_leaf: str) -> bool:
    """Whether ``manifest`` parses as a format-1 stagesave manifest that describes ``data_leaf``
    (only then may stagesave remove it: a user's file merely named like one is left alone)."""
    try:
        return data_leaf in {f.name for f in _read_sidecar(store, manifest).files}
    except (OSError, ManifestError):
        return False


def _sidecars(store: Store, name: str, listing: Iterable[ObjectInfo] | None = None) -> list[str]:
    """Format-1 manifests in ``name``'s directory that belong to a file called ``name``."""
    directory, _, base = name.rpartition("/")
    out = []
    for info in listing if listing is not None else store.list(directory):
        parsed = split_manifest_name(info.name.rpartition("/")[2])
        if parsed is not None and parsed[0] == base:
            out.append(info.name)
    return out


def resolve(store: Store, name: str) -> CheckpointInfo:
    """Status of the file ``name`` (its proof read and checked, its data not).

    Raises:
        FileNotFoundError: the file does not exist. IsADirectoryError: it is a folder.
    """
    return reread(lambda: _resolve(store, name))


def _resolve(store: Store, name: str) -> CheckpointInfo:
    target = store.canonical(name)
    with store.open(target) as reader:
        ci = resolve_reader(store, target, reader)
    if target != name:  # a link inside the root (Lightning's save_last="link"): judged its target
        ci.path, ci.name, ci.judged = store.describe(name), name, target
    return ci


def resolve_reader(store: Store, name: str, reader: Reader, sidecars: list[str] | None = None) -> CheckpointInfo:
    """:func:`resolve` through an open reader (the version that will be loaded or verified)."""
    path = store.describe(name)
    base = name.rpartition("/")[2]
    got = read_proof(reader, base)
    if got.format == 2:
        return _from_proof(store, name, path, reader, got)
    candidates = _sidecars(store, name) if sidecars is None else sidecars
    if candidates:
        return _format1(store, name, path, reader, candidates)
    directory = name.rpartition("/")[0]
    if base != DIR_MANIFEST:  # a file of a format-1 folder: its folder manifest proves it
        dir_manifest = f"{directory}/{DIR_MANIFEST}" if directory else DIR_MANIFEST
        try:
            store.info(dir_manifest)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            pass
        else:
            return _format1(store, name, path, reader, [dir_manifest])
    p = peek(reader)
    if p.problem:
        return CheckpointInfo(path, name, "corrupt", reader.mtime, reader.size, problems=[p.problem])
    return CheckpointInfo(path, name, "unverified", reader.mtime, reader.size)


def _from_proof(store: Store, name: str, path: str, reader: Reader, got: FileProof) -> CheckpointInfo:
    if got.manifest is None:
        return CheckpointInfo(path, name, "corrupt", reader.mtime, reader.size, problems=got.problems,
                              problems_from_manifest=True, format=2)
    m = got.manifest
    # A file of a folder proves itself: loading it alone needs no more (its folder may be being
    # replaced meanwhile, which never mixes this file's bytes with another's). What makes the
    # folder one checkpoint is checked where the folder is used as one (resolve_dir, verify).
    return CheckpointInfo(path, name, "committed", m.created_ns / 1e9, reader.size, m, None, seq=m.seq, format=2)


def _format1(store: Store, name: str, path: str, reader: Reader, candidates: list[str]) -> CheckpointInfo:
    problems: list[str] = []
    parsed: list[tuple[Manifest, str]] = []
    for mname in candidates:
        try:
            parsed.append((_read_sidecar(store, mname), mname))
        except (ManifestError, OSError) as exc:
            problems.append(str(exc))
    parsed.sort(key=lambda m: m[0].created_ns, reverse=True)
    base = name.rpartition("/")[2]
    for manifest, mname in parsed:
        try:
            entry = manifest.file(base)
        except KeyError:
            problems.append(f"{store.describe(mname)} does not describe {base}")
            continue
        if entry.size != reader.size:
            problems.append(f"{path} is {reader.size} bytes but its manifest says {entry.size} (truncated or replaced)")
            continue
        sid = entry.serialization_id
        if sid is not None and entry.id_offset is not None and reader.read(entry.id_offset, len(sid)) != sid.encode():
            problems.append(f"{path} does not carry the serialization id its manifest names")
            continue
        one = Manifest([entry], manifest.created_ns, manifest.tensors, manifest.metadata, manifest.telemetry, 1)
        return CheckpointInfo(path, name, "committed", manifest.created_ns / 1e9, reader.size, one, mname, format=1)
    if not problems:
        problems.append(f"no manifest matches {path}")
    return CheckpointInfo(path, name, "corrupt", reader.mtime, reader.size, problems=problems,
                          problems_from_manifest=True, format=1)


# ---------------------------------------------------------------------------- folders
#: How deep a folder checkpoint's files may nest (hooks write e.g. ``tokenizer/vocab.txt``).
MAX_FOLDER_DEPTH = 8


def list_tree(store: Store, directory: str, depth: int = 0) -> list[ObjectInfo]:
    """Every file under ``directory`` (sub-folders included, symbolic links never followed)."""
    out = list(store.list(directory))
    if depth < MAX_FOLDER_DEPTH:
        for leaf in store.list_dirs(directory):
            out += list_tree(store, _join(directory, leaf), depth + 1)
    return out


def resolve_dir(store: Store, directory: str, listing: list[ObjectInfo] | None = None) -> CheckpointInfo:
    """Status of a folder checkpoint (committed when its proof names exactly its files).

    ``listing``: every file under the folder (:func:`list_tree`), when the caller has it.
    """
    try:
        return _resolve_dir(store, directory, listing)
    except OSError as exc:
        if getattr(exc, "s3_code", None) != "PreconditionFailed":
            raise
        return reread(lambda: _resolve_dir(store, directory, None))  # replaced meanwhile: list again


def _resolve_dir(store: Store, directory: str, listing: list[ObjectInfo] | None) -> CheckpointInfo:
    path = store.describe(directory)
    prefix = len(directory) + 1 if directory else 0
    files = {f.name[prefix:]: f for f in (listing if listing is not None else list_tree(store, directory))}
    if DIR_MANIFEST in files:
        return _dir_format1(store, directory, path, files)
    carrier = _find_carrier(store, directory, files)
    if carrier is None:
        return CheckpointInfo(path, directory, "unverified", max((f.mtime for f in files.values()), default=0.0),
                              sum(f.size for f in files.values()), is_dir=True,
                              problems=["no stagesave proof in any of its files: completeness cannot be proven"])
    leaf, got = carrier
    total = sum(f.size for f in files.values())
    if got.manifest is None or got.manifest.folder is None:
        return CheckpointInfo(path, directory, "corrupt", 0.0, total, is_dir=True, problems=got.problems
                              or [f"{path}: {leaf} does not prove the folder"], problems_from_manifest=True, format=2)
    m = got.manifest
    folder = m.folder
    assert folder is not None
    problems = _folder_problems(store, directory, files, m)
    status = "corrupt" if problems else "committed"
    return CheckpointInfo(path, directory, status, m.created_ns / 1e9, total, m, None, problems, is_dir=True,
                          problems_from_manifest=True, seq=m.seq, format=2)


def _find_carrier(store: Store, directory: str, files: dict[str, ObjectInfo]) -> tuple[str, FileProof] | None:
    """The carrier of a format-2 folder: the file whose summary (or header) says it carries the
    folder. A member's claim about who the carrier is counts only if no file claims it itself."""
    named: list[str] = []
    safetensors: list[str] = []
    for leaf in sorted(files):
        try:
            with store.open(_join(directory, leaf)) as reader:
                p = peek(reader)
                if p.format == 2 and p.summary is not None and p.summary.folder is not None:
                    if p.summary.carrier == leaf:
                        return leaf, read_proof(reader, leaf)
                    if "/" not in leaf:  # deeper files may belong to a folder checkpoint inside this one
                        named.append(p.summary.carrier or "")
                elif p.format == 0 and leaf.endswith(".safetensors"):
                    safetensors.append(leaf)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue
        except OSError as exc:
            if getattr(exc, "s3_code", None) == "PreconditionFailed":
                raise  # replaced while read: the caller reads the folder again
            return leaf, FileProof(None, None, [f"{store.describe(_join(directory, leaf))}: {exc.strerror or exc}"], 2)
    for leaf in safetensors:  # no footer: the proof is in the header
        try:
            with store.open(_join(directory, leaf)) as reader:
                got = read_proof(reader, leaf)
        except OSError:
            continue
        if got.manifest is not None and got.manifest.folder is not None:
            if got.manifest.folder.carrier == leaf:
                return leaf, got
            if "/" not in leaf:
                named.append(got.manifest.folder.carrier)
    if named:
        carrier = max(set(named), key=named.count)
        problem = f"{store.describe(directory)}: its carrier {carrier} is missing or damaged"
        return carrier, FileProof(None, None, [problem], 2)
    return None


def _folder_problems(store: Store, directory: str, files: dict[str, ObjectInfo], m: Manifest) -> list[str]:
    folder = m.folder
    assert folder is not None
    path = store.describe(directory)
    problems = []
    inside = {n: [f for f in files if f.startswith(n + "/")] for n in folder.nested}
    own = {n: f for n, f in files.items() if not any(n.startswith(p + "/") for p in folder.nested)}
    expected = folder.names()
    for extra in sorted(set(own) - expected):
        problems.append(f"{path}/{extra} is not part of the checkpoint its proof describes")
    for missing in sorted(expected - set(own)):
        problems.append(f"{path}/{missing} is missing")
    for name, found in inside.items():
        if not found:
            problems.append(f"{path}/{name} (a folder checkpoint of its own) is missing")
    for member in folder.members:
        got = own.get(member.name)
        if got is None:
            continue
        if got.size != member.size:
            problems.append(f"{path}/{member.name} is {got.size} bytes, its folder's proof says {member.size}")
            continue
        try:
            with store.open(_join(directory, member.name)) as reader:  # the version: one small read
                s = peek(reader).summary
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            problems.append(f"{path}/{member.name} is missing")  # removed since the listing
            continue
        if s is not None and (s.folder != folder.token or s.proof_crc != member.proof_crc):
            problems.append(f"{path}/{member.name} belongs to another save than its folder")
    for entry in folder.listed:
        got = own.get(entry.name)
        if got is not None and got.size != entry.size:
            problems.append(f"{path}/{entry.name} is {got.size} bytes, its folder's proof says {entry.size}")
    return problems


def folder_entries(store: Store, info: CheckpointInfo) -> tuple[list[tuple[str, Manifest | None, FileEntry | None]], list[str]]:
    """Every file of a committed folder with what proves it: ``(name, own manifest, listed entry)``.

    Members are read (their proofs must carry the folder's token and the CRC the carrier pins).
    """
    m = info.manifest
    assert m is not None
    if m.folder is None:  # format 1: the folder manifest lists every file
        return [(e.name, Manifest([e], m.created_ns, schema=1), None) for e in m.files], []
    folder = m.folder
    out: list[tuple[str, Manifest | None, FileEntry | None]] = [(folder.carrier, m, None)]
    problems: list[str] = []
    for member in folder.members:
        name = _join(info.name, member.name)
        try:
            with store.open(name) as reader:
                got = read_proof(reader, member.name)
        except OSError as exc:
            problems.append(f"{store.describe(name)}: {exc.strerror or exc}")
            continue
        mm = got.manifest
        if mm is None:
            problems += got.problems or [f"{store.describe(name)} has no stagesave proof"]
            continue
        if mm.folder is None or mm.folder.token != folder.token:
            problems.append(f"{store.describe(name)} belongs to another save than its folder")
            continue
        if got.proof_crc != member.proof_crc:
            problems.append(f"{store.describe(name)} is not the version its folder's proof names")
            continue
        out.append((member.name, mm, None))
    out += [(e.name, None, e) for e in folder.listed]
    return out, problems


def _dir_format1(store: Store, directory: str, path: str, files: dict[str, ObjectInfo]) -> CheckpointInfo:
    mname = _join(directory, DIR_MANIFEST)
    try:
        manifest = _read_sidecar(store, mname)
    except FileNotFoundError:
        return CheckpointInfo(path, directory, "unverified", 0.0, 0, is_dir=True,
                              problems=["no stagesave manifest: completeness cannot be proven"])
    except (ManifestError, OSError) as exc:
        return CheckpointInfo(path, directory, "corrupt", 0.0, 0, is_dir=True, problems=[str(exc)], format=1)
    problems = []
    total = 0
    for entry in manifest.files:
        fname = _join(directory, entry.name)
        try:
            with store.open(fname) as reader:
                total += reader.size
                if reader.size != entry.size:
                    problems.append(f"{store.describe(fname)} is {reader.size} bytes, manifest says {entry.size}")
                elif (entry.serialization_id and entry.id_offset is not None
                      and reader.read(entry.id_offset, len(entry.serialization_id)) != entry.serialization_id.encode()):
                    problems.append(f"{store.describe(fname)} does not carry the id its manifest names")
        except (FileNotFoundError, IsADirectoryError):
            problems.append(f"{store.describe(fname)} is missing")
        except OSError as exc:
            problems.append(f"{store.describe(fname)}: {exc.strerror or exc}")
    status = "corrupt" if problems else "committed"
    return CheckpointInfo(path, directory, status, manifest.created_ns / 1e9, total, manifest, mname, problems,
                          is_dir=True, format=1, problems_from_manifest=True)


# ---------------------------------------------------------------------------- listing
@dataclass
class _Seen:
    signature: Any
    info: CheckpointInfo


_cache_lock = threading.Lock()
_cache: dict[tuple[str, str], dict[str, _Seen]] = {}


def _cache_key(store: Store, directory: str) -> tuple[str, str]:
    return (f"{type(store).__name__}:{store.url}", directory)


def _peek_file(store: Store, name: str, f: ObjectInfo, sidecars: list[str]) -> CheckpointInfo | None:
    try:
        return reread(lambda: _peek_file_once(store, name, f, sidecars))
    except OSError as exc:  # e.g. a symbolic link out of the root: listed, never followed
        path = store.describe(name)
        return CheckpointInfo(path, name, "corrupt", f.mtime, f.size, problems=[f"{path}: {exc.strerror or exc}"])


def _peek_file_once(store: Store, name: str, f: ObjectInfo, sidecars: list[str]) -> CheckpointInfo | None:
    path = store.describe(name)
    leaf = name.rpartition("/")[2]
    try:
        with store.open(name) as reader:
            p = peek(reader)
            if p.format == 2:
                s = p.summary
                if s is None:
                    return CheckpointInfo(path, name, "corrupt", reader.mtime, reader.size, problems=[p.problem or ""],
                                          problems_from_manifest=True, format=2)
                if s.folder is not None:
                    return None  # a loose file of a folder save: not a checkpoint by itself
                return CheckpointInfo(path, name, "committed", s.created_ns / 1e9, reader.size, seq=s.seq, format=2)
            if sidecars:
                return resolve_reader(store, name, reader, sidecars)
            if leaf.endswith(".safetensors"):
                got = read_proof(reader, leaf)
                if got.manifest is not None and got.manifest.folder is not None:
                    return None  # a loose file of a folder save: not a checkpoint by itself
                if got.format == 2:
                    return _from_proof(store, name, path, reader, got)
            if p.problem:
                return CheckpointInfo(path, name, "corrupt", reader.mtime, reader.size, problems=[p.problem])
            return CheckpointInfo(path, name, "unverified", reader.mtime, reader.size)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None  # removed while we listed


def _folder_signature(store: Store, sub: str, listing: list[ObjectInfo]) -> Any:
    return tuple(sorted((f.name, f.size, f.version or f.mtime) for f in listing))


def scan(
    store: Store, directory: str = "", *, warn: bool = False, full: bool = False, settle: bool = False,
) -> list[CheckpointInfo]:
    """Every checkpoint in ``directory`` of ``store`` (files and folders), newest first.

    Format-2 files are judged by their summaries (``full``: by their whole proof, with the
    manifest filled in); folders by their carrier's proof. A folder left aside by a dead mover
    whose final name is missing is listed where it lies (its ``name`` is the aside name).
    ``settle`` (readers; never under the commit lock, which it may wait for): when a live
    process is between the two renames of a replacement, wait for its commit lock and look again.
    """
    found, live_mover = _scan(store, directory, warn=warn, full=full, movers_done=False)
    if live_mover is not None and settle:
        with store.commit_lock(_join(directory, live_mover)):
            pass  # the mover held it across its two renames: they are done (or it died)
        found, _ = _scan(store, directory, warn=warn, full=full, movers_done=True)
    return found


def _scan(
    store: Store, directory: str, *, warn: bool, full: bool, movers_done: bool,
) -> tuple[list[CheckpointInfo], str | None]:
    """:func:`scan`, and the aside folder of a live mover whose final name is missing, if any
    (``movers_done``: the commit lock was free since, so such a folder is offered too)."""
    from ..saving.commit import pid_alive  # the commit protocol reads listings: imported when used

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
                continue  # not ours; or debris beside its checkpoint, back in place (gc removes it)
            if pid_alive(str(aside[1])) and not movers_done:
                live_mover = leaf  # between its two renames: the caller may wait for it
                continue
        elif leaf.startswith(".") or is_temporary(leaf):
            continue
        sub = _join(directory, leaf) if directory else leaf
        listing = list_tree(store, sub)
        sig = _folder_signature(store, sub, listing)
        old = seen.get(leaf + "/")
        if old is not None and old.signature == sig:
            ci = old.info
        else:
            ci = resolve_dir(store, sub, listing)
            if ci.status == "corrupt":
                # Listed just before another process replaced it and its proof read just after,
                # the folder's sizes disagree with a proof that is whole: list it again.
                listing = list_tree(store, sub)
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
        if ci.manifest is None and not ci.problems_from_manifest and ci.format == 0 and not leaf.endswith(CHECKPOINT_SUFFIXES):
            continue  # a plain file that is not named like a checkpoint (notes, logs, configs)
        out.append(ci)
    with _cache_lock:
        _cache[key] = fresh
    if warn:
        for ci in out:
            if ci.status == "corrupt":
                warnings.warn(f"skipping checkpoint {ci.path}: {'; '.join(ci.problems)}", stacklevel=3)
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


# ---------------------------------------------------------------------------- verification
def verify_entry(store: Store, name: str, entry: FileEntry, pool: cf.Executor | None = None) -> list[str]:
    """Recompute every chunk digest of ``name`` against ``entry``; the problems (empty: intact)."""
    try:
        reader = store.open(name)
    except OSError as exc:
        return [f"{store.describe(name)}: {exc.strerror or exc}"]
    with reader:
        if reader.size != entry.size:
            return [f"{reader.where} is {reader.size} bytes, its proof says {entry.size}"]
        return chunk_problems(reader, Manifest([entry], 0), pool)


def raise_if_corrupt(problems: list[str], path: str) -> None:
    if problems:
        raise IntegrityError(
            f"checkpoint {path} is corrupt: {problems[0]}"
            + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")
            + ". It was not loaded; use the previous checkpoint (stagesave.latest skips corrupt ones)."
        )



# ---------------------------------------------------------------------------- files without a proof
#: What ``torch.save(..., _use_new_zipfile_serialization=False)`` pickles first: its magic number.
_LEGACY_TORCH_MAGIC = b"\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
#: safetensors refuses headers over 100 MB; so do we.
_MAX_SAFETENSORS_HEADER = 100_000_000


class _ReaderFile(io.RawIOBase):
    """A seekable, read-only file object over a :class:`Reader` (for :mod:`zipfile`)."""

    def __init__(self, reader: Reader) -> None:
        self._reader, self._pos = reader, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._reader.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self._reader.readinto(self._pos, view[: max(0, min(len(view), self._reader.size - self._pos))])
        self._pos += n
        return n


def plain_problem(reader: Reader, *, full: bool) -> str | None:
    """Why a file without a stagesave proof cannot be offered for a resume (``None``: it can).

    It can when it would load as what it is: a torch zip archive whose central directory reads
    and names a ``data.pkl`` record, a legacy (pre-zip) torch file, or a safetensors file whose
    header parses and whose tensors lie inside the file. ``full`` also reads every record of a
    zip and checks its CRC-32 (``torch.save`` writes them): the only proof such a file carries.
    """
    where = reader.where
    head = reader.read(0, 16)
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(_ReaderFile(reader)) as zf:
                names = zf.namelist()
                if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
                    return f"{where} is a zip archive without a data.pkl record: not a torch checkpoint"
                if full:
                    bad = zf.testzip()
                    if bad is not None:
                        return f"{where}: its record {bad} does not match its CRC-32 (damaged)"
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, OSError, RuntimeError) as exc:
            return f"{where} is not a readable torch checkpoint (no stagesave proof): {exc}"
        return None
    if _LEGACY_TORCH_MAGIC in head:
        return None
    if reader.size >= 8:
        (n,) = struct.unpack("<Q", reader.read(0, 8))
        if 2 <= n <= min(_MAX_SAFETENSORS_HEADER, reader.size - 8) and reader.read(8, 1) == b"{":
            return _safetensors_problem(reader, n)
    return f"{where} is neither a torch file nor a safetensors file, and has no stagesave proof"


def _safetensors_problem(reader: Reader, n: int) -> str | None:
    where = reader.where
    try:
        header = json.loads(reader.read(8, n))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"{where}: its safetensors header is not valid JSON ({exc})"
    if not isinstance(header, dict):
        return f"{where}: its safetensors header is not an object"
    data = reader.size - 8 - n
    for key, value in header.items():
        if key == "__metadata__":
            continue
        offsets = value.get("data_offsets") if isinstance(value, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data):
            return f"{where}: tensor {key!r} of its safetensors header lies outside the file"
    return None


# ---------------------------------------------------------------------------- verifications remembered
#: How long a verification is reused by the load that follows it.
VERIFIED_TTL_S = 600.0
_VERIFIED_MAX = 256
_verified_lock = threading.Lock()
_verified: OrderedDict[str, tuple[tuple[int, ...], FileEntry, float]] = OrderedDict()


def _identity(reader: Reader) -> tuple[int, ...] | None:
    fd = reader.fileno()
    if fd is None:
        return None  # not a local file: nothing stable to recognise it by
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def remember_verified(reader: Reader, entry: FileEntry) -> None:
    """Note that every chunk of ``reader``'s file matched ``entry`` (local files only)."""
    ident = _identity(reader)
    if ident is None:
        return
    with _verified_lock:
        _verified[reader.where] = (ident, entry, time.monotonic())
        _verified.move_to_end(reader.where)
        while len(_verified) > _VERIFIED_MAX:
            _verified.popitem(last=False)


def verified_before(reader: Reader, entry: FileEntry) -> bool:
    """Whether this very file (same inode, size, mtime and ctime) was verified against ``entry``
    by this process in the last :data:`VERIFIED_TTL_S` seconds."""
    ident = _identity(reader)
    if ident is None:
        return False
    with _verified_lock:
        got = _verified.get(reader.where)
    return (got is not None and got[0] == ident and got[1] == entry
            and time.monotonic() - got[2] < VERIFIED_TTL_S)


def forget_verified() -> None:
    """Forget every remembered verification (tests, benchmarks)."""
    with _verified_lock:
        _verified.clear()
