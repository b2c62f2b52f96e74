"""The end of a run: flush the plugin, let the ranks meet, raise or report what failed.

Lightning calls ``CheckpointIO.teardown`` at the end of every ``fit``/``validate``/``test`` and
while training stops on an exception or SIGTERM. Errors are collected here, not raised, so that
the plugin can decide: raise the first, or (while another exception propagates) log them and
leave the original exception the one the user sees.
"""

from __future__ import annotations

import logging
import sys
import time

from lightning.fabric.utilities import rank_zero_info
from stagesave.errors import UsageError

from ._runtime import Runtime

__all__ = ["meet_other_ranks", "raise_or_log", "teardown"]

log = logging.getLogger("stagesave.lightning")


def teardown(run: Runtime, teardown_timeout: float | None) -> None:
    """``StagedCheckpointIO.teardown``: flush and close ``run`` (bounded by
    ``teardown_timeout``), then meet the other ranks (normal exit only); raise the first error
    unless another exception is propagating."""
    in_flight = sys.exc_info()[1]
    deadline = None if teardown_timeout is None else time.monotonic() + teardown_timeout
    pending = run.pending()
    if pending:
        rank_zero_info(
            f"stagesave: waiting for {pending} checkpoint operation(s) to finish writing"
        )
    errors = run.close(deadline)
    if in_flight is None and not errors:
        errors = meet_other_ranks(deadline)
    raise_or_log(errors, in_flight, teardown_timeout)


def meet_other_ranks(deadline: float | None) -> list[BaseException]:
    """Barrier after the flush: only rank 0 writes, and no rank may go on to read a checkpoint
    (``ckpt_path="last"``/``"best"`` of a next stage, ``latest()``) that rank 0 is still writing.
    Runs on the training thread at the end of a stage that every rank reaches, never while an
    exception propagates (the other ranks might never arrive)."""
    import datetime

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return []
    remaining = None if deadline is None else max(1.0, deadline - time.monotonic())
    timeout = None if remaining is None else datetime.timedelta(seconds=remaining)
    try:
        dist.barrier(timeout=timeout)
    except BaseException as exc:  # noqa: BLE001, RUF100 - the caller raises it with context
        err = UsageError(
            f"stagesave: ranks did not meet after the checkpoint flush ({exc}); another rank "
            "failed or is still running. Checkpoints written so far are committed."
        )
        err.__cause__ = exc
        return [err]
    return []


def raise_or_log(
    errors: list[BaseException], in_flight: BaseException | None, teardown_timeout: float | None
) -> None:
    """Raise the first of ``errors`` (logging the others), or log them all while ``in_flight``
    propagates. A flush that timed out says which option bounds it."""
    if not errors:
        return
    if isinstance(errors[0], TimeoutError):
        errors[0] = TimeoutError(
            f"{errors[0]}. StagedCheckpointIO.teardown gave up after teardown_timeout="
            f"{teardown_timeout} s; raise it, or check the storage (the checkpoints "
            "still being written were not committed, earlier ones are intact)."
        )
    if in_flight is not None:
        for exc in errors:
            log.error("stagesave: while %s was propagating: %s", type(in_flight).__name__, exc)
        return
    for exc in errors[1:]:
        log.error("stagesave: also failed at teardown: %s", exc)
    raise errors[0]
