"""Writer threads or a writer process? Training time lost per save for each way of writing.

Issue #7 asks for "a writer process fed through shared memory if threads cannot reach the
targets — measure both". Side by side, on one training loop (``bench_interference.Loop``, torch's
default threads) and with ``bench_interference.measure`` (lost = blocking + the loop's throughput
lost while the write runs), this runs:

- ``stagesave``: the core as it is (a job thread + 4 niced I/O threads: 32 MiB chunks, xxh3 of
  each chunk then an O_DIRECT ``pwrite`` of it, in the same pass; fsync; manifest; rename);
- ``writer process``: the prototype below. The state is copied on the training thread into a
  page-aligned shared-memory buffer (an ``mmap`` of a ``memfd``); a long-lived process started
  once (``spawn``; it never imports torch, checked) at nice 10 writes it with O_DIRECT in 32 MiB
  chunks from 4 threads, hashing each chunk with xxh3_128 in the same pass, fsyncs, renames, and
  reports back over a pipe;
- ``thread O_DIRECT``: the very same write function as the process, run by niced threads of the
  training process (the control that isolates "thread or process");
- ``thread buffered``: the same with plain buffered ``pwrite`` + fsync (page cache);
- ``thread buffered+DONTNEED``: buffered, but each chunk is pushed out with ``sync_file_range``
  and dropped with ``posix_fadvise(DONTNEED)`` right after it is written (what to do where
  O_DIRECT is refused).

Every prototype stages with the same torch copies into a reused buffer (the staging copy is the
same cost for all), hashes every chunk, and writes with the same chunking and threads as
stagesave, so they differ only in where the write runs and how it reaches the disk. Per save
we report blocking, background duration, lost, mean/p99 step inflation, the CPU seconds of the
writer (threads: utime+stime of their ``/proc/self/task/<tid>/stat``; process: of
``/proc/<pid>/stat``; kernel flusher threads are not counted) and the loop's baseline ms/it
before the save and after it (1 s after the write finished). One unmeasured save per
alternative comes first (buffers touched, threads and the process started).

Usage: python benchmarks/bench_writer.py [--gib 2] [--repeats 3] [--alternatives a,b] [--dir D]
"""

from __future__ import annotations

# Only the standard library and xxhash at module level: the writer process imports this module
# (multiprocessing "spawn") and must stay free of torch. torch and the benchmarks' helpers are
# imported inside the functions that run in the training process.
import abc
import argparse
import concurrent.futures as cf
import ctypes
import errno
import mmap
import multiprocessing as mp
import os
import resource
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import xxhash

ALIGN = 4096
CHUNK = 32 * 1024 * 1024  # stagesave's default chunk
THREADS = 4  # stagesave's default io_threads
NICE = 10  # stagesave's background nice value
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4
_TICK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ the write itself (no torch)
def lower_priority() -> None:
    """Nice the calling thread (Linux applies nice per thread), like stagesave's threads."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), NICE))
    except OSError:
        pass


def _sync_file_range() -> Callable[[int, int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)  # CDLL calls release the GIL
    fn = libc.sync_file_range
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def write_image(path: str, view: memoryview, size: int, mode: str, pool: cf.Executor) -> list[str]:
    """Write ``view[:size]`` to ``path`` durably and atomically; return the chunk digests.

    ``mode`` is ``"direct"`` (O_DIRECT, lengths padded to 4096 then truncated), ``"buffered"``
    (page cache, one fsync at the end) or ``"dontneed"`` (buffered, every chunk written back with
    ``sync_file_range`` and dropped from the page cache with ``posix_fadvise``). Each chunk is
    hashed (xxh3_128) and then written by one of ``pool``'s threads.
    """
    tmp = os.path.join(
        os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp"
    )
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    fd = os.open(tmp, flags | (_O_DIRECT if mode == "direct" else 0), 0o644)
    sfr = _sync_file_range() if mode == "dontneed" else None
    try:
        def one(i: int) -> str:
            lo, hi = i * CHUNK, min(size, (i + 1) * CHUNK)
            d = xxhash.xxh3_128_hexdigest(view[lo:hi])
            if mode == "direct":
                hi = min(len(view), (hi + ALIGN - 1) // ALIGN * ALIGN)
            pos = lo
            while pos < hi:
                pos += os.pwrite(fd, view[pos:hi], pos)
            if sfr is not None:
                if sfr(fd, lo, hi - lo, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER) != 0:
                    raise OSError(ctypes.get_errno(), "sync_file_range failed")
                os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
            return d

        digests = list(pool.map(one, range((size + CHUNK - 1) // CHUNK)))
        if mode == "direct" and size % ALIGN:
            os.ftruncate(fd, size)
        os.fsync(fd)
        if mode == "dontneed":
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return digests


def writer_process(conn: Connection, parent: int, memfd: int, capacity: int) -> None:
    """The writer process: map the parent's memfd, then write one image per request.

    A request is ``(path, size, mode)``; the reply is a dict with the digests, the seconds the
    write took, the CPU seconds this process used for it, and whether torch got imported here.
    ``None`` ends the process.
    """
    os.nice(NICE)
    fd = os.open(f"/proc/{parent}/fd/{memfd}", os.O_RDWR)
    buf = mmap.mmap(fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)
    view = memoryview(buf)
    with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="wp-io") as pool:
        while True:
            request = conn.recv()
            if request is None:
                break
            path, size, mode = request
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            try:
                digests = write_image(path, view, size, mode, pool)
                error = None
            except OSError as exc:
                digests, error = [], f"{type(exc).__name__}: {exc}"
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            conn.send({"digests": digests, "error": error, "write_s": time.perf_counter() - t0,
                       "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
                       "torch_imported": "torch" in sys.modules})
    view.release()
    buf.close()


# ------------------------------------------------------------------ CPU accounting
def task_ticks(tids: list[int], pid: str = "self") -> dict[int, int]:
    """utime + stime, in clock ticks, of each thread ``tid`` of ``pid`` that still exists."""
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[tid] = int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)
    return out


def process_cpu_s(pid: int) -> float:
    """utime + stime of every thread of process ``pid``, in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def threads_named(prefix: str) -> list[int]:
    return [
        t.native_id
        for t in threading.enumerate()
        if t.name.startswith(prefix) and t.native_id is not None
    ]


# ------------------------------------------------------------------ writers (training process)
class Layout:
    """Where each tensor of a state goes in the image: 4096-aligned offsets, computed once."""

    def __init__(self, tensors: list[Any]) -> None:
        self.tensors = tensors
        self.offsets, off = [], 0
        for t in tensors:
            self.offsets.append(off)
            off += (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
        self.size = off

    def stage(self, target: Any) -> None:
        """Copy every tensor into the uint8 tensor ``target`` (torch splits large copies over
        threads)."""
        import torch

        for t, off in zip(self.tensors, self.offsets):
            n = t.numel() * t.element_size()
            target[off : off + n].copy_(t.reshape(-1).view(torch.uint8))


class Writer(abc.ABC):
    """One way of writing: ``start(state, path)`` -> (blocking seconds, done poll)."""

    name = ""

    @abc.abstractmethod
    def start(self, state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        raise NotImplementedError

    @abc.abstractmethod
    def cpu_s(self) -> float:
        """CPU seconds the writer used so far (its threads or process)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class StagesaveWriter(Writer):
    """The core as it is, with bench_interference's settings (max_pending=1)."""

    def __init__(self) -> None:
        import bench_interference as bi

        self._start = bi.make_stagesave()
        self._ticks: dict[int, int] = {}

    def start(self, state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        return self._start(state, path)

    def cpu_s(self) -> float:
        self._ticks.update(task_ticks(threads_named("stagesave")))
        return sum(self._ticks.values()) / _TICK

    def close(self) -> None:
        self._start.close()  # type: ignore[attr-defined]


class _Staged:
    """A reused page-aligned buffer, its layout and a torch view for the staging copies."""

    def __init__(self, state: Any, buf: mmap.mmap) -> None:
        import common
        import torch

        self.layout = Layout(common.tensors_of(state))
        self.view = memoryview(buf)
        self.tensor = torch.frombuffer(buf, dtype=torch.uint8)
        self.tensor.fill_(0)  # touch every page now, not during the first save


def _capacity(state: Any) -> int:
    import common

    return Layout(common.tensors_of(state)).size


_PRIVATE: list[_Staged] = []


def _private_staging(state: Any) -> _Staged:
    """One private anonymous buffer (like stagesave's pool), shared by the thread writers.

    They never write at the same time (each save finishes before the next alternative starts),
    so one buffer serves all three and the run needs 2 GiB less memory per thread writer.
    """
    if not _PRIVATE:
        buf = mmap.mmap(-1, _capacity(state), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _PRIVATE.append(_Staged(state, buf))
    return _PRIVATE[0]


class ThreadWriter(Writer):
    """``write_image`` run by a job thread and a pool of niced threads of this process."""

    def __init__(self, state: Any, mode: str) -> None:
        self.mode = mode
        self.name = f"thread {mode}"
        self.staged = _private_staging(state)
        self.job = cf.ThreadPoolExecutor(
            1, thread_name_prefix=f"proto-{mode}-job", initializer=lower_priority
        )
        self.pool = cf.ThreadPoolExecutor(
            THREADS, thread_name_prefix=f"proto-{mode}-io", initializer=lower_priority
        )
        self._ticks: dict[int, int] = {}
        self.digests: list[str] = []

    def start(self, state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        t0 = time.perf_counter()
        self.staged.layout.stage(self.staged.tensor)
        size = self.staged.layout.size
        fut = self.job.submit(write_image, path, self.staged.view, size, self.mode, self.pool)
        blocking = time.perf_counter() - t0

        def done() -> bool:
            if not fut.done():
                return False
            self.digests = fut.result()  # re-raises a write error
            return True

        return blocking, done

    def cpu_s(self) -> float:
        self._ticks.update(task_ticks(threads_named(f"proto-{self.mode}")))
        return sum(self._ticks.values()) / _TICK

    def close(self) -> None:
        self.job.shutdown()
        self.pool.shutdown()


class ProcessWriter(Writer):
    """``write_image`` run by a long-lived writer process fed through a memfd."""

    name = "writer process"

    def __init__(self, state: Any) -> None:
        cap = _capacity(state)
        self.memfd = os.memfd_create("stagesave-bench-image", 0)
        os.ftruncate(self.memfd, cap)
        buf = mmap.mmap(self.memfd, cap, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.staged = _Staged(state, buf)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=writer_process, args=(child, os.getpid(), self.memfd, cap),
                                name="stagesave-bench-writer", daemon=True)
        self.proc.start()
        child.close()
        self.last: dict[str, Any] = {}

    def start(self, state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        t0 = time.perf_counter()
        self.staged.layout.stage(self.staged.tensor)
        self.conn.send((path, self.staged.layout.size, "direct"))
        blocking = time.perf_counter() - t0
        box: list[dict[str, Any]] = []

        def done() -> bool:
            if not box:
                if not self.conn.poll():
                    return False
                box.append(self.conn.recv())
                self.last = box[0]
                if box[0]["error"]:
                    raise OSError(errno.EIO, f"writer process failed: {box[0]['error']}")
                if box[0]["torch_imported"]:
                    raise RuntimeError("the writer process imported torch; the measurement is void")
            return True

        return blocking, done

    def cpu_s(self) -> float:
        assert self.proc.pid is not None
        return process_cpu_s(self.proc.pid)

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)
        os.close(self.memfd)


FACTORIES: dict[str, Callable[[Any], Writer]] = {
    "stagesave": lambda state: StagesaveWriter(),
    "writer process": ProcessWriter,
    "thread O_DIRECT": lambda state: ThreadWriter(state, "direct"),
    "thread buffered": lambda state: ThreadWriter(state, "buffered"),
    "thread buffered+DONTNEED": lambda state: ThreadWriter(state, "dontneed"),
}


# ------------------------------------------------------------------ the benchmark
@dataclass
class Sample:
    blocking: float
    window: float
    lost: float
    meanx: float
    p99x: float
    cpu_s: float
    before_ms: float
    after_ms: float


def verify(path: str, digests: list[str]) -> None:
    """Read ``path`` back and check its chunk digests (a development check, ``--verify``)."""
    with open(path, "rb") as f:
        got = [xxhash.xxh3_128_hexdigest(c) for c in iter(lambda: f.read(CHUNK), b"")]
    if got != digests:
        raise AssertionError(
            f"{path}: {len(got)} chunks read back do not match the {len(digests)} written"
        )


def clear(directory: str) -> None:
    """Remove everything a save left in ``directory`` (files, manifests, temporaries)."""
    for leftover in os.listdir(directory):
        p = os.path.join(directory, leftover)
        if os.path.isdir(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)


def one_save(loop: Any, w: Writer, state: Any, path: str, baseline_s: float) -> Sample:
    import bench_interference as bi

    before_ms = loop.baseline(baseline_s) * 1e3
    c0 = w.cpu_s()
    m = bi.measure(loop, w.start, state, path, before_ms / 1e3)
    cpu = w.cpu_s() - c0
    time.sleep(1.0)
    after_ms = loop.baseline(baseline_s) * 1e3
    return Sample(
        m["blocking"], m["window"], m["lost"], m["meanx"], m["p99x"], cpu, before_ms, after_ms
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--alternatives", default=",".join(FACTORIES), help="comma-separated names")
    ap.add_argument(
        "--dir", default=None, help="directory to write to (default: a temp dir under /work)"
    )
    ap.add_argument("--baseline-s", type=float, default=2.0, help="seconds per loop baseline")
    ap.add_argument(
        "--verify", action="store_true", help="read every prototype file back and check it"
    )
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_interference as bi
    import common
    import torch

    names = [n for n in args.alternatives.split(",") if n]
    for n in names:
        if n not in FACTORIES:
            ap.error(f"unknown alternative {n!r}; known: {', '.join(FACTORIES)}")
    base = args.dir or tempfile.mkdtemp(
        prefix="stagesave-writer-", dir="/work" if os.path.isdir("/work") else None
    )
    state = common.transformer_state(int(args.gib * (1 << 30)))
    nbytes = common.state_bytes(state)
    floor = common.copy_floor_s(state)
    raw = common.raw_write_floor_s(base, nbytes)
    loop = bi.Loop()
    print(
        f"state {nbytes / 2**30:.2f} GiB; copy floor {floor:.3f} s; dd O_DIRECT floor {raw:.2f} s "
        f"({nbytes / raw / 1e6:.0f} MB/s); torch threads {torch.get_num_threads()}",
        flush=True,
    )
    writers = {n: FACTORIES[n](state) for n in names}
    results: dict[str, list[Sample]] = {n: [] for n in names}
    loop_start_ms = loop.baseline(args.baseline_s) * 1e3
    try:
        for r in range(-1, args.repeats):  # r == -1: the unmeasured warm-up save
            for n in names:  # interleaved, so drift of the machine hits every alternative alike
                path = os.path.join(base, f"w{names.index(n)}-{r + 1}.bin")
                s = one_save(loop, writers[n], state, path, args.baseline_s if r >= 0 else 0.3)
                w = writers[n]
                if args.verify and isinstance(w, ThreadWriter):
                    verify(path, w.digests)
                elif args.verify and isinstance(w, ProcessWriter):
                    verify(path, w.last["digests"])
                if r >= 0:
                    results[n].append(s)
                clear(base)
            print(f"{'warm-up' if r < 0 else f'repeat {r + 1}/{args.repeats}'} done", flush=True)
    finally:
        for w in writers.values():
            w.close()
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    loop_end_ms = loop.baseline(args.baseline_s) * 1e3
    print(
        f"\nloop ms/it at the start {loop_start_ms:.1f}, at the end {loop_end_ms:.1f}; "
        f"copy floor {floor:.3f} s; dd O_DIRECT floor {raw:.2f} s for {nbytes / 2**30:.2f} GiB; "
        f"medians of {args.repeats}\n"
    )
    print(
        "| writer | loop ms/it before | after | blocking s | background s | lost per save s | lost "
        "/ copy floor | mean step x | p99 step x | writer CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        xs = results[n]

        def med(k: str, xs: list[Sample] = xs) -> float:
            return float(statistics.median(float(getattr(x, k)) for x in xs))

        print(
            f"| {n} | {med('before_ms'):.1f} | {med('after_ms'):.1f} | {med('blocking'):.3f} | "
            f"{med('window'):.2f} | {med('lost'):.3f} (min {min(x.lost for x in xs):.3f}, max "
            f"{max(x.lost for x in xs):.3f}) | {med('lost') / floor:.2f} | {med('meanx'):.2f} | "
            f"{med('p99x'):.2f} | {med('cpu_s'):.2f} |"
        )


if __name__ == "__main__":
    main()
