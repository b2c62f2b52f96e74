"""The writer agent: a process that writes, commits and retires the saves its trainer staged in
shared memory, and finishes them if the trainer dies.

Started by :class:`.client.AgentClient` with one end of a socket pair; imports no torch (the
write-and-commit path is torch-free) and runs no torch op. It runs each order through the same
job code as the in-process writer (:mod:`stagesave.saving.jobs`), at a lower CPU priority.
An order is decoded when it arrives and run when the trainer's writer thread reaches its job
(``("go", id)``), so that the agent's commits keep their place among the trainer's other jobs
(removals, actions queued before a save run before it is committed, as with the in-process
writer). When its trainer is gone (the socket reaches its end, or the trainer's pid is no
longer its parent) it runs every order it was handed, in the order received, keeps the
segment of the newest committed file as a snapshot for a restart (:mod:`.segments`), removes
the other segments it knows, and exits.
"""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import mmap
import os
import queue
import signal
import socket
import struct
import sys
import termios
import threading
import time
from typing import Any

from ..errors import as_checkpoint_error
from ..handle import SaveHandle
from ..ondisk import signing
from ..ondisk.names import ALIGNMENT
from ..saving import jobs
from ..saving.files import FileToWrite
from ..saving.pipeline import BACKGROUND_NICE
from ..telemetry import SaveTelemetry
from . import segments, wire

__all__ = ["main"]

#: Seconds between checks that the trainer is still this process's parent.
WATCH_S = 0.2
#: How long an orphaned agent waits for the end of its socket before it stops reading it (a
#: forked worker of the dead trainer may hold it open).
ORPHAN_GRACE_S = 3.0

_GONE = object()  # the trainer is gone: finish what was handed over, then leave
_EXIT = object()  # the trainer asked this agent to exit (after what was handed over)


def _unread(sock: socket.socket) -> int:
    """Bytes waiting in ``sock`` (0 when that cannot be told)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])
    except OSError:
        return 0


class _Staged:
    """An order's files over the shared segment, as the jobs expect staged files."""

    device = None

    def __init__(self, files: list[FileToWrite]) -> None:
        self.files = files

    def wait(self) -> None:
        pass

    def give_back(self) -> None:
        pass


class _Admitted:
    """An order as it arrived: its files' layouts decoded (or why they could not be)."""

    def __init__(self, order: wire.Order, images: list[Any] | None,
                 error: BaseException | None) -> None:
        self.order, self.images, self.error = order, images, error


class _Settings:
    def __init__(self, order: wire.Order) -> None:
        self.checksum = order.checksum
        self.chunk_bytes = order.chunk_bytes
        self.keep_last = order.keep_last


class Agent:
    """The state of one agent: its segments, its I/O threads, its newest committed file."""

    def __init__(self, sock: socket.socket, trainer_pid: int, io_threads: int) -> None:
        self.sock, self.trainer_pid = sock, trainer_pid
        self.pool = cf.ThreadPoolExecutor(io_threads, thread_name_prefix="stagesave-agent-io")
        self.maps: dict[str, mmap.mmap] = {}
        self.known: set[str] = set()
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.read_to_end = threading.Event()  # the reader met the end of the socket
        self.newest: wire.Reply | None = None
        self.codec = wire.LayoutCodec()
        self.replying = True
        self.held: dict[int, _Admitted] = {}  # arrived, not yet reached by the trainer

    # -------------------------------------------------------------- messages in
    def read(self) -> None:
        while True:
            try:
                msg = wire.recv(self.sock)
            except Exception:  # noqa: BLE001 - a message cut short: nothing after it is readable
                msg = None
            if msg is None:
                self.inbox.put(_GONE)
                self.read_to_end.set()
                return
            self.inbox.put(msg)

    def watch(self) -> None:
        """The trainer may die with its end of the socket still open (inherited by a forked
        worker): its pid stops being this process's parent then.

        Everything it sent before dying must reach the inbox before ``_GONE`` (the last save it
        returned from is an order there). Its socket normally closes with it: the reader then
        reads every message, meets the end and says so itself, however long a busy machine
        takes (a fixed half-second wait here lost the last order when the reader thread was
        not scheduled in time). When the socket stays open, this thread shuts its reading side:
        the reader still reads every byte sent before, then meets the end and says so itself,
        in order (a message cut short by the death ends it the same way).
        """
        while os.getppid() == self.trainer_pid:
            time.sleep(WATCH_S)
        if self.read_to_end.wait(ORPHAN_GRACE_S):
            return
        try:
            self.sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        if self.read_to_end.wait(60):
            return
        # the reader did not wake (it cannot be told to here): the old way, once nothing is
        # left unread
        while _unread(self.sock):
            time.sleep(WATCH_S)
        time.sleep(0.5)  # the reader hands over the message it just read
        self.inbox.put(_GONE)

    # -------------------------------------------------------------- work
    def segment(self, path: str) -> mmap.mmap:
        mem = self.maps.get(path)
        if mem is None:
            mem = self.maps[path] = segments.map_segment(path)
            self.known.add(path)
        return mem

    def drop(self, path: str) -> None:
        self.known.discard(path)
        mem = self.maps.pop(path, None)
        if mem is not None:
            try:
                mem.close()
            except BufferError:
                pass

    def admit(self, order: wire.Order) -> None:
        """Decode ``order``'s layouts now, in arrival order (the codec follows every order the
        trainer sent, whatever fails later), and hold it until the trainer reaches its job."""
        try:
            images = [self.codec.decode(of.key, of.layout) for of in order.files]
            self.held[order.id] = _Admitted(order, images, None)
        except BaseException as exc:  # noqa: BLE001 - reported when the order runs
            self.held[order.id] = _Admitted(order, None, exc)

    def run_held(self, order_id: int | None = None) -> None:
        """Run the held order ``order_id`` (``None``: every held order, in arrival order)."""
        ids = list(self.held) if order_id is None else [order_id]
        for i in ids:
            admitted = self.held.pop(i, None)
            if admitted is None:
                continue
            reply = self.run(admitted)
            if reply.committed is not None:
                self.newest = reply
            self.reply(reply)

    def run(self, admitted: _Admitted) -> wire.Reply:
        order = admitted.order
        tel = SaveTelemetry(**order.telemetry)
        handle = SaveHandle(tel.path, tel)
        views: list[memoryview] = []
        files: list[FileToWrite] = []
        try:
            if admitted.error is not None:
                raise admitted.error
            images = admitted.images
            assert images is not None
            keys = order.signing  # the trainer's keys sign the proofs it asked for
            signing.configure(list(keys.keys) if keys is not None else [],
                              require=keys.require if keys is not None else False)
            whole = memoryview(self.segment(order.segment))
            views.append(whole)
            for of, image in zip(order.files, images):
                # whole pages, as the in-process writer has them: O_DIRECT needs aligned
                # lengths (a folder's files each start on a page of their own)
                end = of.offset + (image.size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
                view = whole[of.offset : min(len(whole), end)]
                views.insert(0, view)
                files.append(FileToWrite(of.name, image, view, of.crcs, None, of.entry_name))
            staged = _Staged(files)
            settings = _Settings(order)
            if order.kind == "file":
                job = jobs.file_job(handle, order.store, order.name, staged, settings=settings,
                                    meta=order.meta, t_start=order.t_start)
            else:
                job = jobs.folder_job(handle, order.store, order.name, staged,
                                      settings=settings, meta=order.meta, t_start=order.t_start,
                                      staging_dir=order.staging_dir, nested=order.nested)
            job.commit(self.pool)
            if job.retire is not None:
                job.retire()
        except BaseException as exc:  # noqa: BLE001 - sent back to the trainer
            err = as_checkpoint_error(exc, f"saving checkpoint {tel.path} failed")
            tel.error = str(err)
            return wire.Reply(order.id, tel.to_dict(), (type(err).__name__, str(err)))
        finally:
            for v in views:
                v.release()
        committed = None
        first = files[0].image if files else None
        if order.kind == "file" and first is not None and first.serialization_id:
            committed = {"segment": order.segment, "path": tel.path,
                         "offset": order.files[0].offset, "covered": first.covered,
                         "length": tel.bytes, "serialization_id": first.serialization_id}
        return wire.Reply(order.id, tel.to_dict(), None, committed)

    def reply(self, reply: wire.Reply) -> None:
        if not self.replying:
            return
        try:
            wire.send(self.sock, reply)
        except OSError:
            self.replying = False  # the trainer is gone; keep writing what it handed over

    def serve(self) -> None:
        threading.Thread(target=self.read, daemon=True).start()
        threading.Thread(target=self.watch, daemon=True).start()
        while True:
            msg = self.inbox.get()
            if msg is _GONE:
                self.finish_orphaned()
                return
            if isinstance(msg, wire.Order):
                self.admit(msg)
            elif isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "go":
                self.run_held(msg[1])
            elif isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "cancel":
                self.held.pop(msg[1], None)  # its save was refused: never written
            elif msg == ("exit",):
                self.run_held()  # the trainer reached them all before asking (or gave up)
                for path in sorted(self.known):  # the trainer removes them too, once this
                    self.drop(path)  # process exited: if it dies in between, they are gone
                    segments.remove_segment(path)
                return
            elif isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "segment":
                self.known.add(msg[1])
            elif isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "drop":
                self.drop(msg[1])

    def finish_orphaned(self) -> None:
        """The trainer died: run every order it handed over (held or still in the inbox), in
        the order received, keep the newest committed file's segment as a snapshot, remove the
        other segments."""
        self.replying = False
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, wire.Order):
                self.admit(msg)
            elif isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "segment":
                self.known.add(msg[1])
            elif isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "cancel":
                self.held.pop(msg[1], None)
        self.run_held()
        keep = self.newest.committed if self.newest is not None else None
        if keep is not None and keep["segment"] not in self.known:
            keep = None  # released by the trainer since (and removed by it)
        for path in sorted(self.known):
            if keep is not None and path == keep["segment"]:
                continue
            self.drop(path)
            segments.remove_segment(path)
        if keep is not None:
            snap = segments.Snapshot(agent_pid=os.getpid(), created_ns=time.time_ns(), **keep)
            try:
                segments.write_snapshot(snap)
            except OSError as exc:
                print(f"stagesave agent: could not keep the snapshot: {exc}", file=sys.stderr)
                segments.remove_segment(keep["segment"])


def main() -> None:
    """Entry point: ``argv`` = socket fd, trainer pid, I/O threads."""
    fd, trainer_pid, io_threads = (int(a) for a in sys.argv[1:4])
    # A job's SIGTERM (SLURM, a preemption) reaches every process of the job: the agent lets the
    # trainer handle it and finishes what it was handed; it exits when its trainer is gone.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(BACKGROUND_NICE)
    except OSError:
        pass
    sock = socket.socket(fileno=fd)
    agent = Agent(sock, trainer_pid, io_threads)
    try:
        agent.serve()
    finally:
        agent.pool.shutdown(wait=True)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)  # daemon reader threads may still block in recv
