"""``StagedCheckpointIO``: Lightning's checkpoint calls, routed through one ``stagesave.Checkpointer``.

The plugin only translates: ``save_checkpoint`` stages and returns, ``remove_checkpoint`` is
queued behind the saves submitted before it, ``load_checkpoint`` waits for a pending save of the
same path and loads with stagesave's allow-list, ``teardown`` flushes. Everything that holds
threads or buffers is created on first use and dropped at teardown, so the plugin is cheap to
construct, picklable while idle, and reusable across ``fit``/``validate``/``test`` calls.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import logging
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from typing_extensions import override

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities import rank_zero_info
from stagesave import (
    Checkpointer,
    CheckpointNotFoundError,
    ClosedError,
    SaveHandle,
    SaveTelemetry,
)
from stagesave.saving import inflight as _inflight

from ._links import LinkKeeper, install_link_hook
from ._trainer_hooks import install_trainer_hooks

__all__ = ["LIGHTNING_SAFE_GLOBALS", "StagedCheckpointIO", "find_plugin"]

log = logging.getLogger("stagesave.lightning")

#: Plain-data classes that Lightning checkpoints commonly hold besides tensors and numpy arrays
#: (``save_hyperparameters()`` of a ``Path`` or a ``Namespace``), allowed on top of the core's
#: allow-list. Lightning's ``AttributeDict`` cannot be: torch's safe unpickler refuses item
#: assignment on dict subclasses, and Lightning stores hyper-parameters as a plain ``dict``.
LIGHTNING_SAFE_GLOBALS: tuple[Any, ...] = (
    pathlib.PosixPath,
    pathlib.WindowsPath,
    pathlib.PurePosixPath,
    pathlib.PureWindowsPath,
    argparse.Namespace,
)

#: How many finished saves' telemetry the plugin keeps for the logging callback.
TELEMETRY_BACKLOG = 1024

_STORAGE_OPTION_KEYS = ("metadata",)

#: Lightning's name for the checkpoint its SLURM requeue handler writes (saved synchronously).
HPC_CHECKPOINT_PREFIX = "hpc_ckpt_"


def _import_global(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(
            f"safe_globals entry {name!r} does not name an importable class or function; "
            "give a dotted path such as 'my_pkg.config.TrainConfig'"
        ) from exc


def lightning_metadata(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What every Lightning checkpoint's proof records: the framework, the epoch and the step."""
    metadata: dict[str, Any] = {"framework": "lightning"}
    for field in ("epoch", "global_step"):
        value = checkpoint.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            metadata[field] = value
    return metadata


def _key(path: str) -> str:
    return path.rstrip("/") if "://" in path else os.path.abspath(os.path.expanduser(path))


class StagedCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` whose saves cost training one copy into host memory.

    ``Trainer(plugins=[StagedCheckpointIO()])`` keeps ``ModelCheckpoint``, ``ckpt_path="last"``,
    loggers and DDP as they are. Files are genuine ``torch.save`` files at the paths Lightning
    chooses and nothing else: each carries its own proof (chunk checksums, tensor index,
    sequence number, metadata) as one more zip record inside the file (stagesave's format 2,
    ``docs/format.md``), so the checkpoint directory lists exactly what ``TorchCheckpointIO``
    would leave, and ``torch.load``, ``zipfile`` and ``load_from_checkpoint`` read the files as
    they are.

    Args:
        max_pending: Saves that may be in flight at once (one host staging buffer each); a
            further save waits for a buffer instead of allocating more memory.
        checksum: Chunk checksum: ``"crc32"`` (default: the chunk CRC-32s are also the zip
            records' CRCs, so the proof costs no extra pass), ``"xxh3_128"``, ``"xxh3_64"``, or a
            cryptographic ``"blake3"`` / ``"sha256"``.
        checksum_in: ``"auto"`` (default: hash during the copy unless a device-to-host
            copy is still in flight), ``"staging"`` (always on the caller's time, so the
            background only makes syscalls) or ``"background"`` (the writer threads hash what
            they write).
        io_threads: Threads writing one file's chunks in parallel.
        direct_io: Write local files with O_DIRECT where the filesystem allows it.
        storage_options: fsspec options for remote paths (endpoint, credentials, region).
        verify_on_load: Check every byte against the checkpoint's proof before loading.
        teardown_timeout: Seconds ``teardown()`` waits for pending saves (``None``: no limit).
        telemetry_callback: Called on the writer thread with each save's ``SaveTelemetry``.
        telemetry_jsonl: ``True`` to append telemetry lines beside local checkpoints, or a path.
        safe_globals: Extra classes (or dotted names) allowed when loading, on top of
            stagesave's allow-list and :data:`LIGHTNING_SAFE_GLOBALS`.
        device_staging: Stage a GPU model's checkpoint in GPU memory (device-to-device copies)
            and write it from there in the background, with GPUDirect Storage when kvikio is
            installed; costs one GPU buffer of the checkpoint's size per save in flight
            (``stagesave.Checkpointer``'s ``device_staging``). Local files only.
    """

    def __init__(
        self,
        *,
        max_pending: int = 2,
        checksum: str = "crc32",
        checksum_in: str = "auto",
        io_threads: int = 4,
        direct_io: bool = True,
        storage_options: dict[str, Any] | None = None,
        verify_on_load: bool = True,
        teardown_timeout: float | None = 600.0,
        telemetry_callback: Callable[[SaveTelemetry], None] | None = None,
        telemetry_jsonl: bool | str = False,
        safe_globals: Sequence[Any] = (),
        device_staging: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(device_staging, bool):
            raise TypeError(f"device_staging must be True or False, got {device_staging!r}")
        self.device_staging = device_staging
        if teardown_timeout is not None and teardown_timeout < 0:
            raise ValueError(f"teardown_timeout must be >= 0 or None, got {teardown_timeout}")
        self.max_pending = max_pending
        self.checksum = checksum
        self.checksum_in = checksum_in
        self.io_threads = io_threads
        self.direct_io = direct_io
        self.storage_options = dict(storage_options or {})
        self.verify_on_load = verify_on_load
        self.teardown_timeout = teardown_timeout
        self.telemetry_callback = telemetry_callback
        self.telemetry_jsonl = telemetry_jsonl
        self.safe_globals = [_import_global(g) if isinstance(g, str) else g for g in safe_globals]
        self._init_runtime()
        # The core validates every option now, not at the first save (pinned=False: no CUDA
        # query before a fork-based launcher starts its workers).
        self._new_checkpointer(pinned=False).close()
        install_link_hook(find_plugin)
        install_trainer_hooks(find_plugin)

    def _init_runtime(self) -> None:
        self._lock = threading.RLock()
        self._ckpt: Checkpointer | None = None
        self._links = LinkKeeper()
        self._handles: dict[str, SaveHandle] = {}
        self._last_save_failed = False  # written and read on the writer thread only
        self._telemetry: collections.deque[SaveTelemetry] = collections.deque(maxlen=TELEMETRY_BACKLOG)
        self._mode = threading.local()  # per thread: is the save being made inside the fit loop?
        self._async_active = False  # an asynchronous save was made since the last teardown
        self._warned_replaced_save = False

    # ------------------------------------------------------------------ the core, on demand
    @property
    def checkpointer(self) -> Checkpointer:
        """The underlying :class:`stagesave.Checkpointer` (created on first use)."""
        with self._lock:
            if self._ckpt is None:
                self._ckpt = self._new_checkpointer()
            return self._ckpt

    def _new_checkpointer(self, pinned: bool | None = None) -> Checkpointer:
        return Checkpointer(
            pinned=pinned,
            max_pending=self.max_pending,
            checksum=self.checksum,
            checksum_in=self.checksum_in,
            device_staging=self.device_staging,
            io_threads=self.io_threads,
            direct_io=self.direct_io,
            storage_options=self.storage_options,
            telemetry_callback=self._on_telemetry,
            telemetry_jsonl=self.telemetry_jsonl,
            safe_globals=[*LIGHTNING_SAFE_GLOBALS, *self.safe_globals],
        )

    def _on_telemetry(self, tel: SaveTelemetry) -> None:
        # Runs on the writer thread: record, report a failure at once, pass on.
        self._telemetry.append(tel)
        self._last_save_failed = bool(tel.error)
        if tel.error:
            log.error(
                "stagesave: saving %s failed in the background: %s. The checkpoint was not "
                "committed; the error is raised at the next save, wait() or teardown.",
                tel.path,
                tel.error,
            )
        if self.telemetry_callback is not None:
            self.telemetry_callback(tel)

    def pop_telemetry(self) -> list[SaveTelemetry]:
        """Telemetry of the saves finished since the last call (oldest first)."""
        out = []
        while True:
            try:
                out.append(self._telemetry.popleft())
            except IndexError:
                return out

    # ------------------------------------------------------------------ CheckpointIO contract
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` and write it to ``path`` in the background.

        Returns once the state is copied into host memory; later changes to the model, the
        optimizer or any value in ``checkpoint`` (numpy arrays included) do not reach the file.
        The one exception is Lightning's SLURM requeue checkpoint (``hpc_ckpt_<n>.ckpt``): the
        job is requeued right after it, so that save returns once committed.

        Args:
            checkpoint: The state Lightning or Fabric assembled.
            path: Target file: a local path or an fsspec URL (``s3://...``).
            storage_options: ``None`` or ``{"metadata": {...}}``, JSON-able values recorded in
                the proof inside the checkpoint file, next to ``framework``, ``epoch`` and
                ``global_step`` (read them back with ``stagesave.latest(dir).manifest.metadata``
                or ``Checkpointer.verify(path).manifest.metadata``).

        Raises:
            TypeError: ``storage_options`` has keys other than ``"metadata"``.
            stagesave.CheckpointError: an earlier background save failed (raised once), the
                target cannot be written, or the state holds an object that cannot be saved.
        """
        metadata = lightning_metadata(checkpoint)
        if storage_options is not None:
            unknown = set(storage_options) - set(_STORAGE_OPTION_KEYS) if isinstance(storage_options, dict) else {0}
            if unknown:
                raise TypeError(
                    f"{type(self).__name__} accepts storage_options={{'metadata': {{...}}}} only, got "
                    f"{storage_options!r}; set fsspec options with StagedCheckpointIO(storage_options=...)"
                )
            metadata.update(storage_options.get("metadata") or {})
        target = os.fspath(path)
        if torch.save is not torch.serialization.save:
            self._save_through_replaced_torch_save(checkpoint, path)
            return
        asynchronous = self._asynchronous()
        handle = self.checkpointer.save(checkpoint, target, metadata=metadata)
        self.track(target, handle)
        if asynchronous:
            with self._lock:
                self._async_active = True
            if os.path.basename(target).startswith(HPC_CHECKPOINT_PREFIX):
                # Lightning's SLURM auto-requeue saves this and requeues the job at once: the
                # checkpoint must be durable before the job can be killed.
                handle.result()
            return
        try:
            handle.result()
        finally:
            self._release_if_idle()

    def _save_through_replaced_torch_save(self, checkpoint: dict[str, Any], path: Any) -> None:
        """``torch.save`` was replaced in this process (a monkeypatch, a test's mock): honour it
        as Lightning's own IO would. The save is made by Lightning's ``TorchCheckpointIO``
        through the replacement, synchronously and without stagesave's proof, after this
        plugin's pending work; a warning says so once per plugin."""
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        if not self._warned_replaced_save:
            self._warned_replaced_save = True
            log.warning("stagesave: torch.save is replaced by %r in this process; checkpoints are written "
                        "through it by Lightning's TorchCheckpointIO (synchronously, without stagesave's "
                        "proof) while it stays replaced", torch.save)
        self.wait()
        TorchCheckpointIO().save_checkpoint(checkpoint, path)

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint (written by this plugin or by ``torch.save``), waiting for a pending
        save of the same path.

        Args:
            path: Checkpoint file; a ``save_last="link"`` link is followed to its target.
            map_location: As in ``torch.load``; ``None`` loads onto the CPU like Lightning's
                ``TorchCheckpointIO``.
            weights_only: ``None``/``True`` load with torch's safe unpickler and stagesave's
                allow-list (numpy arrays, RNG states, ...); ``False`` trusts the file fully.

        Raises:
            FileNotFoundError: no checkpoint at ``path`` (a ``stagesave.CheckpointNotFoundError``).
            stagesave.IntegrityError: the file does not match its proof.
            stagesave.UnsafeCheckpointError: the file needs a class that is not allow-listed.
        """
        target = os.fspath(path)
        if "://" not in target:
            update = self._links.update_of(target)
            if update is not None:
                update.exception()  # the link moves only once its target is committed
        try:
            return self.checkpointer.load(  # type: ignore[no-any-return]
                target,
                "cpu" if map_location is None else map_location,
                verify=self.verify_on_load,
                trusted=weights_only is False,
            )
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(f"Checkpoint file not found: {target}") from exc  # Lightning's words
        finally:
            self._release_if_idle()

    def resume_path(self, path: Any) -> Any:
        """The checkpoint ``fit(ckpt_path="last")`` should resume from, given Lightning's choice.

        Lightning picks the newest ``last*.ckpt`` by modification time. That file is checked as
        :func:`stagesave.latest` checks a candidate (every byte with ``verify_on_load``; the load
        that follows does not hash it again): if it cannot be loaded, a warning names it and what
        is wrong, and the newest checkpoint in the same directory that can be loaded is used
        instead. With none, Lightning's choice stands and its load raises the error.
        """
        target = os.fspath(path)
        if "://" not in target:
            update = self._links.update_of(target)
            if update is not None:
                update.exception()
        try:
            chosen = self.checkpointer.resume_from(target, verify=self.verify_on_load)
        finally:
            self._release_if_idle()
        return path if chosen is None or chosen == target else chosen

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint after every save submitted before this call, unless the last of
        those failed.

        ``ModelCheckpoint`` removes the previous best right after asking for the new one; if the
        new save then fails in the background, the previous one may be the newest valid
        checkpoint, so it is kept (with a warning). A checkpoint that a ``save_last="link"``
        link still points at is removed once the link has moved on (or kept, if it never does).
        """
        target = os.fspath(path)
        ckpt = self.checkpointer
        with self._lock:
            queued = self._async_active
        if not queued or getattr(self._mode, "asynchronous", None) is False:
            # no asynchronous save to stay behind (outside a run): remove it now
            try:
                ckpt.remove(target).result()
            finally:
                self._release_if_idle()
            return
        if "://" not in target and self._links.remove(ckpt, target):
            return
        ckpt.run_after(lambda: self._remove_unless_a_save_failed(ckpt, target),
                       description=f"removing {target}")

    def _remove_unless_a_save_failed(self, ckpt: Checkpointer, target: str) -> None:
        # On the writer thread, after every save submitted before the removal.
        if self._last_save_failed:
            log.warning("stagesave: kept %s: the save before its removal failed, so it may be the "
                        "newest valid checkpoint", target)
            return
        try:
            ckpt.remove(target)  # queued now; runs after what was submitted meanwhile
        except (ClosedError, RuntimeError):
            log.info("stagesave: kept %s: the plugin was closed before its removal", target)

    # ------------------------------------------------------------------ when a save is asynchronous
    @contextmanager
    def saving(self, *, asynchronous: bool) -> Iterator[None]:
        """Saves made on this thread inside the block are asynchronous (``True``: the fit loop
        runs and hides the write) or return once committed (``False``: nothing to overlap).

        The plugin's ``Trainer.save_checkpoint`` hook sets this for every trainer save; a save
        made without it (Fabric, a direct call) is asynchronous.
        """
        previous = getattr(self._mode, "asynchronous", None)
        self._mode.asynchronous = asynchronous
        try:
            yield
        finally:
            self._mode.asynchronous = previous

    def _asynchronous(self) -> bool:
        return getattr(self._mode, "asynchronous", None) is not False

    def will_exist(self, path: Any) -> bool | None:
        """Whether ``path`` will exist once the operations pending on it in this process ran
        (``True``: its last pending operation is a save; ``False``: a removal); ``None`` when
        nothing is pending on it (ask the filesystem)."""
        ops = [h for h in _inflight.pending(_key(os.fspath(path))) if h.kind in ("save", "remove")]
        return None if not ops else ops[-1].kind == "save"

    def _release_if_idle(self) -> None:
        """Outside a run (no asynchronous save since the last teardown): end the threads and
        free the staging buffers now, as ``teardown`` does, so that saves and loads between or
        after runs leave nothing behind. Errors are raised unless one is already propagating."""
        with self._lock:
            if self._async_active or self._ckpt is None:
                return
            ckpt, self._ckpt = self._ckpt, None
            links, self._links = self._links, LinkKeeper()
        errors = _flush_and_close(ckpt, links, None)
        links.kept()
        if not errors:
            return
        if sys.exc_info()[1] is not None:
            for exc in errors:
                log.error("stagesave: while another error was propagating: %s", exc)
            return
        raise errors[0]

    def track(self, path: Any, handle: SaveHandle) -> None:
        """Record ``handle`` as the pending save of ``path`` (a link to ``path`` made later
        moves only if that save commits). The sharded strategies register their saves here."""
        with self._lock:
            self._handles = {k: h for k, h in self._handles.items() if not h.done()}
            self._handles[_key(os.fspath(path))] = handle

    def link(self, target: Any, link: Any) -> None:
        """Point the symlink ``link`` at ``target`` once ``target`` is committed (atomically).

        ``ModelCheckpoint(save_last="link")`` calls this through the trainer; the link never
        points at a checkpoint that is still being written.

        Raises:
            ValueError: ``link`` is a URL (links exist on local filesystems only).
        """
        target_s, link_s = os.fspath(target), os.fspath(link)
        if "://" in link_s:
            raise ValueError(f"cannot link {link_s}: save_last='link' needs a local directory")
        with self._lock:
            handle = self._handles.get(_key(target_s))
        self._links.link(self.checkpointer, target_s, link_s, handle)

    @override
    def teardown(self) -> None:
        """Flush pending saves (bounded by ``teardown_timeout``) and release threads and buffers.

        Lightning calls this at the end of every ``fit``/``validate``/``test`` and when training
        stops on an exception or SIGTERM. A save failure is raised here, except while another
        exception is propagating: then it is logged and the original exception stays the one
        the user sees. In a distributed run the ranks meet after the flush (normal exit only),
        so that no rank reads a checkpoint that rank 0 is still writing.

        Raises:
            TimeoutError: saves still running after ``teardown_timeout`` seconds.
            stagesave.CheckpointError: a background save failed and was not reported yet.
        """
        in_flight = sys.exc_info()[1]
        deadline = None if self.teardown_timeout is None else time.monotonic() + self.teardown_timeout
        pending = self.pending()
        if pending:
            rank_zero_info(f"stagesave: waiting for {pending} checkpoint operation(s) to finish writing")
        with self._lock:
            ckpt, self._ckpt = self._ckpt, None
            links, self._links = self._links, LinkKeeper()
            self._async_active = False
        errors = _flush_and_close(ckpt, links, deadline)
        links.kept()
        if in_flight is None and not errors:
            errors = _meet_other_ranks(deadline)
        if not errors:
            return
        if isinstance(errors[0], TimeoutError):
            errors[0] = TimeoutError(
                f"{errors[0]}. StagedCheckpointIO.teardown gave up after teardown_timeout="
                f"{self.teardown_timeout} s; raise it, or check the storage (the checkpoints "
                "still being written were not committed, earlier ones are intact)."
            )
        if in_flight is not None:
            for exc in errors:
                log.error("stagesave: while %s was propagating: %s", type(in_flight).__name__, exc)
            return
        for exc in errors[1:]:
            log.error("stagesave: also failed at teardown: %s", exc)
        raise errors[0]

    # ------------------------------------------------------------------ barriers and queries
    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted save, removal and link update has finished.

        The one-line barrier before reading a checkpoint file directly:
        ``trainer.strategy.checkpoint_io.wait()`` (loads through the plugin wait by themselves).

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            stagesave.CheckpointError: a background save failed (raised once).
        """
        ckpt = self._ckpt
        if ckpt is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        ckpt.wait(timeout)
        # The link updates just finished may free checkpoints whose removal was held.
        self._links.release(ckpt)
        ckpt.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def pending(self) -> int:
        """Saves, removals and link updates not finished yet."""
        return self._ckpt.pending() if self._ckpt is not None else 0

    def latest(self, dirpath: Any, *, verify: bool = True) -> str | None:
        """Path of the newest checkpoint in ``dirpath`` that a resume can load (after this
        plugin's pending saves), or ``None``; use it as ``trainer.fit(ckpt_path=...)``.

        Verified unless ``verify=False``, as :func:`stagesave.lightning.latest`."""
        self.wait()
        try:
            info = self.checkpointer.latest(os.fspath(dirpath), verify=verify)
        finally:
            self._release_if_idle()
        return None if info is None else info.path

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        # Configuration only: threads, buffers and pending saves stay with the original.
        state = self.__dict__.copy()
        for runtime in ("_lock", "_ckpt", "_links", "_handles", "_telemetry", "_mode", "_async_active"):
            state.pop(runtime, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_pending={self.max_pending}, checksum={self.checksum!r}, "
            f"pending={self.pending()})"
        )


def _meet_other_ranks(deadline: float | None) -> list[BaseException]:
    """Barrier after the flush: only rank 0 writes, and no rank may go on to read a checkpoint
    (``ckpt_path="last"``/``"best"`` of a next stage, ``latest()``) that rank 0 is still writing.
    Runs on the training thread at the end of a stage that every rank reaches, never while an
    exception propagates (the other ranks might never arrive)."""
    import datetime

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return []
    left = None if deadline is None else max(1.0, deadline - time.monotonic())
    try:
        dist.barrier(timeout=None if left is None else datetime.timedelta(seconds=left))
    except BaseException as exc:  # noqa: BLE001 - the caller raises it with context
        err = RuntimeError(
            f"stagesave: ranks did not meet after the checkpoint flush ({exc}); another rank "
            "failed or is still running. Checkpoints written so far are committed."
        )
        err.__cause__ = exc
        return [err]
    return []


def _flush_and_close(ckpt: Checkpointer | None, links: LinkKeeper, deadline: float | None) -> list[BaseException]:
    """Wait for every operation, submit the removals the last link updates freed, close.

    Returns the errors instead of raising them (the caller decides whether they may be raised).
    """
    if ckpt is None:
        return []

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    errors: list[BaseException] = []
    try:
        ckpt.wait(left())
        links.release(ckpt)
    except TimeoutError as exc:
        errors.append(exc)
    except BaseException as exc:  # noqa: BLE001 - the caller raises or reports it
        errors.append(exc)
        links.release(ckpt)
    try:
        ckpt.close(0.0 if errors and isinstance(errors[0], TimeoutError) else left())
    except TimeoutError as exc:
        if not errors:
            errors.append(exc)
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)
    return errors


def find_plugin(owner: Any) -> StagedCheckpointIO | None:
    """The :class:`StagedCheckpointIO` of a ``Trainer``, ``Fabric`` or strategy, or ``None``."""
    strategy = getattr(owner, "strategy", owner)
    io = getattr(strategy, "checkpoint_io", None)
    seen = 0
    while io is not None and not isinstance(io, StagedCheckpointIO) and seen < 8:
        io = getattr(io, "checkpoint_io", None)  # unwrap Lightning's _WrappingCheckpointIO
        seen += 1
    return io if isinstance(io, StagedCheckpointIO) else None

