"""Where a save's job runs: this process's threads, or its writer agent (``writer="process"``).

A save staged in a shared segment is handed to the agent *before* ``save()`` returns (once the
order is in the socket, the save survives this process), and the job left in this process's
queue waits for the agent's reply, so ordering, handles, failures, telemetry and the
process-wide view of pending saves stay what they are with the in-process writer.

If the agent dies, every save it had not answered is written and committed by this process from
the same shared buffer (a save it had committed is then written again: the same bytes), the
temporaries the agent left for it are removed, one warning says so, and later saves are written
in this process.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import os
import pickle
import time
import warnings
from collections.abc import Iterator
from typing import Any

from .. import errors
from ..errors import CheckpointError, UsageError
from ..ondisk.signing import current as signing_keys
from ..restore.debris import match_temporary
from ..restore.liveness import pid_alive
from ..saving.files import FileToWrite
from ..saving.jobs import SaveSpec
from ..saving.pipeline import Job
from ..saving.seal import blank_fill
from ..stores import posix as fsops
from ..stores.base import Store
from ..stores.fsspec import FsspecStore
from ..stores.local import LocalStore
from ..stores.s3 import S3Store
from . import wire
from .client import _ENV, AgentClient, AgentLost, writer_choice

__all__ = ["Writer"]


@contextlib.contextmanager
def _open_pool(pool: cf.Executor) -> Iterator[cf.Executor]:
    """``pool``, or threads of its own while ``pool`` refuses work (shut by a ``close()`` that
    gave up waiting while this save was still the agent's)."""
    if not getattr(pool, "_shutdown", False):
        yield pool
        return
    with cf.ThreadPoolExecutor(2, thread_name_prefix="stagesave-io") as own:
        yield own


def _remove_leftovers(store: Store, name: str, staging_dir: str | None, pid: int) -> None:
    """Remove the temporaries a writer agent that died (``pid``) left while it wrote ``name``
    (a file, or a folder beside its target or inside ``staging_dir``), now that this process
    wrote it: what ``stagesave gc`` would remove, found by the names stagesave gives them.
    Nothing where the agent still runs, or for stores without local paths."""
    path = store.local_path(name)
    if path is None or pid_alive(pid):
        return
    directory, leaf = os.path.split(path.rstrip("/"))
    for place in (directory, staging_dir):
        if place is None:
            continue
        try:
            entries = os.listdir(place)
        except OSError:
            continue
        for entry in entries:
            full = os.path.join(place, entry)
            is_dir = os.path.isdir(full) and not os.path.islink(full)
            m = match_temporary(entry, is_dir=is_dir)
            if m is None or m.group("pid") != str(pid) or m.group("data") != leaf:
                continue
            with contextlib.suppress(OSError):
                if is_dir:
                    fsops.rmtree(full)
                else:
                    fsops.unlink(full)


def _error(name: str, message: str) -> CheckpointError:
    """The agent's failure as the error class it reported (a checkpoint error)."""
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, CheckpointError):
        try:
            return cls(message)
        except TypeError:
            pass
    return errors.StorageError(message)


def _as_staged(files: list[FileToWrite]) -> None:
    """Undo what a dead agent may have written into the shared buffer (zip CRC fields, a
    safetensors proof in its header): the proof's place back to spaces, the CRCs to be computed
    again from the bytes as they are."""
    for f in files:
        blank = f.image.blank
        if blank is not None and f.view is not None:
            f.view[blank[0] : blank[0] + blank[1]] = blank_fill(blank[1])
        f.crcs = None


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _eligible(store: Store) -> bool:
    """Stores another process reaches the same way: local paths, S3, fsspec URLs (not
    ``memory://``, which is this process's own)."""
    if type(store) is FsspecStore:
        return not store.url.startswith("memory://")
    return type(store) in (LocalStore, S3Store)


class Writer:
    """Where a Checkpointer's saves are written: its own threads, or a writer agent."""

    def __init__(self, writer: str | None, io_threads: int, device_staging: bool) -> None:
        self.mode = writer_choice(writer)
        #: Asked for by the option or ``$STAGESAVE_WRITER`` rather than the default: only then
        #: does a save that cannot go to the agent (no room for a segment, an order that cannot
        #: be pickled) warn. An agent that dies always warns.
        self.explicit = writer is not None or _ENV in os.environ
        if self.mode == "process" and device_staging and writer is None:
            self.mode = "thread"  # the default and $STAGESAVE_WRITER yield to an explicit option
        if self.mode == "process" and device_staging:
            raise UsageError(
                "writer='process' cannot write device_staging saves (their bytes stay in GPU "
                "memory, which no other process can read): choose one of the two"
            )
        self.agent = (AgentClient(io_threads, quiet=not self.explicit)
                      if self.mode == "process" else None)
        self._warned = False

    def route(self, job: Job, settings: Any) -> Job:
        """``job``, or a job that waits for the agent to write it (handed over now).

        Handed over: saves staged in a shared segment, to a local, S3 or fsspec store.
        ``settings``: the Checkpointer (checksum, chunk size, ``keep_last``).
        """
        agent, spec = self.agent, job.spec
        staged: Any = job.staged
        if agent is None or not isinstance(spec, SaveSpec):
            return job
        if agent.lost is not None:
            self._warn(f"stagesave: the writer agent {agent.lost}")
            return job
        lease: Any = getattr(staged, "lease", None)
        segment = None if lease is None else lease.buf.segment
        if segment is None or staged.device is not None or not _eligible(spec.store):
            return job
        staged.wait()  # every byte is in the segment before the agent may write it
        tel = job.handle.telemetry
        tel.blocking_s = time.perf_counter() - spec.t_start
        base = _address(lease.buf.view)
        order = wire.Order(
            id=-1, kind=spec.kind, store=spec.store, name=spec.name, segment=segment,
            files=[wire.OrderFile(f.name, f.entry_name or "", {}, _address(f.view) - base,
                                  f.crcs, f.entry_name) for f in staged.files],
            checksum=settings.checksum, chunk_bytes=settings.chunk_bytes,
            keep_last=settings.keep_last, meta=spec.meta, telemetry=tel.to_dict(),
            t_start=spec.t_start, staging_dir=spec.staging_dir, nested=list(spec.nested),
            signing=signing_keys(),
        )
        try:
            ticket = agent.submit(order, [f.image for f in staged.files])
        except AgentLost as exc:
            self._warn(str(exc))
            return job
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            self._warn(f"stagesave: a save to {spec.store.describe(spec.name)} cannot be handed "
                       f"to the writer agent ({type(exc).__name__}: {exc})", lost=False)
            return job

        def commit(pool: cf.Executor) -> None:
            agent.go(ticket)
            ticket.event.wait()
            if ticket.lost is not None:
                self._warn(f"stagesave: the writer agent {ticket.lost}")
                _as_staged(staged.files)
                with _open_pool(pool) as threads:  # close(timeout) may have shut the queue's
                    job.commit(threads)  # from the same shared buffer, in this process
                if agent.pid is not None:
                    _remove_leftovers(spec.store, spec.name, spec.staging_dir, agent.pid)
                if job.retire is not None:
                    job.retire()
                return
            reply = ticket.reply
            assert reply is not None
            for key, value in reply.telemetry.items():
                if hasattr(tel, key) and key not in ("path", "started_at", "blocking_s"):
                    setattr(tel, key, value)
            if reply.error is not None:
                raise _error(*reply.error)

        return Job(job.handle, job.what, commit, staged=job.staged, on_error=job.on_error,
                   key=job.key, settle=lambda accepted: agent.settle(ticket, accepted))

    def _warn(self, why: str, *, lost: bool = True) -> None:
        if self._warned or (not lost and not self.explicit):
            return
        self._warned = True
        then = ("its saves not yet committed are written by this process from the same shared "
                "buffer, and so are later saves (as with writer='thread')" if lost else
                "such saves are written by this process (as with writer='thread')")
        warnings.warn(f"{why}; {then}", RuntimeWarning, stacklevel=2)

    def close(self, timeout: float | None = None) -> None:
        if self.agent is not None:
            self.agent.close(timeout)

