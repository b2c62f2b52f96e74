"""The ways users save checkpoints today, set up so that ``stagesave bench`` and
``benchmarks/bench_sweep.py`` can run them side by side on the same state.

Each alternative is a :class:`Session` factory plus what a fair comparison must know about it
(how many copies of the state it holds, whether its first save allocates what later ones reuse,
whether "done" means durable). Built in: ``torch.save`` (+ fsync),
``torch.distributed.checkpoint`` ``async_save`` in thread and process mode with its stagers
(``_alt_dcp.py``), and stagesave itself. Integrations add theirs through the
``stagesave.bench_alternatives`` entry-point group (``stagesave.lightning``: Lightning's
``AsyncCheckpointIO``; ``stagesave.accelerate``: ``Accelerator.save_state``), so this package
never imports Lightning or Accelerate itself.
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch

from ..checkpointer import Checkpointer
from ..errors import UsageError
from ..stores import posix as fsops
from ..stores.targets import is_url

__all__ = [
    "ENTRY_POINT_GROUP",
    "Alternative",
    "Session",
    "StageSave",
    "TorchSave",
    "available_alternatives",
    "mem_available_bytes",
]

#: Entry-point group through which integrations contribute alternatives (a callable returning a
#: list).
ENTRY_POINT_GROUP = "stagesave.bench_alternatives"


class Session(abc.ABC):
    """One alternative, set up for saves; ``close`` releases what it holds (buffers, threads)."""

    def __init__(self) -> None:
        self.called_at = 0.0
        self.done_at: float | None = None

    @abc.abstractmethod
    def start(self, state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        """Start one save; the seconds the call blocked, and a poll that says when it is done."""

    def check(self) -> None:
        """Raise the error of the last save, if it failed in the background."""
        return  # an optional hook: nothing to raise unless a subclass saves in the background

    def commit_s(self) -> float | None:
        """Seconds from the last call until the save was complete, as the alternative sees it."""
        return None if self.done_at is None else self.done_at - self.called_at

    def after_warmup(self) -> None:
        """Drop what only the first save needed (e.g. the gloo group that starts DCP's daemon)."""
        return  # an optional hook: most alternatives need nothing after their warm-up

    def close(self) -> None:
        """Release buffers and threads, so the next alternative starts from a clean process."""
        return  # an optional hook: an alternative that holds nothing has nothing to release

    def _mark_done(self, _: Any = None) -> None:
        self.done_at = time.perf_counter()


@dataclass(frozen=True)
class Alternative:
    """A way users save checkpoints today, and what a benchmark must know to run it fairly."""

    name: str
    #: ``make(folder, storage_options)``: a ready session that writes under ``folder``.
    make: Callable[[str, dict[str, Any]], Session]
    copies: float  # full copies of the state it holds while saving (for the memory check)
    warmup: bool  # does the first save allocate what later ones reuse?
    durable: bool  # is "done" after an fsync?
    note: str
    unavailable: Callable[[], str | None] = field(default=lambda: None)
    urls: bool = False  # can it write to an fsspec URL (s3://...)?
    url_name: str | None = None  # its name when it writes to a URL, if that differs

    def label(self, url: bool) -> str:
        """The name to report for a run on a URL target (``url``) or a local folder."""
        return (self.url_name or self.name) if url else self.name


class TorchSave(Session):
    """``torch.save`` into the file, flush and fsync: what a synchronous CheckpointIO does.

    On an fsspec URL the object is complete when the file is closed (no fsync there).
    """

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.storage_options = storage_options or {}

    def start(self, state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        self.called_at = time.perf_counter()
        if is_url(path):
            import fsspec

            with fsspec.open(path, "wb", **self.storage_options) as f:
                torch.save(state, f)
        else:
            fd = fsops.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
                f.flush()
                fsops.fsync(f.fileno())
        self.done_at = time.perf_counter()
        return self.done_at - self.called_at, lambda: True


class StageSave(Session):
    """A stagesave ``Checkpointer`` (one buffer: ``max_pending=1``) with the given options."""

    def __init__(self, storage_options: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__()
        self.ck = Checkpointer(max_pending=1, storage_options=storage_options or None, **options)
        self._handle: Any = None

    def start(self, state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        self.called_at = time.perf_counter()
        self._handle = self.ck.save(state, path)
        return time.perf_counter() - self.called_at, self._handle.done

    def check(self) -> None:
        if self._handle is not None:
            self._handle.result()

    def commit_s(self) -> float | None:
        return None if self._handle is None else float(self._handle.result().time_to_commit_s)

    def close(self) -> None:
        self.ck.close()


def _builtin() -> list[Alternative]:
    from ._alt_dcp import DcpAsync, gloo_unavailable, pinned_unavailable

    def dcp(process: bool, stager: str | None) -> Callable[[str, dict[str, Any]], Session]:
        return lambda base, _options: DcpAsync(base, process=process, stager=stager)

    return [
        Alternative("torch.save+fsync", lambda base, options: TorchSave(options), 0.0, False, True,
                    "synchronous, as TorchCheckpointIO / Accelerate save (plus fsync)",
                    urls=True, url_name="torch.save"),
        Alternative("dcp.async_save thread", dcp(False, None), 1.0, False, True,
                    "as a plain call: a fresh staged copy per save"),
        Alternative("dcp.async_save thread (reused stager)", dcp(False, "reused"), 1.0, True, True,
                    "one DefaultStager kept across saves"),
        Alternative("dcp.async_save process", dcp(True, None), 2.0, True, True,
                    "daemon process; staged copy moved to shared memory per save",
                    gloo_unavailable),
        Alternative("dcp.async_save process (shm stager)", dcp(True, "shm"), 1.0, True, True,
                    "daemon process; reused shared-memory stager", gloo_unavailable),
        Alternative("dcp.async_save process (pinned+shm stager)", dcp(True, "pinned+shm"),
                    1.0, True, True, "daemon process; reused pinned shared-memory stager",
                    pinned_unavailable),
        Alternative("stagesave", lambda base, options: StageSave(options), 1.0, True, True,
                    "max_pending=1, default options (a writer agent process; host state: "
                    "hashed in the staging copy)", urls=True),
        Alternative("stagesave checksum_in=staging",
                    lambda base, options: StageSave(options, checksum_in="staging"), 1.0, True,
                    True, "max_pending=1; hashed in the staging copy: the default for host state",
                    urls=True),
        Alternative("stagesave checksum_in=background",
                    lambda base, options: StageSave(options, checksum_in="background"), 1.0,
                    True, True, "max_pending=1; the writer threads hash as they write", urls=True),
        Alternative("stagesave writer=process",
                    lambda base, options: StageSave(options, writer="process"), 1.0, True, True,
                    "max_pending=1; a writer agent process writes from shared memory (the "
                    "default)", urls=True),
        Alternative("stagesave writer=thread",
                    lambda base, options: StageSave(options, writer="thread"), 1.0, True, True,
                    "max_pending=1; this process's threads write (no writer agent)", urls=True),
    ]


def _failed_plugin(name: str, exc: BaseException) -> Alternative:
    def make(base: str, options: dict[str, Any]) -> Session:
        raise UsageError(f"{name}: {exc}") from exc

    def unavailable() -> str:
        return f"its entry point could not be loaded: {type(exc).__name__}: {exc}"

    return Alternative(f"{name} (failed to load)", make, 0.0, False, False, "entry point failed",
                       unavailable=unavailable)


def available_alternatives(*, plugins: bool = True) -> list[Alternative]:
    """The built-in alternatives, then those the installed integrations contribute.

    An integration whose entry point fails to load (e.g. ``stagesave.lightning`` without
    Lightning installed) is listed as ``NAME (failed to load)``, with the reason as
    ``unavailable``. ``plugins=False``: the built-in ones only (nothing else is imported).
    """
    alts = _builtin()
    if plugins:
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            try:
                alts.extend(ep.load()())
            except Exception as exc:  # noqa: BLE001, RUF100 - one broken plugin must not hide the rest
                alts.append(_failed_plugin(ep.name, exc))
    return alts


def mem_available_bytes() -> int | None:
    """Memory available to a new allocation, or ``None`` if unknown.

    The kernel's estimate (``MemAvailable``), capped by this process's cgroup v2 limit when it
    has one (a container's limit is lower than what the host has free).
    """
    available: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        with open("/proc/self/cgroup") as f:
            group = next(
                (line.strip().split("::", 1)[1] for line in f if line.startswith("0::")), None
            )
        if group is not None:
            base = os.path.join("/sys/fs/cgroup", group.lstrip("/"))
            with open(os.path.join(base, "memory.max")) as f:
                limit = f.read().strip()
            with open(os.path.join(base, "memory.current")) as f:
                current = int(f.read().strip())
            if limit != "max":
                room = max(0, int(limit) - current)
                available = room if available is None else min(available, room)
    except (OSError, ValueError, IndexError):
        pass
    return available
