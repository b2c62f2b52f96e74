"""Reusable host buffers with back-pressure.

A fresh allocation per save costs page faults on every byte (measured here: a copy into a reused
buffer runs at ~7 GB/s, a clone into fresh memory at ~2.6 GB/s), so staging buffers are kept and
reused. Buffers are page-aligned (O_DIRECT needs it) and pinned when CUDA is available (so
device-to-host copies can run without blocking). At most ``max_pending`` buffers exist; a save
that finds them all busy waits for one, and the wait is reported in its telemetry.
:class:`StagingMemory` is the one owner of a Checkpointer's staging memory, host and device.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import ClosedError
from ..ondisk.names import ALIGNMENT

__all__ = [
    "Bounces", "BufferPool", "HostBuffer", "Lease", "SegmentHooks", "StagingMemory",
]

#: Buffers grow in steps of this many bytes, so that slightly larger saves reuse them.
GROWTH_STEP = 64 * 1024 * 1024


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

    def release_memory(self) -> None:
        if self.segment is not None:
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
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, nbytes: int, timeout: float | None = None) -> tuple[HostBuffer, float]:
        """A buffer of at least ``nbytes``; waits while every buffer is in use.

        Returns:
            The buffer and the seconds spent waiting for it.

        Raises:
            TimeoutError: no buffer became free within ``timeout``.
        """
        need = _round_up(max(nbytes, ALIGNMENT), ALIGNMENT)
        t0 = time.perf_counter()
        with self._cond:
            while not self._free and self._count >= self.max_buffers:
                if self._closed:
                    raise ClosedError(
                        "the staging buffers were released (the Checkpointer was closed)"
                    )
                if not self._cond.wait(timeout=timeout):
                    raise TimeoutError(f"no staging buffer became free within {timeout} s")
            waited = time.perf_counter() - t0
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

    def _allocate(self, capacity: int) -> HostBuffer:
        if self.segments is None:
            return HostBuffer.allocate(capacity, self.pinned)
        try:
            return HostBuffer.allocate(capacity, self.pinned, shared=True)
        except OSError as exc:  # no room in the RAM filesystem (a container's 64 MiB /dev/shm)
            if not self._warned_shared and not self.segments.quiet:
                self._warned_shared = True
                warnings.warn(
                    f"stagesave: no shared-memory segment of {capacity / 2**20:.0f} MiB for the "
                    f"writer agent ({exc}); saves that need one stage in private memory and are "
                    "written by this process, as with writer='thread' (give the RAM filesystem "
                    "more room: docker run --shm-size, or set STAGESAVE_SHM_DIR)",
                    RuntimeWarning, stacklevel=5,
                )
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
            self._cond.notify_all()
        for b in free:
            self._free_memory(b)

    def _free_memory(self, buf: HostBuffer) -> None:
        if self.segments is not None and buf.segment is not None:
            self.segments.forget(buf.segment)
        buf.release_memory()


class Lease:
    """One staging buffer taken from :class:`StagingMemory`, held until :meth:`give_back`."""

    __slots__ = ("buf", "device", "pool", "waited_s")

    def __init__(
        self, pool: BufferPool, buf: HostBuffer, device: torch.device | None, waited_s: float
    ) -> None:
        self.pool, self.buf, self.device, self.waited_s = pool, buf, device, waited_s

    def give_back(self) -> None:
        self.pool.release(self.buf)


class StagingMemory:
    """Every staging buffer of one Checkpointer, in one owner.

    Host buffers (pinned when asked) and, with ``device_staging``, buffers in each CUDA
    device's memory, at most ``max_buffers`` of each kind in flight. A device without room
    for a save's buffer is an optimization that failed, never a failed save: that save stages
    in host memory, a warning says so once, and saves at least that large stage in host memory
    from then on (a failed CUDA allocation first empties the allocator's cache, which training
    would pay for at every save).
    """

    def __init__(
        self, max_buffers: int, pinned: bool | None, segments: SegmentHooks | None = None
    ) -> None:
        self.host = BufferPool(max_buffers, pinned, segments=segments)
        self.devices: dict[torch.device, BufferPool] = {}
        self._no_room: dict[torch.device, int] = {}  # smallest size that found no room
        self._warned = False
        self._lock = threading.Lock()
        self._closed = False

    @property
    def max_buffers(self) -> int:
        return self.host.max_buffers

    def lease(self, nbytes: int, device: torch.device | None = None) -> Lease:
        """A buffer of at least ``nbytes``: on ``device`` when it has room, else in host memory.

        Waits while ``max_buffers`` of that kind are in flight.

        Raises:
            ClosedError: released by :meth:`close`.
        """
        if device is not None and nbytes >= self._no_room.get(device, nbytes + 1):
            device = None  # this size did not fit on the device before: do not retry every save
        pool = self.host if device is None else self._device_pool(device)
        try:
            buf, waited = pool.acquire(nbytes)
        except torch.OutOfMemoryError as exc:
            if device is None:
                raise
            self._no_room[device] = min(nbytes, self._no_room.get(device, nbytes))
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"device_staging: no room on {device} for a {nbytes / 2**30:.2f} GiB staging "
                    f"buffer ({str(exc).splitlines()[0]}); staging in host memory instead "
                    "(SaveTelemetry.staged_on tells which each save used)",
                    RuntimeWarning,
                    stacklevel=4,
                )
            pool, device = self.host, None
            buf, waited = pool.acquire(nbytes)
        return Lease(pool, buf, device, waited)

    def _device_pool(self, device: torch.device) -> BufferPool:
        """The buffers of ``device`` (created on first use)."""
        with self._lock:
            if self._closed:
                raise ClosedError(
                    "this Checkpointer is closed; create a new one to save or remove checkpoints"
                )
            pool = self.devices.get(device)
            if pool is None:
                pool = self.devices[device] = BufferPool(self.max_buffers, device=device)
            return pool

    def close(self) -> None:
        """Free idle buffers now; buffers in flight are freed when given back."""
        with self._lock:
            self._closed = True
            pools = [self.host, *self.devices.values()]
        for pool in pools:
            pool.close()


class Bounces:
    """Bounce buffers of a write from device memory: one pinned (or page-aligned) host buffer and
    one CUDA stream per writer thread, released by :meth:`close` when the write ends."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        self.local = threading.local()
        self.all: list[HostBuffer] = []
        self.lock = threading.Lock()

    def get(self) -> tuple[HostBuffer, torch.cuda.Stream | None]:
        mine = getattr(self.local, "mine", None)
        if mine is None:
            cuda = self.device.type == "cuda"
            buf = HostBuffer.allocate(self.nbytes, pinned=cuda)
            stream = torch.cuda.Stream(device=self.device) if cuda else None  # type: ignore[no-untyped-call]
            mine = self.local.mine = (buf, stream)
            with self.lock:
                self.all.append(buf)
        return mine

    def to_host(self, src: torch.Tensor) -> memoryview:
        """Copy ``src`` (uint8, contiguous) into this thread's bounce buffer; its bytes."""
        buf, stream = self.get()
        n = src.numel()
        if stream is None:  # host memory (tests, or a CPU "device"): no torch op off-thread
            ctypes.memmove(buf.tensor.data_ptr(), src.data_ptr(), n)
        else:
            with torch.cuda.stream(stream):
                buf.tensor[:n].copy_(src, non_blocking=True)
            stream.synchronize()
        return buf.view[:n]

    def close(self) -> None:
        with self.lock:
            bufs, self.all = self.all, []
        for b in bufs:
            b.release_memory()
