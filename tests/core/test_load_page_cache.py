"""A verified local load reads chunks the page cache holds through it, the others with O_DIRECT
(:mod:`stagesave.restore.residency`)."""

from __future__ import annotations

import fcntl
import mmap
import os

import pytest
import torch
from helpers import assert_same

import stagesave
from stagesave.restore.residency import cached_pages, mostly_cached

CHUNK = 1 << 20


def _drop(path: str) -> None:
    """Evict the file's pages from the page cache (clean pages go: the file was fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_buffered(path: str, n: int | None = None) -> None:
    """Read the file (its first ``n`` bytes) through the page cache, without read-ahead."""
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        f.read() if n is None else f.read(n)


def _pages(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        got = cached_pages(fd, os.path.getsize(path))
    finally:
        os.close(fd)
    assert got is not None
    return got


@pytest.fixture
def reads(monkeypatch):
    """Each ``os.preadv`` of the load: ``(offset, bytes asked, through O_DIRECT)``."""
    seen: list[tuple[int, int, bool]] = []
    preadv = os.preadv

    def spy(fd, buffers, offset):
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        seen.append((offset, sum(len(b) for b in buffers), direct))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", spy)
    return seen


def test_cached_pages_follow_the_page_cache(tmp_path):
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(os.urandom(8 * mmap.PAGESIZE))
    _drop(path)
    assert _pages(path) == bytes(8)
    _read_buffered(path, 3 * mmap.PAGESIZE)
    cached = _pages(path)
    assert cached == b"\x01\x01\x01" + bytes(5)
    assert mostly_cached(cached, 0, 3 * mmap.PAGESIZE)
    page = mmap.PAGESIZE
    assert mostly_cached(cached, 0, 6 * page) and not mostly_cached(cached, 0, 7 * page)
    assert not mostly_cached(cached, 3 * mmap.PAGESIZE, 5 * mmap.PAGESIZE)
    _read_buffered(path)
    assert _pages(path) == b"\x01" * 8
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    fd = os.open(empty, os.O_RDONLY)
    try:
        assert cached_pages(fd, 100) is None
    finally:
        os.close(fd)


def test_a_load_reads_cached_chunks_through_the_cache_and_the_rest_from_disk(ckpt_dir, reads):
    state = {f"w{i}": torch.randn(262_144) for i in range(8)}  # 8 MiB: 8 chunks
    with stagesave.Checkpointer(ckpt_dir, chunk_bytes=CHUNK) as ck:
        ck.save(state, "a.ckpt").result()
        path = os.path.join(ckpt_dir, "a.ckpt")
        size = os.path.getsize(path)

        _drop(path)
        assert_same(ck.load("a.ckpt"), state)
        cold = [r for r in reads if r[1] >= CHUNK]
        assert cold and all(direct for _, _, direct in cold)  # nothing cached: the disk

        _read_buffered(path)  # all cached (a restart right after a save, a second load)
        reads.clear()
        assert_same(ck.load("a.ckpt"), state)
        big = [r for r in reads if r[1] >= CHUNK // 2]
        assert big and not any(direct for _, _, direct in big)

        _drop(path)
        _read_buffered(path, size // 2)  # the first half cached
        reads.clear()
        assert_same(ck.load("a.ckpt"), state)
        chunks = {off: direct for off, n, direct in reads if n >= CHUNK // 2}
        assert not chunks[0]  # the first chunk through the cache
        assert chunks[max(chunks)]  # the last one from the disk
        assert sorted(chunks.values()).count(True) >= 2


def test_a_cached_chunk_is_checked_as_any_other(ckpt_dir):
    state = {"w": torch.randn(1_048_576)}
    with stagesave.Checkpointer(ckpt_dir, chunk_bytes=CHUNK) as ck:
        ck.save(state, "a.ckpt").result()
        path = os.path.join(ckpt_dir, "a.ckpt")
        with open(path, "r+b") as f:  # a flipped byte, in the page cache
            data = f.read()
            at = data.find(state["w"].numpy().tobytes()[:64]) + 2 * CHUNK + 12_345
            f.seek(at)
            f.write(bytes([data[at] ^ 1]))
        assert _pages(path).count(0) == 0
        with pytest.raises(stagesave.IntegrityError, match="checksum mismatch"):
            ck.load("a.ckpt")
