"""Bounce buffers of a write from device memory (GPUDirect-less device writes)."""

from __future__ import annotations

import ctypes
import threading

import torch

from .buffers import HostBuffer

__all__ = ["Bounces"]


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
