"""The trainer's side of a writer agent (``writer="process"``).

:class:`AgentClient` starts the agent at the first staging buffer (a new interpreter,
``subprocess``: fork-and-exec, never a fork that keeps running this process's CUDA state), tells
it about each shared segment, hands it orders and reads its replies. :class:`Writer` decides
where a save's job runs: a save staged in a segment is handed to the agent *before* ``save()``
returns (once the order is in the socket, the save survives this process), and the job left in
this process's queue waits for the agent's reply, so ordering, handles, failures, telemetry and
the process-wide view of pending saves stay what they are with the in-process writer.

If the agent dies, every save it had not answered is written and committed by this process from
the same shared buffer (a save it had committed is then written again: the same bytes), one
warning says so, and later saves are written in this process.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

from .. import errors
from .._crash import AGENT_ENV_VAR as AGENT_CRASH_ENV
from .._crash import ENV_VAR as CRASH_ENV
from ..errors import CheckpointError, UsageError
from ..ondisk.signing import current as signing_keys
from ..saving.files import FileToWrite
from ..saving.image import FileImage
from ..saving.jobs import SaveSpec
from ..saving.pipeline import Job
from ..saving.seal import blank_fill
from ..stores.base import Store
from ..stores.fsspec import FsspecStore
from ..stores.local import LocalStore
from ..stores.s3 import S3Store
from . import wire

__all__ = ["WRITERS", "AgentClient", "AgentLost", "Writer", "writer_choice"]

#: The choices of ``writer``.
WRITERS = ("thread", "process")
_ENV = "STAGESAVE_WRITER"

#: Started with a bare ``stagesave`` package (its ``__init__`` imports torch; the agent needs
#: only the torch-free write-and-commit path).
_BOOT = (
    "import sys, types; pkg = types.ModuleType('stagesave'); pkg.__path__ = [{path!r}]; "
    "sys.modules['stagesave'] = pkg; from stagesave.agent.serve import main; main()"
)


def writer_choice(writer: str | None) -> str:
    """``writer``, else ``$STAGESAVE_WRITER``, else ``"process"``; checked."""
    chosen = writer if writer is not None else os.environ.get(_ENV, "process")
    if chosen not in WRITERS:
        source = "writer" if writer is not None else f"${_ENV}"
        raise ValueError(f"{source} must be 'thread' or 'process', got {chosen!r}")
    return chosen


class AgentLost(CheckpointError):
    """The writer agent died (or could not start); its saves are written in this process."""


class _Ticket:
    __slots__ = ("event", "id", "lost", "reply")

    def __init__(self) -> None:
        self.id = -1
        self.event = threading.Event()
        self.reply: wire.Reply | None = None
        self.lost: str | None = None


class AgentClient:
    """One writer agent: started on first use, stopped by :meth:`close`."""

    def __init__(self, io_threads: int, quiet: bool = False) -> None:
        """``quiet``: the writer was not asked for (the default), so no warning when a segment
        cannot be had (the save is staged in private memory and written in the trainer)."""
        self.io_threads = io_threads
        self.quiet = quiet
        #: the process this client serves: a forked child's copy tells the agent nothing
        self._owner_pid = os.getpid()
        self.proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._tickets: dict[int, _Ticket] = {}
        self._codec = wire.LayoutCodec()
        self._next = 0
        self._lost: str | None = None
        self._closing = False
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def lost(self) -> str | None:
        """Why the agent is gone (``None`` while it serves)."""
        return self._lost

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # fault injection (tests): the agent's crash point is its own variable, so that a
        # trainer writing in-process after the agent's crash does not reach it too
        env.pop(CRASH_ENV, None)
        if os.environ.get(AGENT_CRASH_ENV):
            env[CRASH_ENV] = os.environ[AGENT_CRASH_ENV]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT.format(path=package), str(theirs.fileno()),
                 str(os.getpid()), str(self.io_threads)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,  # a Ctrl-C meant for training does not stop the writes
            )
        except OSError as exc:
            mine.close()
            self._lost = f"it could not be started: {exc}"
            raise AgentLost(f"stagesave: the writer agent {self._lost}") from exc
        finally:
            theirs.close()
        self._sock = mine
        self._reader = threading.Thread(target=self._read, name="stagesave-agent-replies",
                                        daemon=True)
        self._reader.start()

    def _read(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                reply = wire.recv(sock)
            except Exception:  # noqa: BLE001 - a reply that does not parse: the agent is broken
                reply = None
            if not isinstance(reply, wire.Reply):
                self._mark_lost()
                return
            with self._lock:
                ticket = self._tickets.pop(reply.id, None)
            if ticket is not None:
                ticket.reply = reply
                ticket.event.set()

    def _mark_lost(self) -> None:
        proc = self.proc
        code = None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=2.0)
        with self._lock:
            if self._closing and not self._tickets:
                return
            if code is None:
                why = "stopped answering"
            elif code < 0:
                why = f"was killed by signal {-code}"
            else:
                why = f"exited with status {code}"
            self._lost = f"(pid {self.pid}) {why}"
            tickets, self._tickets = self._tickets, {}
        for t in tickets.values():
            t.lost = self._lost
            t.event.set()

    def _send(self, message: object, images: list[FileImage] | None = None) -> None:
        if os.getpid() != self._owner_pid:  # a forked child: the agent is the parent's
            raise AgentLost("stagesave: the writer agent serves the process this one was "
                            "forked from")
        with self._lock:
            if self._lost is not None:
                raise AgentLost(f"stagesave: the writer agent {self._lost}")
            if self.proc is None:
                if self._closing:  # a buffer made ahead announcing its segment after close()
                    raise AgentLost("stagesave: the writer agent was closed before it started")
                self._start()
        sock = self._sock
        assert sock is not None
        try:
            with self._send_lock:  # layouts are encoded in the order the agent decodes them
                before = dict(self._codec.last)
                try:
                    if isinstance(message, wire.Order) and images is not None:
                        for of, image in zip(message.files, images):
                            of.layout = self._codec.encode(of.key, image)
                    data = wire.dumps(message)
                except Exception:
                    self._codec.last = before  # nothing was sent: the agent saw no change
                    raise
                wire.send_bytes(sock, data)
        except OSError as exc:
            self._mark_lost()
            raise AgentLost(f"stagesave: the writer agent {self._lost}") from exc

    def announce(self, path: str) -> None:
        """A new segment: the agent removes it if this process dies (unless it keeps it)."""
        with contextlib.suppress(AgentLost):
            self._send(("segment", path))

    def forget(self, path: str) -> None:
        """A segment this process removes: the agent lets go of its mapping."""
        if self.proc is not None and self._lost is None and not self._closing:
            with contextlib.suppress(AgentLost):
                self._send(("drop", path))

    def submit(self, order: wire.Order, images: list[FileImage]) -> _Ticket:
        """Hand ``order`` over, with the layout of each file's image; once this returns, the
        save survives this process.

        Raises:
            AgentLost: the agent is gone (nothing was handed over).
        """
        ticket = _Ticket()
        with self._lock:
            order.id = ticket.id = self._next
            self._next += 1
            self._tickets[order.id] = ticket
        try:
            self._send(order, images)
        except BaseException:
            with self._lock:
                self._tickets.pop(order.id, None)
            raise
        return ticket

    def go(self, ticket: _Ticket) -> None:
        """The trainer's writer reached this order's job: the agent may run it now (its commit
        keeps its place among this process's removals and actions). A lost agent is noticed by
        the ticket."""
        with contextlib.suppress(AgentLost):
            self._send(("go", ticket.id))

    def close(self, timeout: float | None = None) -> None:
        """Ask the agent to exit after its orders; wait for it (killed after ``timeout``).
        Nothing in a forked child (the agent serves the parent)."""
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            self._closing = True  # also when none was started: none may be started after this
            proc = self.proc
        if proc is None:
            return
        if self._lost is None:
            with contextlib.suppress(AgentLost):
                self._send(("exit",))
        try:
            proc.wait(timeout=timeout if timeout is not None else 60.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._sock is not None:
            self._sock.close()
        if self._reader is not None:
            self._reader.join(timeout=5.0)


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
                job.commit(pool)  # from the same shared buffer, in this process
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
                   key=job.key)

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

