"""``StagedStorageReader``: DCP loads that prove every byte before DCP sees it.

The folder's proof must say the save committed: ``.metadata`` carries it (format 2: a trailer
naming every rank file by size and the CRC of its proof; ``resolve_dir``/``folder_entries`` find
and check it), or ``checkpoint.stagesave.json`` does (format 1, still read). ``.metadata`` is
checked against its chunk digests and unpickled with an allow-list (``_metadata``); then each
rank file is opened once (one version of it, whose proof must be the one the folder pins) and
read in windows of whole checksum chunks, in parallel, every chunk checked before any item in it
is handed to DCP's planner. Resharding (a checkpoint written by N ranks loaded on M) is DCP's
planner's work: this reader only serves the byte ranges it asks for. The I/O threads only read
and hash; unpickling and tensor copies stay on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
import uuid
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CheckpointNotFoundError, IntegrityError, ManifestError
from ..ondisk.checksum import digest
from ..ondisk.manifest import FileEntry
from ..ondisk.names import DEFAULT_CHUNK_BYTES
from ..restore.discovery import CheckpointInfo, folder_entries, raise_if_corrupt, resolve_dir
from ..restore.proof import peek
from ..safety import safe_torch_load
from ..stores.base import Reader, Store, check_name
from ..stores.targets import StoreResolver
from ._format import METADATA_FILE
from ._metadata import load_metadata

__all__ = ["StagedStorageReader"]

#: Bytes read (and verified) at once; a window holds whole chunks, at least one item.
DEFAULT_WINDOW_BYTES = 256 * 1024 * 1024
#: Unverified reads merge items separated by at most this many bytes (alignment padding).
_MERGE_GAP = 64 * 1024
#: Times the folder is resolved again when its files changed while it was being opened.
_OPEN_ATTEMPTS = 3
#: Folders of at most this many rank files have every file opened (pinned) when the folder is
#: opened, so that a save replacing the folder before DCP reads it cannot take the bytes away;
#: larger ones open each file when it is read (a descriptor per file would be too many).
PIN_AT_OPEN_MAX = 256


@dataclass(frozen=True)
class _Pin:
    """What a format-2 file's summary must say: the save's token and (members) its proof's CRC."""

    token: str
    proof_crc: int | None


@dataclass
class _Opened:
    store: Store
    name: str
    where: str
    info: CheckpointInfo | None
    #: What proves each file (its chunk digests of the bytes before its proof); empty unverified.
    entries: dict[str, FileEntry]
    metadata: Metadata
    #: Format 2: the version of each file the folder's proof names.
    pins: dict[str, _Pin] = field(default_factory=dict)
    #: Data files opened with the folder (their pinned version), until they are read.
    readers: dict[str, Reader] = field(default_factory=dict)

    def __post_init__(self) -> None:
        weakref.finalize(self, _close_all, self.readers)

    def close(self) -> None:
        _close_all(self.readers)


def _close_all(readers: dict[str, Reader]) -> None:
    while readers:
        readers.popitem()[1].close()


class _Replaced(Exception):
    """A file is not the version the folder's proof names (the folder was replaced meanwhile)."""


@dataclass
class _Window:
    lo: int
    hi: int
    items: list[tuple[_StorageInfo, ReadItem]]


class StagedStorageReader(StorageReader):
    """A DCP storage reader for stagesave folders (and, with ``verify=False``, any DCP folder).

    Use it with ``torch.distributed.checkpoint.load`` on every rank::

        dcp.load(state_dict, checkpoint_id="/ckpt/step-100", storage_reader=StagedStorageReader())

    Args:
        path: The checkpoint folder; ``checkpoint_id=`` of ``dcp.load`` replaces it.
        verify: Refuse folders without a committed stagesave proof (format 2, or a format-1
            manifest) and check every chunk read against it (default). ``False`` reads any DCP folder as it is (e.g. one written by
            ``FileSystemWriter``), still with the safe unpickler unless ``trusted``.
        trusted: Unpickle ``.metadata`` and non-tensor items with the full unpickler.
        safe_globals: Extra classes allowed in non-tensor items (see :mod:`stagesave.safety`).
        storage_options: fsspec options for URLs (endpoint, credentials).
        io_threads: Threads reading and hashing chunks in parallel.
        window_bytes: Bytes read and verified at once per file (bounds the reader's memory).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        verify: bool = True,
        trusted: bool = False,
        safe_globals: Iterable[Any] = (),
        storage_options: dict[str, Any] | None = None,
        io_threads: int = 4,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        store: Store | None = None,
    ) -> None:
        super().__init__()
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.path = path
        self.verify = verify
        self.trusted = trusted
        self.safe_globals = list(safe_globals)
        self.io_threads = io_threads
        self.window_bytes = window_bytes
        self._targets = StoreResolver(store, storage_options=storage_options)
        self._opened: _Opened | None = None
        self.storage_data: dict[Any, Any] = {}

    # ------------------------------------------------------------------ opening
    def open(self) -> Metadata:
        """Resolve the folder, check its proof and read ``.metadata`` (done once per path).

        ``dcp.load`` calls this through :meth:`reset`, before any collective, so every rank
        raises the same stagesave error instead of DCP's wrapped one.

        Raises:
            CheckpointNotFoundError: no folder or no ``.metadata`` there.
            IntegrityError: not committed by stagesave (with ``verify``), or corrupt.
            UnsafeCheckpointError: ``.metadata`` needs a class off the allow-list.
        """
        if self._opened is None:
            self._opened = self._open()
        return self._opened.metadata

    def _open(self) -> _Opened:
        if self.path is None:
            raise ValueError("no checkpoint folder: pass checkpoint_id= to dcp.load or path= to the reader")
        store, name = self._targets.split(self.path)
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                return self._open_once(store, name)
            except _Replaced as exc:
                if attempt == _OPEN_ATTEMPTS - 1:
                    raise IntegrityError(
                        f"checkpoint {store.describe(name)} kept changing while it was being opened ({exc}); "
                        "another process is replacing it: load it again once that save committed"
                    ) from exc
        raise AssertionError("unreachable")

    def _open_once(self, store: Store, name: str) -> _Opened:
        where = store.describe(name)
        info: CheckpointInfo | None = None
        entries: dict[str, FileEntry] = {}
        pins: dict[str, _Pin] = {}
        if self.verify:
            info = resolve_dir(store, name)
            if info.status == "unverified":
                if not store.list(name) and not store.list_dirs(name):
                    raise CheckpointNotFoundError(f"no checkpoint at {where}")
                raise IntegrityError(
                    f"checkpoint {where} has no stagesave proof, so it cannot be proven complete "
                    "(a save that never committed, or a folder written by another DCP writer). "
                    "Use stagesave.latest() to find the newest committed one, or pass verify=False "
                    "to read it as a plain DCP folder."
                )
            if info.status != "committed" or info.manifest is None:
                raise _Replaced if self._changed(store, name, info) else IntegrityError(
                    f"checkpoint {where} is corrupt: {'; '.join(info.problems)}")
            entries, pins = self._proven_files(store, name, info)
            if METADATA_FILE not in entries:
                raise ManifestError(f"checkpoint {where} is not a DCP checkpoint: its proof names no {METADATA_FILE}")
        mname = f"{name}/{METADATA_FILE}"
        try:
            reader = store.open(mname)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise CheckpointNotFoundError(f"no DCP checkpoint at {where}: {METADATA_FILE} is missing") from exc
        with reader:
            self._check_pin(reader, pins.get(METADATA_FILE))
            entry = entries.get(METADATA_FILE)
            data = self._read_verified(reader, 0, entry.end if entry is not None else reader.size, entry, None)
        metadata = load_metadata(bytes(data), reader.where, trusted=self.trusted)
        self._check_storage_data(metadata, entries, where)
        opened = _Opened(store, name, where, info, entries, metadata, pins)
        members = [f for f in pins if f != METADATA_FILE]
        if len(members) <= PIN_AT_OPEN_MAX:
            try:
                for fname in members:
                    opened.readers[fname] = self._open_file(opened, fname, replaced=_Replaced)
            except BaseException:
                opened.close()
                raise
        return opened

    @staticmethod
    def _changed(store: Store, name: str, info: CheckpointInfo) -> bool:
        """Whether a folder found corrupt is now another save (replaced while it was resolved)."""
        again = resolve_dir(store, name)
        token = info.manifest.folder.token if info.manifest is not None and info.manifest.folder else None
        new = again.manifest.folder.token if again.manifest is not None and again.manifest.folder else None
        return again.status == "committed" or (new is not None and new != token)

    @staticmethod
    def _proven_files(store: Store, name: str, info: CheckpointInfo) -> tuple[dict[str, FileEntry], dict[str, _Pin]]:
        """Every file of a committed folder with the entry that proves it (and, format 2, the
        version its summary must show)."""
        manifest = info.manifest
        assert manifest is not None
        folder = manifest.folder
        if folder is None:  # format 1: checkpoint.stagesave.json lists every file with its digests
            return {e.name: e for e in manifest.files}, {}
        found, problems = folder_entries(store, info)
        if problems:
            raise _Replaced(problems[0]) if resolve_dir(store, name).manifest != manifest else IntegrityError(
                f"checkpoint {store.describe(name)} is corrupt: {'; '.join(problems)}")
        entries: dict[str, FileEntry] = {}
        for fname, own, listed in found:
            if own is not None:
                entries[fname] = own.files[0]
            elif listed is not None:
                entries[fname] = listed
        pins = {m.name: _Pin(folder.token, m.proof_crc) for m in folder.members}
        pins[folder.carrier] = _Pin(folder.token, None)
        return entries, pins

    @staticmethod
    def _check_pin(reader: Reader, pin: _Pin | None) -> None:
        """Raise ``_Replaced`` unless ``reader``'s file is the version the folder's proof names."""
        if pin is None:
            return
        summary = peek(reader).summary
        if summary is None or summary.folder != pin.token or (
                pin.proof_crc is not None and summary.proof_crc != pin.proof_crc):
            raise _Replaced(f"{reader.where} is not the version its folder's proof names")

    def _check_storage_data(self, metadata: Metadata, entries: dict[str, FileEntry], where: str) -> None:
        """Untrusted offsets: every item must lie inside a file this checkpoint committed."""
        for index, sinfo in metadata.storage_data.items():
            if not isinstance(sinfo, _StorageInfo):
                raise ManifestError(f"checkpoint {where}: storage data of {index.fqn} is a {type(sinfo).__name__}")
            try:
                check_name(sinfo.relative_path)
            except (ValueError, TypeError) as exc:
                raise ManifestError(f"checkpoint {where}: {index.fqn} points outside the folder "
                                    f"({sinfo.relative_path!r})") from exc
            if not isinstance(sinfo.offset, int) or not isinstance(sinfo.length, int) \
                    or sinfo.offset < 0 or sinfo.length < 0:
                raise ManifestError(f"checkpoint {where}: {index.fqn} has an invalid byte range")
            if self.verify:
                entry = entries.get(sinfo.relative_path)
                if entry is None or sinfo.relative_path == METADATA_FILE:
                    raise IntegrityError(f"checkpoint {where} is corrupt: {index.fqn} is stored in "
                                         f"{sinfo.relative_path}, which its proof does not list as a data file")
                if sinfo.offset + sinfo.length > entry.end:
                    raise IntegrityError(f"checkpoint {where} is corrupt: {index.fqn} lies outside the proven "
                                         f"bytes of {sinfo.relative_path} ({sinfo.offset}+{sinfo.length} > {entry.end})")

    # ------------------------------------------------------------------ StorageReader
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
            if self._opened is not None:
                self._opened.close()
            self._opened = None
            self.open()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        metadata = self.open()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = str(uuid.uuid4())
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @property
    def checkpoint_id(self) -> str | os.PathLike[str] | None:
        return self.path

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        opened = self._opened if self._opened is not None else self._open()
        per_file: dict[str, list[tuple[_StorageInfo, ReadItem]]] = {}
        for req in plan.items:
            sinfo = cast(_StorageInfo, self.storage_data[req.storage_index])
            if sinfo.transform_descriptors:
                raise ManifestError(f"checkpoint {opened.where}: {req.storage_index.fqn} was written with "
                                    f"stream transforms {list(sinfo.transform_descriptors)}, which this reader "
                                    "does not apply; read it with torch's FileSystemReader")
            per_file.setdefault(sinfo.relative_path, []).append((sinfo, req))
        with cf.ThreadPoolExecutor(self.io_threads, thread_name_prefix="stagesave-dcp-read") as pool:
            for rel, items in sorted(per_file.items()):
                entry = opened.entries.get(rel)
                items.sort(key=lambda pair: pair[0].offset)
                reader = opened.readers.pop(rel, None) or self._open_file(opened, rel)
                with reader:
                    for window in self._windows(items, entry):
                        data = self._read_verified(reader, window.lo, window.hi - window.lo, entry, pool)
                        for sinfo, req in window.items:
                            start = sinfo.offset - window.lo
                            self._deliver(req, data[start : start + sinfo.length], planner, f"{opened.where}/{rel}")
        opened.close()  # files this rank did not need
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _open_file(self, opened: _Opened, rel: str, replaced: type[Exception] | None = None) -> Reader:
        """One version of a data file: the one the folder's proof names (format 2).

        Raises:
            IntegrityError: it is missing, or was replaced since the folder was opened.
            replaced: instead, when it was replaced (while the folder is being opened: try again).
        """
        name = f"{opened.name}/{rel}"
        try:
            reader = opened.store.open(name)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            if replaced is not None:
                raise replaced(f"{opened.where}/{rel} is missing") from exc
            raise IntegrityError(f"checkpoint {opened.where} is corrupt: {rel} is missing") from exc
        try:
            self._check_pin(reader, opened.pins.get(rel))
        except _Replaced as exc:
            reader.close()
            if replaced is not None:
                raise
            raise IntegrityError(
                f"checkpoint {opened.where} was replaced while it was being loaded ({exc}); "
                "load it again"
            ) from exc
        return reader

    # ------------------------------------------------------------------ reading
    def _windows(self, items: list[tuple[_StorageInfo, ReadItem]], entry: FileEntry | None) -> Iterator[_Window]:
        """Group sorted items into reads of whole chunks (all chunks, when verifying)."""
        step = entry.chunk_bytes if entry is not None else 1
        gap = 0 if entry is not None else _MERGE_GAP
        current: _Window | None = None
        for sinfo, req in items:
            end = sinfo.offset + sinfo.length
            lo = sinfo.offset // step * step
            hi = -(-end // step) * step
            if entry is not None:
                hi = min(hi, entry.end)
            if current is not None and lo <= current.hi + gap and max(hi, current.hi) - current.lo <= self.window_bytes:
                current.hi = max(current.hi, hi)
                current.items.append((sinfo, req))
                continue
            if current is not None:
                yield current
            current = _Window(lo, hi, [(sinfo, req)])
        if current is not None:
            yield current

    def _read_verified(
        self, reader: Reader, lo: int, length: int, entry: FileEntry | None, pool: cf.Executor | None
    ) -> memoryview:
        """Bytes ``[lo, lo + length)`` of ``reader``'s file; with ``entry``, every chunk checked first.

        Raises:
            IntegrityError: a chunk's digest differs, or the file is shorter than it should be.
        """
        out = memoryview(bytearray(length))
        step = entry.chunk_bytes if entry is not None else DEFAULT_CHUNK_BYTES
        path = reader.where

        def one(off: int) -> str | None:
            n = min(step, length - off)
            got = reader.readinto(lo + off, out[off : off + n])
            if got != n:
                return f"{path}: truncated at byte {lo + off + got}"
            if entry is not None:
                i = (lo + off) // entry.chunk_bytes
                if digest(entry.algorithm, out[off : off + n]) != entry.chunks[i]:
                    a, b = entry.chunk_range(i)
                    return f"{path}: checksum mismatch in bytes [{a}, {b}) (chunk {i})"
            return None

        offsets = range(0, length, step)
        results = pool.map(one, offsets) if pool is not None and len(offsets) > 1 else map(one, offsets)
        raise_if_corrupt([p for p in results if p], path.rpartition("/")[0])
        return out

    def _deliver(self, req: ReadItem, blob: memoryview, planner: LoadPlanner, where: str) -> None:
        """Hand one verified item to DCP's planner (on the caller's thread)."""
        if req.type == LoadItemType.BYTE_IO:
            raw = bytes(blob)
            if not self.trusted:
                # DCP's planner unpickles with the full unpickler; the same bytes must first pass
                # the allow-listed one, so nothing off the list is ever constructed.
                safe_torch_load(io.BytesIO(raw), safe_globals=self.safe_globals,
                                where=f"{where} (item {req.storage_index.fqn})")
            planner.load_bytes(req, io.BytesIO(raw))
            return
        tensor = cast(torch.Tensor, torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True))
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise IntegrityError(f"{where}: item {req.storage_index.fqn} has shape {tuple(tensor.size())} "
                                 f"where the plan expects {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)
