"""``StagedStorageReader``: DCP loads that prove every byte before DCP sees it.

The folder's proof must say the save committed (format 2: ``.metadata``'s trailer names every
rank file; format 1: ``checkpoint.stagesave.json``); ``.metadata`` is checked and unpickled with
an allow-list, each rank file opened once, in the version the folder's proof pins
(:mod:`._read_folder`). Each file is then read in windows of whole checksum chunks, in parallel,
every chunk checked before any item in it is handed to DCP's planner (:mod:`._read_items`).
Resharding (a checkpoint written by N ranks loaded on M) is DCP's planner's work: this reader
only serves the byte ranges it asks for. The I/O threads only read and hash; unpickling and
tensor copies stay on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import uuid
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import ManifestError
from ..stores.base import Store
from ..stores.targets import StoreResolver
from ._metadata import StorageInfo
from ._rankfile import SkeletonCache
from ._read_folder import OpenedFolder, open_file, open_folder
from ._read_items import (
    DEFAULT_WINDOW_BYTES,
    Item,
    chunk_of,
    deliver,
    read_ahead,
    stored_tensor,
    windows,
)

__all__ = ["StagedStorageReader"]

#: Skeletons of the tensor zips items are compared with (shared by every reader of the process).
_SKELETONS = SkeletonCache(max_entries=4096)


class StagedStorageReader(StorageReader):
    """A DCP storage reader for stagesave folders (and, with ``verify=False``, any DCP folder).

    Use it with ``torch.distributed.checkpoint.load`` on every rank::

        dcp.load(state_dict, checkpoint_id="/ckpt/step-100", storage_reader=StagedStorageReader())

    Args:
        path: The checkpoint folder; ``checkpoint_id=`` of ``dcp.load`` replaces it.
        verify: Refuse folders without a committed stagesave proof (format 2, or a format-1
            manifest) and check every chunk read against it (default). ``False`` reads any DCP
            folder as it is (e.g. one written by ``FileSystemWriter``), still with the safe
            unpickler unless ``trusted``.
        trusted: Unpickle ``.metadata`` and non-tensor items with the full unpickler.
        safe_globals: Extra classes allowed in non-tensor items (see :mod:`stagesave.safety`).
        storage_options: fsspec options for URLs (endpoint, credentials).
        io_threads: Threads reading and hashing chunks in parallel.
        window_bytes: Bytes read and verified at once per file; two windows (or the largest
            item, when larger) bound the reader's memory.
        listed: Without ``verify``: the files the folder's proof lists (its proof read by the
            caller); an item stored in any other file is refused (files beside a checkpoint
            are the user's, never read as part of it).
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
        listed: frozenset[str] | None = None,
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
        self.listed = listed
        self._targets = StoreResolver(store, storage_options=storage_options)
        self._opened: OpenedFolder | None = None
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

    def _open(self) -> OpenedFolder:
        if self.path is None:
            raise ValueError("no checkpoint folder: pass checkpoint_id= to dcp.load or path= to "
                             "the reader")
        store, name = self._targets.split(self.path)
        return open_folder(store, name, verify=self.verify, trusted=self.trusted,
                           listed=self.listed)

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

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any,
    ) -> None:
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
        per_file: dict[str, list[Item]] = {}
        for req in plan.items:
            sinfo = cast(StorageInfo, self.storage_data[req.storage_index])
            if sinfo.transform_descriptors:
                raise ManifestError(
                    f"checkpoint {opened.where}: {req.storage_index.fqn} was written with stream "
                    f"transforms {list(sinfo.transform_descriptors)}, which this reader does not "
                    "apply; read it with torch's FileSystemReader")
            per_file.setdefault(sinfo.relative_path, []).append((sinfo, req))
        threads = cf.ThreadPoolExecutor(self.io_threads, thread_name_prefix="stagesave-dcp-read")
        with threads as pool:
            for rel, items in sorted(per_file.items()):
                entry = opened.entries.get(rel)
                items.sort(key=lambda pair: pair[0].offset)
                reader = opened.readers.pop(rel, None) or open_file(opened, rel)
                where = f"{opened.where}/{rel}"
                with reader:
                    wins = list(windows(items, entry, self.window_bytes))
                    for window, data in read_ahead(reader, wins, entry, pool):
                        as_tensor = torch.frombuffer(data, dtype=torch.uint8) if len(data) else None
                        for sinfo, req in window.items:
                            start = sinfo.offset - window.lo
                            blob = data[start : start + sinfo.length]
                            tensor = None
                            if as_tensor is not None and req.type != LoadItemType.BYTE_IO:
                                tensor = stored_tensor(as_tensor, start, blob,
                                                       chunk_of(opened.metadata, req), _SKELETONS)
                            deliver(req, blob, planner, where, trusted=self.trusted,
                                    safe_globals=self.safe_globals, tensor=tensor)
        opened.close()  # files this rank did not need
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
