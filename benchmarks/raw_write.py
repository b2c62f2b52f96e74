"""The disk's own write speed, and what it costs a training loop: a floor for any checkpoint writer.

Writes ``NBYTES`` to ``PATH`` with O_DIRECT in 64 MiB requests from one buffer filled once, then
fsyncs, and prints the seconds that took. Unlike ``dd if=/dev/zero``, nothing is read or
zero-filled between the writes (dd's reads of /dev/zero clear 64 MiB of memory before every
write, CPU time that is not the write's). Run as a separate process by ``bench_sweep.py``, once
alone (the write floor) and once beside the training loop (what the bare write costs the loop).

Usage: python benchmarks/raw_write.py PATH NBYTES
"""

from __future__ import annotations

import mmap
import os
import sys
import time

BLOCK = 64 << 20


def main() -> None:
    path, nbytes = sys.argv[1], int(sys.argv[2])
    buf = mmap.mmap(-1, BLOCK)
    buf.write(os.urandom(1 << 20) * (BLOCK >> 20))
    count = max(1, -(-nbytes // BLOCK))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        t0 = time.perf_counter()
        for i in range(count):
            os.pwritev(fd, [buf], i * BLOCK)
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    print(f"{dt * nbytes / (count * BLOCK):.6f}")


if __name__ == "__main__":
    main()
