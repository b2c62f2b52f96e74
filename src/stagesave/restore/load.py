"""Loading: one version of a checkpoint opened once, verified, then unpickled safely.

The proof and the bytes come from one open file (or one pinned object version), so a name
replaced while it is read never mixes two saves. Local files are verified through the open
descriptor and loaded from the very inode that was checked (``/proc/self/fd``), with ``mmap``
for zip files; other stores are read in parallel into memory, each chunk verified as it lands,
and loaded from it (a format-2 torch file's tensors keep that memory: no second copy).
"""

from __future__ import annotations

import io as _bytesio
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import IntegrityError, StorageError
from ..ondisk.manifest import Manifest
from ..safety import safe_first_try, safe_torch_load
from ..saving import inflight
from ..saving.plan import gc_paused
from ..stores.base import Reader, Store
from . import device_load, from_memory, image_load, safetensors_load
from .index_check import IndexCheck
from .resolve_file import resolve_reader
from .torch_load import torch_forces_weights_only
from .verified_memo import verified_before
from .verify import IoThreads, check_chunks, open_reader, raise_if_corrupt, replaced

__all__ = ["load_checkpoint"]


def load_checkpoint(
    store: Store, name: str, io: IoThreads, *, chunk_bytes: int, map_location: Any, verify: bool,
    mmap: bool | None, trusted: bool, safe_globals: Sequence[Any],
) -> Any:
    """Load the checkpoint ``name`` of ``store`` (see :meth:`stagesave.Checkpointer.load`).

    Waits for pending saves of the same path in this process first.

    Raises:
        CheckpointNotFoundError: no such file.
        IntegrityError: the file does not match its proof.
        UnsafeCheckpointError: the file needs a class that is not allow-listed.
    """
    where = store.describe(name)
    inflight.wait_path(where)
    globs = list(safe_globals)
    for attempt in range(3):
        try:
            # a load makes a few objects per tensor (proof records, storages, tensors): with the
            # collector running, its full passes over them took a third of a 100,000-tensor load
            with gc_paused():
                return _load_once(store, name, where, io, chunk_bytes, map_location, verify,
                                  mmap, trusted, globs)
        except StorageError as exc:  # replaced while being read (S3): read the new version
            if not replaced(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _load_once(
    store: Store, name: str, where: str, io: IoThreads, chunk_bytes: int, map_location: Any,
    verify: bool, mmap: bool | None, trusted: bool, globs: list[Any],
) -> Any:
    reader = open_reader(store, name, where)
    judged = reader.name
    with reader:
        info = resolve_reader(store, judged, reader, index=False)  # parsed beside the load
        # (a file without a proof judged by its structure as a torch file: a safetensors file
        # is judged by the safetensors parser instead; a tiny one holds no tensors)
        plain_st = info.format == 0 and safetensors_load.is_safetensors(reader, None)
        if info.status == "corrupt" and not plain_st:
            raise IntegrityError(f"checkpoint {where} is corrupt: {'; '.join(info.problems)}")
        if plain_st or (info.manifest is not None
                        and safetensors_load.is_safetensors(reader, info.manifest)):
            return _load_safetensors(reader, info.manifest, where, io, chunk_bytes, verify,
                                     map_location)
        check = IndexCheck(info.manifest, where)
        state = _load_checked(store, judged, reader, info.manifest, where, io, chunk_bytes,
                              map_location, verify, mmap, trusted, globs, check)
        check.raise_if_invalid()  # (parsed while the chunks were read, where they were)
        return state


def _load_checked(
    store: Store, judged: str, reader: Reader, manifest: Manifest | None, where: str,
    io: IoThreads, chunk_bytes: int, map_location: Any, verify: bool, mmap: bool | None,
    trusted: bool, globs: list[Any], check: IndexCheck,
) -> Any:
    """The load of the file ``reader`` holds open, its proof read (``manifest``: ``None`` for a
    file without one); ``check`` runs while chunks are read into an image."""
    if (manifest is not None and mmap is None and not trusted
            and not torch_forces_weights_only()):
        # a writer agent's snapshot of this very file, still in memory: no read at all
        image = from_memory.snapshot_image(reader, manifest, io())
        if image is not None:
            return safe_torch_load(image, map_location=map_location, trusted=False,
                                   safe_globals=globs, where=where)
    fd = reader.fileno()
    if fd is not None:
        # Verified by this process a moment ago (latest()), the very inode unchanged: the
        # load does not read and hash it again.
        if (manifest is not None and mmap is None and not trusted
                and image_load.applies(manifest.files[0]) and not torch_forces_weights_only()):
            entry = manifest.files[0]
            if not (verify and verified_before(reader, entry)):
                # read once, into the memory the tensors keep, each chunk checked as it lands
                # and the pickle unpickled meanwhile
                early = _Early(map_location, globs, where)
                image, problems = _read(reader, fd, manifest, io, where, verify, map_location,
                                        check.parse, early)
                raise_if_corrupt(problems, where)
                return early.result(image)
            if len(entry.storages) >= image_load.MANY_STORAGES:
                # verified a moment ago (so in the page cache): copied from there, unchecked;
                # torch.load would spend ~50 us per storage on its own
                image, problems = image_load.read_image(reader, None, manifest, io(), where,
                                                        check=False)
                raise_if_corrupt(problems, where)
                return safe_torch_load(image, map_location=map_location, trusted=False,
                                       safe_globals=globs, where=where)
        if verify and manifest is not None and not verified_before(reader, manifest.files[0]):
            raise_if_corrupt(check_chunks(reader, manifest, io), where)
        elif not verify:
            _prefetch(reader, io, chunk_bytes)
        use_mmap = reader.read(0, 4) == b"PK\x03\x04" if mmap is None else mmap
        # Load the very inode we verified, even if the name was replaced meanwhile.
        proc = f"/proc/self/fd/{fd}"
        local = store.local_path(judged)
        source = proc if os.path.exists(proc) else local
        return safe_torch_load(source, map_location=map_location, mmap=use_mmap,
                               trusted=trusted, safe_globals=globs, where=where)
    if (manifest is not None and mmap is None and not trusted
            and image_load.applies(manifest.files[0]) and not torch_forces_weights_only()):
        # one pass: each chunk fetched (concurrent ranged GETs on S3) into the memory the
        # tensors keep and hashed as it lands; no second copy into torch.load's storages
        early = _Early(map_location, globs, where)
        image, problems = _read(reader, None, manifest, io, where, verify, map_location,
                                check.parse, early)
        raise_if_corrupt(problems, where)
        return early.result(image)
    data = bytearray(reader.size)
    view = memoryview(data)
    _read_parallel(reader, view, io, chunk_bytes)
    if verify and manifest is not None:
        raise_if_corrupt(check_chunks(reader, manifest, io, view), where)
    return safe_torch_load(_bytesio.BytesIO(data), map_location=map_location, trusted=trusted,
                           safe_globals=globs, where=where)


def _load_safetensors(reader: Reader, manifest: Manifest | None, where: str, io: IoThreads,
                      chunk_bytes: int, verify: bool, map_location: Any) -> Any:
    """A safetensors file read into one buffer its tensors view, checked against its proof
    (if it has one) before any tensor is made (:mod:`.safetensors_load`)."""
    view = memoryview(bytearray(reader.size))
    _read_parallel(reader, view, io, chunk_bytes)
    if verify and manifest is not None:
        raise_if_corrupt(check_chunks(reader, manifest, io, view), where)
    return safetensors_load.tensors(view, where, map_location)


class _Early:
    """A load's state unpickled while the image's storages were still being read (the chunks
    that hold the pickle read and checked first), by the C unpickler alone
    (:func:`~stagesave.safety.safe_first_try`); where that stops, the whole load runs once
    every byte is in, as before."""

    def __init__(self, map_location: Any, globs: list[Any], where: str) -> None:
        self.map_location, self.globs, self.where = map_location, globs, where
        self.made: list[Any] = []  # the state, once made

    def __call__(self, image: image_load.Image) -> None:
        try:
            self.made.append(safe_first_try(image, map_location=self.map_location,
                                            safe_globals=self.globs, where=self.where))
        except Exception:  # noqa: BLE001, S110 - the whole load after the reads judges the file
            pass

    def result(self, image: image_load.Image) -> Any:
        """The state (every byte of ``image`` read and checked by now)."""
        if self.made:
            return self.made.pop()
        return safe_torch_load(image, map_location=self.map_location, trusted=False,
                               safe_globals=self.globs, where=self.where)


def _read(reader: Reader, fd: int | None, manifest: Manifest, io: IoThreads, where: str,
          check: bool, map_location: Any, meanwhile: Callable[[], None],
          early: Callable[[image_load.Image], None] | None = None,
          ) -> tuple[image_load.Image, list[str]]:
    """The file's image: in host memory, or, for one CUDA device, each storage straight into
    its device memory through a ring of pinned chunks (:mod:`.device_load`); ``meanwhile`` runs
    on this thread while the I/O threads read, then ``early`` for a host image
    (:func:`.image_load.read_image`)."""
    device = device_load.target_device(map_location)
    if device is not None:
        pool = io()
        return device_load.read_to_device(reader, fd, manifest, pool, where, device, check=check,
                                          workers=getattr(pool, "_max_workers", 4),
                                          meanwhile=meanwhile)
    return image_load.read_image(reader, fd, manifest, io(), where, check=check,
                                 meanwhile=meanwhile, early=early)


def _prefetch(reader: Reader, io: IoThreads, step: int) -> None:
    """Bring the file into the page cache with large parallel reads, as verification does, so
    that an unverified load (whose ``mmap`` would otherwise fault it in page by page while the
    tensors are first touched) is never slower than a verified one. Each thread reads into a
    scratch buffer of its own and drops the bytes."""
    size = reader.size
    local = threading.local()

    def one(lo: int) -> None:
        scratch = getattr(local, "scratch", None)
        if scratch is None:
            scratch = local.scratch = memoryview(bytearray(step))
        reader.readinto(lo, scratch[: min(step, size - lo)])

    list(io().map(one, range(0, size, step)))


def _read_parallel(reader: Reader, view: memoryview, io: IoThreads, step: int) -> None:
    """Read the whole of ``reader`` into ``view`` in ``step``-sized pieces on the I/O threads."""

    def one(lo: int) -> None:
        n = reader.readinto(lo, view[lo : lo + step])
        if n != len(view[lo : lo + step]):
            raise IntegrityError(f"checkpoint {reader.where} is truncated at byte {lo + n}")

    list(io().map(one, range(0, len(view), step)))
