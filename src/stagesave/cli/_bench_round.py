"""One measured save of ``stagesave bench``: an alternative set up in a fresh folder of its own,
warmed up if it reuses something, timed (blocking, until complete and, with the training loop,
the time training lost), torn down, and its folder removed whatever happened.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..stores import posix as fsops
from ..stores.targets import is_url
from ._bench_state import TrainLoop
from ._common import CliError, Env
from .alternatives import Alternative, Session

__all__ = ["SAVE_TIMEOUT_S", "BenchTarget", "Timing", "measure_round"]

#: A background save that takes longer than this is reported as an error.
SAVE_TIMEOUT_S = 3600.0


@dataclass
class Timing:
    """One method's runs: seconds training waited, seconds until durable and, with a loop, the
    training time lost."""

    method: str
    durable: bool = True
    blocking_s: list[float] = field(default_factory=list)
    durable_s: list[float] = field(default_factory=list)
    lost_s: list[float] = field(default_factory=list)
    step_mean_x: list[float] = field(default_factory=list)
    step_p99_x: list[float] = field(default_factory=list)
    loop_ms: list[float] = field(default_factory=list)

    def add_loop(self, blocked: float, window: float, steps: list[float], baseline: float) -> None:
        """Record one save made while ``TrainLoop`` ran ``steps`` during the ``window`` after the
        call.

        The time lost is the blocking time plus the window less the work the loop would have done
        in it at its baseline speed (never negative): a loop that kept full speed lost nothing.
        """
        self.lost_s.append(blocked + max(0.0, window - len(steps) * baseline))
        self.step_mean_x.append(statistics.mean(steps) / baseline if steps else 1.0)
        self.step_p99_x.append(
            sorted(steps)[max(0, -(-len(steps) * 99 // 100) - 1)] / baseline if steps else 1.0
        )
        self.loop_ms.append(baseline * 1e3)

    def to_dict(self, nbytes: int) -> dict[str, Any]:
        b, d = statistics.median(self.blocking_s), statistics.median(self.durable_s)
        out = {"method": self.method, "durable": self.durable, "blocking_s": b, "durable_s": d,
               "runs": len(self.blocking_s),
               "throughput_bytes_per_s": nbytes / d if d > 0 else 0.0}
        if self.lost_s:
            out.update(
                lost_s=statistics.median(self.lost_s),
                step_mean_x=statistics.median(self.step_mean_x),
                step_p99_x=statistics.median(self.step_p99_x),
                loop_ms_per_step=statistics.median(self.loop_ms),
            )
        return out


class BenchTarget:
    """The target folder or URL: where each alternative writes, and how to clean up after it."""

    def __init__(self, env: Env, root: str) -> None:
        self.env, self.root, self.url = env, root, is_url(root)

    def folder(self, alt: Alternative) -> str:
        """A new folder (or prefix) of its own: nothing already in the target is touched."""
        slug = "".join(c if c.isalnum() else "-" for c in alt.name).strip("-")
        if self.url:
            return f"{self.root}/stagesave-bench-{slug}-{uuid.uuid4().hex[:12]}"
        path = os.path.join(self.root, f"stagesave-bench-{slug}-{uuid.uuid4().hex[:12]}")
        fsops.mkdir(path)
        return path

    def remove(self, path: str) -> None:
        if self.url:
            import fsspec

            fs, p = fsspec.core.url_to_fs(path, **self.env.storage_options)
            if fs.exists(p):
                fs.rm(p, recursive=True)
        else:
            fsops.rmtree(path, ignore_errors=True)


def _wait(done: Callable[[], bool], what: str) -> None:
    end = time.perf_counter() + SAVE_TIMEOUT_S
    while not done():
        if time.perf_counter() > end:
            raise CliError(f"{what} did not finish in {SAVE_TIMEOUT_S:.0f} s")
        time.sleep(0.005)


def _one_round(
    alt: Alternative,
    session: Session,
    state: Any,
    folder: str,
    args: argparse.Namespace,
    loop: TrainLoop | None,
    timing: Timing,
    advance: Callable[[float], None],
    nbytes: int,
) -> None:
    """Warm ``session`` up if it reuses something, then measure one save into ``folder``."""
    if alt.warmup and args.warmup > 0:
        for i in range(args.warmup):
            _, done = session.start(state, f"{folder}/warmup-{i}")
            _wait(done, f"{alt.name}: warm-up save")
            session.check()
            advance(nbytes)
        session.after_warmup()
    baseline = loop.baseline() if loop is not None else 0.0
    blocked, done = session.start(state, f"{folder}/ckpt")
    t0 = time.perf_counter()
    steps: list[float] = []
    while loop is not None and not done():
        steps.append(loop.step())
    window = (
        time.perf_counter() - t0 if steps else 0.0
    )  # done before the first step: nothing lost after the call
    _wait(done, f"{alt.name}: save")
    session.check()
    timing.blocking_s.append(blocked)
    # An alternative's own clock (stagesave's telemetry) starts inside its call, so its time to
    # commit can read less than the blocking measured around the call: a save is never durable
    # before it returns.
    durable = session.commit_s() or blocked + (time.perf_counter() - t0)
    timing.durable_s.append(max(blocked, durable))
    if loop is not None:
        timing.add_loop(blocked, window, steps, baseline)
    advance(nbytes)


def measure_round(
    env: Env,
    target: BenchTarget,
    alt: Alternative,
    state: Any,
    args: argparse.Namespace,
    loop: TrainLoop | None,
    timing: Timing,
    advance: Callable[[float], None],
    nbytes: int,
) -> None:
    """Set ``alt`` up in a fresh folder, measure one save, tear it down and remove the folder.

    A failure of the save is reported as such; one of the teardown after a failed save is noted
    and does not hide it; the folder is removed whatever happened.
    """
    folder = target.folder(alt)
    session: Session | None = None
    error: BaseException | None = None
    try:
        session = alt.make(folder, env.storage_options)
        _one_round(alt, session, state, folder, args, loop, timing, advance, nbytes)
    except CliError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001, RUF100 - reported with the alternative's name below
        error = CliError(f"{alt.name} failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
    finally:
        try:
            if session is not None:
                try:
                    session.close()
                except Exception as exc:  # noqa: BLE001, RUF100 - must not hide the save's own error
                    if error is None:
                        error = CliError(
                            f"{alt.name}: tearing it down failed: {type(exc).__name__}: {exc}"
                        )
                        error.__cause__ = exc
                    else:
                        env.say(f"note: tearing down {alt.name} also failed: {exc}", err=True)
        finally:
            target.remove(folder)
    if error is not None:
        raise error
