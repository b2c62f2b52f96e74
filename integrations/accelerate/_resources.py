"""What an ``AcceleratorCheckpointer`` holds while saves run, and how it is given back.

Each Checkpointer owns a writer thread, its I/O threads and its staging buffers (host memory of
the checkpoint's size, ``max_pending`` of them); the tiered store has upload threads; FSDP runs add
a DCP writer. They are created on the first save or load that needs them and given back whole by
:meth:`Resources.close`: at ``accelerator.end_training()``, ``free_memory()``/``clear()``,
``disable()``, ``AcceleratorCheckpointer.close()``, and when the Accelerator (or the
checkpointer) is garbage collected (a ``weakref.finalize`` that holds this object, never the
Accelerator). A later save creates them again. Interpreter exit is the core's: every Checkpointer
still open is flushed by ``stagesave``'s exit hook before torch and the thread pools shut down.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stagesave import Checkpointer, TieredStore
from stagesave.stores.local import makedirs_durable

from ._config import Options

if TYPE_CHECKING:
    from stagesave.dcp import StagedStorageWriter

__all__ = ["Resources"]


@dataclass
class Resources:
    """The Checkpointers (by kind), the tiered store and the DCP writer of one checkpointer.

    ``options`` and ``telemetry`` (a JSON lines file, or ``False``) configure what is created.
    """

    options: Options
    telemetry: bool | str
    checkpointers: dict[str, Checkpointer] = field(default_factory=dict)
    tiered: TieredStore | None = None
    writer: StagedStorageWriter | None = None

    def open(self, kind: str, keep: int | None, remote_root: str | None) -> Checkpointer:
        """A new Checkpointer for ``kind`` (``"auto"``, ``"plain"``, ``"fsdp"``), kept by kind.

        ``keep``: retention (``total_limit``); ``remote_root``: the URL behind a tiered root (the
        ``local_tier`` option), whose :class:`~stagesave.TieredStore` is the Checkpointer's root.
        """
        o = self.options
        root: TieredStore | None = None
        if remote_root is not None and o.local_tier is not None:
            root = self.tiered = TieredStore(
                o.local_tier, remote_root, storage_options=dict(o.storage_options),
                keep_local=o.keep_local,
            )
        ckpt = Checkpointer(
            root, max_pending=o.max_pending, checksum=o.checksum, keep_last=keep,
            io_threads=o.io_threads, direct_io=o.direct_io, storage_options=dict(o.storage_options),
            device_staging=o.device_staging, telemetry_jsonl=self.telemetry, writer=o.writer,
        )
        if isinstance(self.telemetry, str):  # the core appends to the file, in a folder that exists
            makedirs_durable(os.path.dirname(os.path.abspath(self.telemetry)))
        self.checkpointers[kind] = ckpt
        return ckpt

    def dcp_writer(self, checkpointer: Checkpointer) -> StagedStorageWriter:
        """The DCP writer of FSDP parts (created on first use, over ``checkpointer``)."""
        if self.writer is None:
            from stagesave.dcp import StagedStorageWriter  # only FSDP runs need torch's DCP

            self.writer = StagedStorageWriter(checkpointer=checkpointer)
        return self.writer

    def pending(self) -> int:
        return sum(c.pending() for c in self.checkpointers.values())

    def close(self, timeout: float | None = None) -> None:
        """Finish pending saves (and uploads), end the threads, free the buffers.

        Everything is closed even when one part fails; the first failure is raised after.

        Raises:
            TimeoutError: saves still running after ``timeout`` seconds (not committed).
            CheckpointError: a background save failed.
        """
        errors: list[BaseException] = []
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close(timeout)
            except BaseException as exc:  # noqa: BLE001, RUF100 - close all, raise the first
                errors.append(exc)
        checkpointers, self.checkpointers = list(self.checkpointers.values()), {}
        for ckpt in checkpointers:
            try:
                ckpt.close(timeout)
            except BaseException as exc:  # noqa: BLE001, RUF100
                errors.append(exc)
        tiered, self.tiered = self.tiered, None
        if tiered is not None:
            try:
                tiered.close(timeout)
            except BaseException as exc:  # noqa: BLE001, RUF100
                errors.append(exc)
        if errors:
            raise errors[0]

    def close_quietly(self) -> None:
        """:meth:`close` for a finalizer: a failure is printed, never raised."""
        try:
            self.close()
        except BaseException as exc:  # noqa: BLE001, RUF100 - nobody to raise to
            print(
                "stagesave.accelerate: a checkpoint save failed before its Accelerator was "
                f"released: {exc}",
                file=sys.stderr,
            )
