"""Reusable host buffers with back-pressure.

A fresh allocation per save costs page faults on every byte (measured here: a copy into a reused
buffer runs at ~7 GB/s, a clone into fresh memory at ~2.6 GB/s), so staging buffers are kept and
reused. Buffers are page-aligned (O_DIRECT needs it) and pinned when CUDA is available (so
device-to-host copies can run without blocking). At most ``max_pending`` buffers exist; a save
that finds them all busy waits for one, and the wait is reported in its telemetry.
A pool can make the buffer of a save being planned ahead, on a thread (:meth:`BufferPool.prepare`).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import ClosedError
from ..ondisk.names import ALIGNMENT

__all__ = ["BufferPool", "HostBuffer", "SegmentHooks"]

#: Buffers grow in steps of this many bytes, so that slightly larger saves reuse them.
GROWTH_STEP = 64 * 1024 * 1024


#: ``madvise`` advice that maps every page of a range writable now (Linux 5.14+): a buffer made
#: ahead of its first save takes no page faults in that save's copy.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_POPULATE_STEP = 4 << 20


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


@dataclass(eq=False)
class HostBuffer:
    """One page-aligned host buffer: the memory, a memoryview for syscalls, a tensor for copies."""

    capacity: int
    pinned: bool
    view: memoryview
    tensor: torch.Tensor
    _mmap: mmap.mmap | None = field(default=None, repr=False)
    #: ``(base, size, frame)``: the static pieces of ``frame`` sit at ``base`` from the last
    #: staging (see :attr:`.image.FileImage.static`); ``None``: nothing known.
    holds: tuple[int, int, object] | None = field(default=None, repr=False)
    #: The shared segment holding it (``writer="process"``), else ``None``.
    segment: str | None = None
    #: The process that made it: only that one removes its segment (a forked child's copy of
    #: a pool releasing its buffers must not take the parent's segments away).
    owner_pid: int = field(default_factory=os.getpid, repr=False)

    @classmethod
    def allocate(cls, capacity: int, pinned: bool, shared: bool = False) -> HostBuffer:
        """``shared``: in a new private shared-memory segment (:mod:`stagesave.agent.segments`)
        that a writer agent maps too; pinned by registering it with CUDA."""
        if shared:
            from ..agent.segments import create_segment, remove_segment

            path, mem = create_segment(capacity)
            tensor = torch.frombuffer(mem, dtype=torch.uint8, count=capacity)
            if pinned:
                try:
                    _host_register(tensor.data_ptr(), capacity)
                except BaseException:
                    del tensor
                    mem.close()
                    remove_segment(path)
                    raise
            return cls(capacity, pinned, memoryview(mem), tensor, mem, segment=path)
        if pinned:
            tensor = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            view = tensor.numpy().data.cast("B")
            return cls(capacity, True, view, tensor)
        mem = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(mem)
        tensor = torch.frombuffer(mem, dtype=torch.uint8, count=capacity)
        return cls(capacity, False, view, tensor, mem)

    @classmethod
    def on_device(cls, capacity: int, device: torch.device) -> HostBuffer:
        """A buffer in a device's memory (device staging): a tensor only, no host view."""
        tensor = torch.empty(capacity, dtype=torch.uint8, device=device)
        return cls(capacity, False, memoryview(b""), tensor)

    def populate(self, until: threading.Event) -> None:
        """Map the buffer's pages now, until ``until`` is set, so that the first copy into it
        takes fewer page faults (on Linux; elsewhere, or on an older kernel, nothing happens).
        The copy's threads fault pages in faster than this one thread maps them: a save that
        needs the buffer sets ``until``."""
        if self._mmap is None or sys.platform != "linux":
            return
        base, madvise = self.tensor.data_ptr(), _libc().madvise  # ctypes lets go of the GIL
        # in steps: the process's own mmap calls (malloc) wait while a step holds its map's lock
        for at in range(0, self.capacity, _POPULATE_STEP):
            if until.is_set():
                return
            n = min(_POPULATE_STEP, self.capacity - at)
            if madvise(ctypes.c_void_p(base + at), ctypes.c_size_t(n), _MADV_POPULATE_WRITE):
                return  # an older kernel (EINVAL): the copy faults the pages in

    def release_memory(self) -> None:
        if self.segment is not None and os.getpid() == self.owner_pid:
            from ..agent.segments import remove_segment

            if self.pinned:
                _host_unregister(self.tensor.data_ptr())
            remove_segment(self.segment)
        self.view.release()
        del self.tensor
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a tensor view is still alive somewhere; let GC reclaim it
                pass


def _host_register(address: int, nbytes: int) -> None:
    """Pin ``nbytes`` of host memory at ``address`` for CUDA (``cudaHostRegister``)."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    code = cudart.cudaHostRegister(address, nbytes, 0)
    if int(code) != 0:
        raise OSError(f"cudaHostRegister of a {nbytes}-byte staging segment failed: {code}")


def _host_unregister(address: int) -> None:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    cudart.cudaHostUnregister(address)


class SegmentHooks(Protocol):
    """Told about each shared segment a pool creates and removes (the writer agent).

    ``quiet``: no warning when a segment cannot be created (the writer agent is the default,
    not asked for).
    """

    quiet: bool

    def announce(self, path: str) -> None: ...

    def forget(self, path: str) -> None: ...


class BufferPool:
    """At most ``max_buffers`` host buffers, handed out one per in-flight save."""

    def __init__(
        self, max_buffers: int, pinned: bool | None = None, device: torch.device | None = None,
        segments: SegmentHooks | None = None,
    ) -> None:
        """``device``: hand out buffers in that device's memory instead (see ``device_staging``);
        ``segments``: host buffers in shared segments, announced to it."""
        self.segments = segments
        self._warned_shared = False
        if max_buffers < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_buffers}")
        self.max_buffers = max_buffers
        self.device = device
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._free: list[HostBuffer] = []
        self._count = 0  # buffers that exist or are being made
        self._maker: threading.Thread | None = None  # making a buffer ahead (see prepare)
        self._wanted = threading.Event()  # a save waits for the buffer being made
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, nbytes: int, timeout: float | None = None) -> tuple[HostBuffer, float]:
        """A buffer of at least ``nbytes``; waits while every buffer is in use.

        Returns:
            The buffer and the seconds spent waiting for it.

        Raises:
            TimeoutError: no buffer became free within ``timeout``.
        """
        maker = self._maker  # made ahead for this save (see prepare): its thread ends first
        try:
            return self._acquire(nbytes, timeout)
        finally:
            if maker is not None:
                maker.join()

    def _acquire(self, nbytes: int, timeout: float | None) -> tuple[HostBuffer, float]:
        need = _round_up(max(nbytes, ALIGNMENT), ALIGNMENT)
        t0 = time.perf_counter()
        making = 0.0  # waiting for the buffer being made is not waiting for a busy one
        with self._cond:
            while (not self._free and self._count >= self.max_buffers) or (
                    self._maker is not None and all(b.capacity < need for b in self._free)):
                self._wanted.set()
                if self._closed:
                    raise ClosedError(
                        "the staging buffers were released (the Checkpointer was closed)"
                    )
                w0, busy = time.perf_counter(), self._maker is None
                if not self._cond.wait(timeout=timeout):
                    raise TimeoutError(f"no staging buffer became free within {timeout} s")
                making += 0.0 if busy else time.perf_counter() - w0
            waited = time.perf_counter() - t0 - making
            if self._free:
                # Prefer the smallest buffer that fits; otherwise regrow the largest one.
                fitting = [b for b in self._free if b.capacity >= need]
                buf = (
                    min(fitting, key=lambda b: b.capacity)
                    if fitting
                    else max(self._free, key=lambda b: b.capacity)
                )
                self._free.remove(buf)
                if buf.capacity >= need:
                    return buf, waited
                self._count -= 1
                old: HostBuffer | None = buf
            else:
                old = None
            self._count += 1
        if old is not None:
            self._free_memory(old)
        try:
            capacity = _round_up(need, GROWTH_STEP)
            if self.device is not None:
                return HostBuffer.on_device(capacity, self.device), waited
            buf = self._allocate(capacity)
            if self.segments is not None and buf.segment is not None:
                self.segments.announce(buf.segment)
            return buf, waited
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def prepare(self, bounds: Callable[[], tuple[int, int] | None], *,
                only_when_empty: bool = False) -> None:
        """Make, on a thread of its own, the buffer a save being planned will lease, sized by
        ``bounds()`` (its least and most bytes; asked only when a buffer may be made): its
        reservation and page mapping (:meth:`HostBuffer.populate`) overlap the planning, and
        :meth:`acquire` waits for it. Nothing when a free buffer holds the least bytes (or, with
        ``only_when_empty``, when any is free), none may be added, or one is being made. With
        no room for a shared segment it is made in private memory, as a save's would be (with
        the same warning); any other failure is dropped (the save's :meth:`acquire` allocates
        again and reports it)."""
        if self.device is not None or not self._may_make(only_when_empty):
            return
        found = bounds()
        if found is None:
            return
        least = _round_up(max(found[0], ALIGNMENT), ALIGNMENT)
        with self._cond:
            if not self._may_make(only_when_empty) or any(
                    b.capacity >= least for b in self._free):
                return
            old: HostBuffer | None = None
            if self._free:  # regrow the largest free buffer, as acquire would
                old = max(self._free, key=lambda b: b.capacity)
                self._free.remove(old)
            else:
                self._count += 1
            capacity = _round_up(max(least, found[1]), GROWTH_STEP)
            self._wanted.clear()
            # pinned on the caller's device (a rank's own GPU), not on a new thread's device 0
            cuda = torch.cuda.current_device() if (
                self.pinned and torch.cuda.is_initialized()) else None  # type: ignore[no-untyped-call]
            self._maker = threading.Thread(target=self._make, args=(old, capacity, cuda),
                                           name="stagesave-buffer", daemon=True)
            self._maker.start()

    def _may_make(self, only_when_empty: bool) -> bool:
        if self._closed or self._maker is not None:
            return False
        return not self._free and self._count < self.max_buffers if only_when_empty else (
            bool(self._free) or self._count < self.max_buffers)

    def _make(self, old: HostBuffer | None, capacity: int, cuda: int | None) -> None:
        buf: HostBuffer | None = None
        try:
            if cuda is not None:
                torch.cuda.set_device(cuda)
            if old is not None:
                self._free_memory(old)
            buf = self._allocate(capacity)  # private (with a warning) without room for shared
            if self.segments is not None and buf.segment is not None:
                self.segments.announce(buf.segment)
            buf.populate(until=self._wanted)
        except Exception:  # noqa: BLE001 - acquire allocates again and raises or warns
            if buf is not None:
                self._free_memory(buf)
            buf = None
        with self._cond:
            self._maker = None
            closed = self._closed
            if buf is None or closed:
                self._count -= 1
            else:
                self._free.append(buf)
            self._cond.notify_all()
        if closed and buf is not None:
            self._free_memory(buf)

    def _allocate(self, capacity: int) -> HostBuffer:
        if self.segments is None:
            return HostBuffer.allocate(capacity, self.pinned)
        try:
            return HostBuffer.allocate(capacity, self.pinned, shared=True)
        except OSError as exc:  # no room in the RAM filesystem (a container's 64 MiB /dev/shm)
            if not self._warned_shared and not self.segments.quiet:
                warnings.warn(
                    f"stagesave: no shared-memory segment of {capacity / 2**20:.0f} MiB for the "
                    f"writer agent ({exc}); saves that need one stage in private memory and are "
                    "written by this process, as with writer='thread' (give the RAM filesystem "
                    "more room: docker run --shm-size, or set STAGESAVE_SHM_DIR)",
                    RuntimeWarning, stacklevel=5,
                )
                self._warned_shared = True  # (after: a warning raised as an error is raised again)
            return HostBuffer.allocate(capacity, self.pinned)

    def release(self, buf: HostBuffer) -> None:
        """Give a buffer back for reuse."""
        with self._cond:
            if self._closed:
                self._count -= 1
                self._free_memory(buf)
            else:
                self._free.append(buf)
            self._cond.notify()

    def regrow(self, buf: HostBuffer, nbytes: int) -> HostBuffer:
        """``buf``, leased, made again at ``nbytes`` or more in its place (as many buffers as
        before; raises, and counts it gone, when the allocation fails)."""
        self._free_memory(buf)
        try:
            new = self._allocate(_round_up(_round_up(max(nbytes, ALIGNMENT), ALIGNMENT),
                                           GROWTH_STEP))
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise
        if self.segments is not None and new.segment is not None:
            self.segments.announce(new.segment)
        return new

    def in_use(self) -> int:
        with self._cond:
            return self._count - len(self._free)

    def total_bytes(self) -> int:
        with self._cond:
            return sum(b.capacity for b in self._free)

    def close(self) -> None:
        """Free the idle buffers; buffers still in use are freed when released."""
        with self._cond:
            self._closed = True
            free, self._free = self._free, []
            self._count -= len(free)
            maker = self._maker
            self._wanted.set()
            self._cond.notify_all()
        for b in free:
            self._free_memory(b)
        if maker is not None:  # it frees what it made, seeing the pool closed
            maker.join()

    def _free_memory(self, buf: HostBuffer) -> None:
        if self.segments is not None and buf.segment is not None:
            self.segments.forget(buf.segment)
        buf.release_memory()

