"""``torch.distributed.checkpoint.async_save`` as a ``stagesave bench`` alternative: thread and
process mode, with a fresh stager per save (as a plain call does) or a reused one (CPU, shared
or pinned shared memory).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .alternatives import Session

__all__ = ["DcpAsync", "gloo_unavailable", "pinned_unavailable"]


class DcpAsync(Session):
    """``torch.distributed.checkpoint.async_save`` in thread or process mode, with a chosen stager.

    ``stager``: ``None`` lets async_save create (and close) its own per save, as a plain call does;
    ``"reused"`` keeps one DefaultStager whose cached CPU copies later saves reuse; ``"shm"`` is
    the same in shared memory, which process mode hands to its daemon without a copy;
    ``"pinned+shm"`` adds pinned memory (CUDA only).
    """

    def __init__(self, base: str, *, process: bool, stager: str | None) -> None:
        super().__init__()
        import torch.distributed as dist
        from torch.distributed.checkpoint import _async_process_executor
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.process = process
        self._fut: Any = None
        self._own_group = False
        self.stager = None
        if stager is not None:
            self.stager = DefaultStager(StagingOptions(
                use_pinned_memory="pinned" in stager, use_shared_memory="shm" in stager,
                use_async_staging=False, use_non_blocking_copy=False))
        if (
            process
            and _async_process_executor._CHECKPOINT_PROCESS is None
            and not dist.is_initialized()
        ):
            # Process mode learns the daemon's rendezvous through a process group; one process is
            # a gloo group of world size 1. Its gloo threads slow torch's OpenMP threads, so the
            # group lives only until the daemon has started (see after_warmup).
            store = dist.FileStore(os.path.join(base, "pg-store"), 1)  # type: ignore[attr-defined]
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            self._own_group = True

    def start(self, state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
        )

        kwargs: dict[str, Any] = {}
        if self.stager is not None:
            kwargs["async_stager"] = self.stager
        if self.process:
            kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        self.called_at = time.perf_counter()
        self.done_at = None
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to save in a single process.*"
            )
            fut = dcp.async_save(state, checkpoint_id=path, **kwargs)  # type: ignore[attr-defined]
        blocking = time.perf_counter() - self.called_at
        if isinstance(fut, AsyncSaveResponse):
            fut = fut.upload_completion
        fut.add_done_callback(self._mark_done)
        self._fut = fut
        return blocking, fut.done

    def check(self) -> None:
        if self._fut is not None:
            self._fut.result()

    def after_warmup(self) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint import _async_process_executor

        if self.process and _async_process_executor._CHECKPOINT_PROCESS is None:
            # the daemon has not started yet: it still needs the group to learn its rendezvous
            return
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = False

    def close(self) -> None:
        import torch.distributed as dist

        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = False
        if self.stager is not None:
            self.stager.close()


def pinned_unavailable() -> str | None:
    return (
        None
        if torch.cuda.is_available()
        else "pinned memory needs CUDA (torch ignores pin_memory without it)"
    )


def gloo_unavailable() -> str | None:
    import torch.distributed as dist

    return (
        None if dist.is_available() and dist.is_gloo_available() else "torch was built without gloo"
    )
