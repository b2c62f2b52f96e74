"""One conformance suite for the Store contract, run against every store.

The same tests drive a local directory, ``memory://`` (the generic fsspec store), ``s3://`` on
the loopback SeaweedFS server, and a tiered store (local tier + that S3 server). Each store is
exercised directly (the contract of ``_store.py``) and through a real Checkpointer.
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import os
import uuid

import pytest
import torch

import stagesave
from stagesave.stores.base import Store
from stagesave.stores.fsspec import FsspecStore
from stagesave.stores.local import LocalStore
from stagesave.stores.s3 import S3Store
from stagesave.stores.tiered import TieredStore

MiB = 1 << 20
#: Big enough for three multipart parts on S3 (part size 5 MiB in these tests), odd length.
BIG = 12 * MiB + 123

STORES = [
    "local",
    "memory",
    "fsspec-file",
    pytest.param("s3", marks=pytest.mark.s3),
    pytest.param("tiered", marks=pytest.mark.s3),
]


def _s3_store(request: pytest.FixtureRequest) -> S3Store:
    url = request.getfixturevalue("s3_url")
    options = request.getfixturevalue("s3_options")
    return S3Store(url, options, part_size=5 * MiB, multipart_threshold=5 * MiB)


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path):
    kind = request.param
    s: Store
    if kind == "local":
        s = LocalStore(str(tmp_path / "root"))
    elif kind == "memory":
        s = FsspecStore(f"memory://conformance-{uuid.uuid4().hex[:8]}")
    elif kind == "fsspec-file":  # the generic store on a filesystem whose pipe is not atomic
        s = FsspecStore(f"file://{tmp_path / 'root'}", {"auto_mkdir": True})
    elif kind == "s3":
        s = _s3_store(request)
    else:
        s = TieredStore(LocalStore(str(tmp_path / "local-tier")), _s3_store(request))
    yield s
    if kind == "memory" and s.fs.exists(s.root):  # type: ignore[attr-defined]
        s.fs.rm(s.root, recursive=True)  # type: ignore[attr-defined]
    s.close()


def _image(size: int, seed: int = 0) -> memoryview:
    """Random bytes in page-aligned memory, like the staging buffers (O_DIRECT needs that)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes()
    mem = mmap.mmap(-1, max(4096, -(-size // 4096) * 4096))
    mem[:size] = data
    return memoryview(mem)[:size]


def _write(
    store: Store, name: str, image: memoryview, size: int, chunk: int = 4 * MiB,
    publish: bool = True,
):
    pending = store.begin_write(name, image, size)
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda lo: pending.write_range(lo, min(size, lo + chunk)),
                      range(0, size, chunk)))
    pending.finish()
    if publish:
        pending.publish()
    return pending


def _read_all(store: Store, name: str) -> bytes:
    return store.read_range(name, 0, store.info(name).size)


def _names(store: Store, prefix: str = "") -> set[str]:
    if isinstance(store, TieredStore):
        store.wait_uploads()  # the remote tier follows in the background
    return {i.name for i in store.list(prefix)}


# ---------------------------------------------------------------------- the Store contract
def test_put_atomic_then_read_ranges(store):
    data = bytes(range(256)) * 40
    store.put_atomic("meta.json", data)
    info = store.info("meta.json")
    assert (info.name, info.size) == ("meta.json", len(data))
    assert info.mtime > 0
    assert _read_all(store, "meta.json") == data
    assert store.read_range("meta.json", 100, 50) == data[100:150]
    assert store.read_range("meta.json", len(data) - 10, 100) == data[-10:]  # short at the end
    assert store.read_range("meta.json", len(data), 10) == b""
    assert store.read_range("meta.json", 5, 0) == b""
    out = bytearray(300)
    assert store.read_into("meta.json", 1000, memoryview(out)) == 300
    assert bytes(out) == data[1000:1300]
    assert "meta.json" in _names(store)


def test_put_atomic_overwrites(store):
    store.put_atomic("m.json", b"first version, longer")
    store.put_atomic("m.json", b"second")
    assert _read_all(store, "m.json") == b"second"


def test_put_atomic_is_never_read_partly_written(store):
    """A reader polling a small object that another thread replaces sees one whole version or
    the other (the DCP coordinator reads markers as soon as it lists them)."""
    size = 8 * MiB
    versions = [bytes([v]) * size for v in (1, 2)]
    store.put_atomic("m.json", versions[0])
    seen: list[tuple[int, set[int]]] = []

    def put() -> None:
        for i in range(6):
            store.put_atomic("m.json", versions[(i + 1) % 2])

    with cf.ThreadPoolExecutor(1) as ex:
        done = ex.submit(put)
        while not done.done() or not seen:
            data = store.read_range("m.json", 0, size + 1)
            seen.append((len(data), set(data[:: 4096]) | set(data[-1:])))
        done.result()
    torn = [(n, vals) for n, vals in seen if n != size or len(vals) != 1]
    assert torn == [], f"{len(torn)} of {len(seen)} reads saw a partly written object"
    assert _read_all(store, "m.json") == versions[0]
    assert _names(store) == {"m.json"}  # no temporary left behind


def test_parallel_write_is_invisible_until_publish(store):
    image = _image(BIG)
    pending = _write(store, "x.ckpt", image, BIG, publish=False)
    with pytest.raises(FileNotFoundError):
        store.info("x.ckpt")
    assert "x.ckpt" not in _names(store)
    pending.publish()
    assert store.info("x.ckpt").size == BIG
    assert _read_all(store, "x.ckpt") == bytes(image)


def test_image_may_extend_past_size(store):
    image = _image(8192 + 777)
    _write(store, "short.bin", image, 5000)
    assert _read_all(store, "short.bin") == bytes(image[:5000])


@pytest.mark.parametrize("size", [0, 1, 4096])
def test_small_and_empty_files(store, size):
    image = _image(max(size, 1))
    _write(store, f"f{size}.bin", image, size)
    assert store.info(f"f{size}.bin").size == size
    assert _read_all(store, f"f{size}.bin") == bytes(image[:size])


def test_publish_replaces_atomically(store):
    old, new = _image(BIG, seed=1), _image(BIG - 5000, seed=2)
    _write(store, "last.ckpt", old, BIG)
    pending = _write(store, "last.ckpt", new, BIG - 5000, publish=False)
    assert _read_all(store, "last.ckpt") == bytes(old)  # readers still see the old version
    pending.publish()
    assert _read_all(store, "last.ckpt") == bytes(new[: BIG - 5000])


def test_abort_leaves_nothing_and_keeps_the_old_file(store):
    store.put_atomic("keep.json", b"{}")
    _write(store, "a.ckpt", _image(1000, seed=3), 1000)
    before = _names(store)
    pending = store.begin_write("a.ckpt", _image(BIG), BIG)
    pending.write_range(0, 4 * MiB)
    pending.abort()
    pending.abort()  # idempotent, never raises
    assert _names(store) == before
    assert _read_all(store, "a.ckpt") == bytes(_image(1000, seed=3))
    fresh = store.begin_write("never.ckpt", _image(100), 100)
    fresh.abort()
    with pytest.raises(FileNotFoundError):
        store.info("never.ckpt")


def test_read_into_large_range(store):
    image = _image(BIG, seed=4)
    _write(store, "big.bin", image, BIG)
    out = bytearray(BIG)
    assert store.read_into("big.bin", 0, memoryview(out)) == BIG
    assert out == image
    tail = bytearray(1 * MiB)
    assert store.read_into("big.bin", BIG - 1000, memoryview(tail)) == 1000
    assert tail[:1000] == image[BIG - 1000 :]


def test_list_direct_children_and_dirs(store):
    for name in ("a/b/c.json", "a/d.json", "e.json"):
        store.put_atomic(name, b"x")
    assert _names(store) == {"e.json"}
    assert _names(store, "a") == {"a/d.json"}
    assert _names(store, "a/b") == {"a/b/c.json"}
    assert sorted(store.list_dirs()) == ["a"]
    assert sorted(store.list_dirs("a")) == ["b"]
    assert store.list("nope") == []
    assert store.list_dirs("nope") == []


def test_info_of_missing_and_of_directory(store):
    with pytest.raises(FileNotFoundError):
        store.info("missing.ckpt")
    store.put_atomic("dir/inner.json", b"x")
    with pytest.raises(IsADirectoryError):
        store.info("dir")


def test_delete(store):
    store.put_atomic("gone.json", b"x")
    store.delete("gone.json")
    with pytest.raises(FileNotFoundError):
        store.info("gone.json")
    store.delete("gone.json")  # absent is not an error
    store.delete("never-existed.json")


@pytest.mark.parametrize(
    "bad", ["../escape", "/abs/path", "a/../b", "a//b", "", "s3://x/y", "a\\b", "."]
)
def test_names_that_could_escape_are_refused(store, bad):
    with pytest.raises(ValueError, match="invalid checkpoint name"):
        store.put_atomic(bad, b"x")
    with pytest.raises(ValueError, match="invalid checkpoint name"):
        store.begin_write(bad, _image(10), 10)
    with pytest.raises(ValueError, match="invalid checkpoint name"):
        store.read_range(bad, 0, 1)


def test_describe_names_the_object_without_credentials(store, request):
    where = store.describe("sub/x.ckpt")
    assert where.endswith("sub/x.ckpt")
    if isinstance(store, (S3Store, TieredStore)):
        options = request.getfixturevalue("s3_options")
        for text in (where, store.url, repr(store.url)):
            assert options["secret"] not in text and options["key"] not in text


# ---------------------------------------------------------------------- through a Checkpointer
def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3 * MiB // 4, generator=g)  # 3 MiB of float32
    return {"w": w, "tied": w[:10], "b": torch.arange(7), "step": seed, "name": "run"}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def test_checkpointer_save_load_latest_verify(store):
    with stagesave.Checkpointer(store, chunk_bytes=1 * MiB) as ckpt:
        ckpt.save(_state(1), "step-1.ckpt").result()
        ckpt.save(_state(2), "step-2.ckpt").result()
        latest = ckpt.latest()  # verifies by default
        assert latest is not None and latest.name == "step-2.ckpt" and latest.status == "verified"
        cheap = ckpt.latest(verify=False)  # the proof read and checked, not the bytes
        assert cheap is not None and cheap.name == "step-2.ckpt" and cheap.status == "committed"
        loaded = ckpt.load("step-2.ckpt")
        assert _same(loaded, _state(2))
        tied, w = loaded["tied"].untyped_storage(), loaded["w"].untyped_storage()
        assert tied.data_ptr() == w.data_ptr()
        assert ckpt.verify("step-1.ckpt").status == "verified"
        assert [c.name for c in ckpt.list()] == ["step-2.ckpt", "step-1.ckpt"]


def test_checkpointer_overwrite_leaves_exactly_the_file(store):
    with stagesave.Checkpointer(store, chunk_bytes=1 * MiB) as ckpt:
        ckpt.save(_state(1), "last.ckpt").result()
        ckpt.save(_state(2), "last.ckpt").result()
        assert _same(ckpt.load("last.ckpt"), _state(2))
        assert ckpt.verify("last.ckpt").status == "verified"
    assert _names(store) == {"last.ckpt"}


def test_checkpointer_retention_and_remove(store):
    with stagesave.Checkpointer(store, keep_last=2, chunk_bytes=1 * MiB) as ckpt:
        for i in range(4):
            ckpt.save(_state(i), f"s{i}.ckpt")
        ckpt.wait()
        assert [c.name for c in ckpt.list()] == ["s3.ckpt", "s2.ckpt"]
        ckpt.remove("s2.ckpt").result()
        assert [c.name for c in ckpt.list()] == ["s3.ckpt"]
    assert _names(store) == {"s3.ckpt"}


def test_checkpointer_directory_checkpoint(store):
    files = {"model.bin": {"w": torch.arange(1000.0)}, "optimizer.bin": {"m": torch.ones(10)}}
    with stagesave.Checkpointer(store, chunk_bytes=1 * MiB) as ckpt:
        ckpt.save_dir(files, "checkpoint_0").result()
        info = ckpt.verify("checkpoint_0")
        assert info.status == "verified" and info.is_dir
        assert torch.equal(ckpt.load("checkpoint_0/model.bin")["w"], torch.arange(1000.0))
        assert [c.name for c in ckpt.list()] == ["checkpoint_0"]


def test_checkpointer_detects_a_corrupt_copy(store):
    with stagesave.Checkpointer(store, chunk_bytes=1 * MiB) as ckpt:
        ckpt.save(_state(5), "c.ckpt").result()
        size = store.info("c.ckpt").size
        data = _image(size)
        data[:] = store.read_range("c.ckpt", 0, size)
        data[size // 2] ^= 0xFF
        target = store.local if isinstance(store, TieredStore) else store
        _write(target, "c.ckpt", data, size)
        with pytest.raises(stagesave.IntegrityError, match="checksum mismatch"):
            ckpt.load("c.ckpt")
        assert ckpt.verify("c.ckpt").status == "corrupt"


def test_sizes_are_reported_in_telemetry(store):
    seen = []
    with stagesave.Checkpointer(store, telemetry_callback=seen.append) as ckpt:
        tel = ckpt.save(_state(3), "t.ckpt").result()
    # a tiered store's upload reports to the same callback (tier="remote") when it finishes,
    # which may be before or after the Checkpointer closes
    assert [t for t in seen if t.tier != "remote"] == [tel] and tel.error is None
    uploads = [t for t in seen if t.tier == "remote"]
    assert all(t.error is None and os.fspath(t.path).endswith("t.ckpt") for t in uploads)
    assert tel.bytes == store.info("t.ckpt").size
    assert os.fspath(tel.path).endswith("t.ckpt")
