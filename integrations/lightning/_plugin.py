"""``StagedCheckpointIO``: Lightning's checkpoint calls, routed through one ``Checkpointer``.

The plugin only translates: ``save_checkpoint`` stages and returns, ``remove_checkpoint`` is
queued behind the saves submitted before it, ``load_checkpoint`` waits for a pending save of the
same path and loads with stagesave's allow-list, ``teardown`` flushes. Everything that holds
threads or buffers is created on first use and dropped at teardown (``_runtime.py``), so the
plugin is cheap to construct, picklable while idle, and reusable across ``fit``/``validate``/
``test`` calls. What the plugin offers beyond the ``CheckpointIO`` contract (barriers, queries,
what Lightning's wrapped methods ask it) is in ``_extras.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import override

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from stagesave import Checkpointer, CheckpointNotFoundError, SaveTelemetry

from ._extras import StagedExtras
from ._links import install_link_hook
from ._options import LIGHTNING_SAFE_GLOBALS, import_global, save_metadata
from ._runtime import Runtime
from ._teardown import teardown
from ._trainer_hooks import install_trainer_hooks

__all__ = ["LIGHTNING_SAFE_GLOBALS", "StagedCheckpointIO", "find_plugin"]

log = logging.getLogger("stagesave.lightning")

#: Lightning's name for the checkpoint its SLURM requeue handler writes (saved synchronously).
HPC_CHECKPOINT_PREFIX = "hpc_ckpt_"


class StagedCheckpointIO(StagedExtras, CheckpointIO):
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
        writer: ``"process"``: a writer agent process writes and commits each save, and
            finishes every save handed to it if this process dies; ``"thread"``: this
            process's threads; ``None`` (default): ``$STAGESAVE_WRITER``, else ``"process"``
            (``"thread"`` with ``device_staging``).
        prepare_buffer: Make the staging buffer of a fit's first save before that save (once
            a resumed checkpoint is loaded, or after the first optimizer step), so that it only
            copies: ``None`` (default) when the fit trains on an accelerator (its CPU cores are
            free for it; on a CPU-only fit making it competes with training, BENCHMARKS.md),
            ``True`` always, ``False`` never.
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
        writer: str | None = None,
        prepare_buffer: bool | None = None,
    ) -> None:
        super().__init__()
        self.writer = writer
        if prepare_buffer is not None and not isinstance(prepare_buffer, bool):
            raise TypeError(f"prepare_buffer must be True, False or None, got {prepare_buffer!r}")
        self.prepare_buffer = prepare_buffer
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
        self.safe_globals = [import_global(g) if isinstance(g, str) else g for g in safe_globals]
        self._run = Runtime(self._new_checkpointer, self._forward_telemetry)
        # The core validates every option now, not at the first save (pinned=False: no CUDA
        # query before a fork-based launcher starts its workers).
        self._new_checkpointer(pinned=False).close()
        install_link_hook(find_plugin)
        install_trainer_hooks(find_plugin)

    # ------------------------------------------------------------------ the core, on demand
    @property
    def checkpointer(self) -> Checkpointer:
        """The underlying :class:`stagesave.Checkpointer` (created on first use)."""
        return self._run.checkpointer

    def _new_checkpointer(self, pinned: bool | None = None) -> Checkpointer:
        return Checkpointer(
            pinned=pinned,
            max_pending=self.max_pending,
            checksum=self.checksum,
            checksum_in=self.checksum_in,
            device_staging=self.device_staging,
            writer=self.writer,
            io_threads=self.io_threads,
            direct_io=self.direct_io,
            storage_options=self.storage_options,
            telemetry_callback=self._run.on_telemetry,
            telemetry_jsonl=self.telemetry_jsonl,
            safe_globals=[*LIGHTNING_SAFE_GLOBALS, *self.safe_globals],
        )

    def _forward_telemetry(self, tel: SaveTelemetry) -> None:
        if self.telemetry_callback is not None:
            self.telemetry_callback(tel)

    # ------------------------------------------------------------------ CheckpointIO contract
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
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
        metadata = save_metadata(checkpoint, storage_options, type(self).__name__)
        target = os.fspath(path)
        if torch.save is not torch.serialization.save:
            self._save_through_replaced_torch_save(checkpoint, path)
            return
        asynchronous = self._run.asynchronous()
        handle = self.checkpointer.save(checkpoint, target, metadata=metadata)
        self.track(target, handle)
        if asynchronous:
            self._run.mark_asynchronous()
            if os.path.basename(target).startswith(HPC_CHECKPOINT_PREFIX):
                # Lightning's SLURM auto-requeue saves this and requeues the job at once: the
                # checkpoint must be durable before the job can be killed.
                handle.result()
            return
        try:
            handle.result()
        finally:
            self._run.release_if_idle()

    def _save_through_replaced_torch_save(self, checkpoint: dict[str, Any], path: Any) -> None:
        """``torch.save`` was replaced in this process (a monkeypatch, a test's mock): honour it
        as Lightning's own IO would. The save is made by Lightning's ``TorchCheckpointIO``
        through the replacement, synchronously and without stagesave's proof, after this
        plugin's pending work; a warning says so once per plugin."""
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        if not self._run.warned_replaced_save:
            self._run.warned_replaced_save = True
            log.warning("stagesave: torch.save is replaced by %r in this process; checkpoints "
                        "are written through it by Lightning's TorchCheckpointIO (synchronously, "
                        "without stagesave's proof) while it stays replaced", torch.save)
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
        self._run.settle_link(target)  # the link moves only once its target is committed
        try:
            return self.checkpointer.load(  # type: ignore[no-any-return]
                target,
                "cpu" if map_location is None else map_location,
                verify=self.verify_on_load,
                trusted=weights_only is False,
            )
        except CheckpointNotFoundError as exc:  # Lightning's words:
            raise CheckpointNotFoundError(f"Checkpoint file not found: {target}") from exc
        finally:
            self._run.release_if_idle()

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint after every save submitted before this call, unless the last of
        those failed.

        ``ModelCheckpoint`` removes the previous best right after asking for the new one; if the
        new save then fails in the background, the previous one may be the newest valid
        checkpoint, so it is kept (with a warning). A checkpoint that a ``save_last="link"``
        link still points at is removed once the link has moved on (or kept, if it never does).
        """
        self._run.remove(os.fspath(path))

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
        teardown(self._run, self.teardown_timeout)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        # Configuration only: threads, buffers and pending saves stay with the original.
        state = self.__dict__.copy()
        state.pop("_run", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._run = Runtime(self._new_checkpointer, self._forward_telemetry)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_pending={self.max_pending}, checksum={self.checksum!r}, "
            f"pending={self.pending()})"
        )


def find_plugin(owner: Any) -> StagedCheckpointIO | None:
    """The :class:`StagedCheckpointIO` of a ``Trainer``, ``Fabric`` or strategy, or ``None``."""
    strategy = getattr(owner, "strategy", owner)
    io = getattr(strategy, "checkpoint_io", None)
    seen = 0
    while io is not None and not isinstance(io, StagedCheckpointIO) and seen < 8:
        io = getattr(io, "checkpoint_io", None)  # unwrap Lightning's _WrappingCheckpointIO
        seen += 1
    return io if isinstance(io, StagedCheckpointIO) else None

