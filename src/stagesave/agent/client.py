"""The trainer's side of a writer agent (``writer="process"``).

:class:`AgentClient` starts the agent at the first staging buffer (a new interpreter,
``subprocess``: fork-and-exec, never a fork that keeps running this process's CUDA state), tells
it about each shared segment, hands it orders and reads its replies. :class:`.route.Writer`
decides where a save's job runs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading

from .._crash import AGENT_ENV_VAR as AGENT_CRASH_ENV
from .._crash import ENV_VAR as CRASH_ENV
from ..errors import CheckpointError
from ..saving.image import FileImage
from . import wire

__all__ = ["WRITERS", "AgentClient", "AgentLost", "writer_choice"]

#: The choices of ``writer``.
WRITERS = ("thread", "process")
_ENV = "STAGESAVE_WRITER"
#: How long close() waits for a save racing it to be taken or refused by the queue (its job is
#: submitted microseconds after its order is handed over).
SETTLE_S = 10.0

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
        self._why: str | None = None  # why this process stopped the agent itself
        #: Orders handed over whose job this process's queue has not yet taken or refused.
        self._unsettled: set[int] = set()
        self._settled = threading.Condition()
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
            if self._lost is not None:
                return  # told once (by the reader thread or the sender)
            if self._why is not None:
                why = self._why
            elif code is None:
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
                except BaseException:  # a Ctrl-C too: the next layouts are changes to these
                    self._codec.last = before  # nothing was sent: the agent saw no change
                    raise
                try:
                    wire.send_bytes(sock, data)
                except OSError:
                    raise  # the agent is gone (below)
                except BaseException:
                    # Part of the message may be in the stream (a Ctrl-C inside sendall): the
                    # agent would read the next message from its middle, or wait for the rest.
                    self._abandon()
                    raise
        except OSError as exc:
            self._mark_lost()
            raise AgentLost(f"stagesave: the writer agent {self._lost}") from exc

    def _abandon(self) -> None:
        """The stream to the agent can no longer be read right: kill the agent; its orders
        become this process's to write (their tickets say it was lost)."""
        self._why = "was stopped: a message to it was interrupted midway"  # the reader's too
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
        self._mark_lost()

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
        with self._settled:
            self._unsettled.add(order.id)
        try:
            self._send(order, images)
        except BaseException:
            with self._lock:
                self._tickets.pop(order.id, None)
            with self._settled:
                self._unsettled.discard(order.id)
            raise
        return ticket

    def settle(self, ticket: _Ticket, accepted: bool) -> None:
        """Whether the job of an order handed over was taken by this process's queue. Refused
        (a ``close()`` raced its save): the agent drops the order unwritten (it runs an order
        when told to go, or at exit; :meth:`close` waits for every order to be settled first)."""
        if not accepted:
            with self._lock:
                self._tickets.pop(ticket.id, None)
            with contextlib.suppress(AgentLost):
                self._send(("cancel", ticket.id))
        with self._settled:
            self._unsettled.discard(ticket.id)
            self._settled.notify_all()

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
        with self._settled:  # a save racing close(): its order is confirmed or taken back
            self._settled.wait_for(lambda: not self._unsettled, SETTLE_S)
        if self._lost is None:
            with contextlib.suppress(AgentLost):
                self._send(("exit",))
        try:
            proc.wait(timeout=timeout if timeout is not None else 60.0)
        except subprocess.TimeoutExpired:
            if timeout is not None:
                # Told to exit once its orders are written, it writes them whatever this process
                # does next (its promise: a save handed over survives the trainer). Not killed,
                # and its socket left open: its replies still complete this process's handles.
                return
            proc.kill()  # nothing was left to write (close() waited for every save): it hung
            proc.wait()
        if self._sock is not None:
            self._sock.close()
        if self._reader is not None:
            self._reader.join(timeout=5.0)
