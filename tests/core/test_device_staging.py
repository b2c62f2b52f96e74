"""Device staging (``Checkpointer(device_staging=True)``): the image in device memory, written from
there.

On a machine without CUDA the layout and write code runs with host memory standing in for the
device (the same functions, a CPU "device" buffer, the bounce-buffer writer); the tests marked
``gpu`` run it on a real CUDA device (and through kvikio when it is installed) and skip here.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import warnings
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_stage_and_hash import states

import stagesave
import stagesave.saving.stage_device as device_mod  # device staging without a GPU
import stagesave.saving.staging as staging_mod
from stagesave.saving.buffers import HostBuffer
from stagesave.saving.plan import plan_torch_file
from stagesave.saving.stage import stage_image
from stagesave.saving.stage_device import (
    device_of,
    gpudirect_kvikio,
    stage_on_device,
    write_device_data,
)
from stagesave.saving.write import FileToWrite, WriteStats, write_data
from stagesave.stores.local import LocalStore

CPU = torch.device("cpu")


def _host_image(image, fill):
    buf = HostBuffer.allocate(max(image.size, 4096), pinned=False)
    buf.tensor.fill_(fill)
    stage_image(image, buf)
    return bytes(buf.view[: image.size])


def _device_buffer(image, fill):
    buf = HostBuffer.on_device(image.size + 3 * 4096, CPU)
    buf.tensor.fill_(fill)  # a reused buffer: an older image's bytes everywhere
    return buf


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=states())
def test_device_layout_is_byte_for_byte_the_host_layout(state):
    image = plan_torch_file(state)
    buf = _device_buffer(image, 0xA5)
    assert stage_on_device(image, buf) is None  # host memory: nothing left in flight
    assert bytes(buf.tensor[: image.size].numpy()) == _host_image(image, 0x3C)


def test_device_layout_of_a_large_pickle_and_many_small_pieces():
    # a pickle of > 64 KiB goes up as one copy, the many small headers through the scatter
    state = {"history": list(range(50_000)), "names": [f"param-{i}" for i in range(3000)],
             **{f"t{i}": torch.full((i + 1,), float(i)) for i in range(300)}}
    image = plan_torch_file(state)
    assert max(len(d) for _, d in image.pieces) >= 64 << 10
    buf = _device_buffer(image, 0x5A)
    stage_on_device(image, buf)
    assert bytes(buf.tensor[: image.size].numpy()) == _host_image(image, 0xC3)


def _sealed(store, written, stats):
    """Seal and publish a written file the same way for both paths (same seq, time, metadata)."""
    written.seal(seq=7, created_ns=123_456_789, metadata={"k": 1}, tensors=[], telemetry={})
    written.finish(stats)
    written.publish()


def _host_file(tmp_path, image, chunk, algorithm="crc32"):
    """The file the host path writes for ``image`` (the reference for the device path)."""
    buf = HostBuffer.allocate(max(image.size, 4096) + 4096, pinned=False)
    stage_image(image, buf)
    store = LocalStore(str(tmp_path / "host"))
    stats = WriteStats()
    with cf.ThreadPoolExecutor(2) as pool:
        _sealed(store, write_data(store, FileToWrite("x.pt", image, buf.view), algorithm=algorithm,
                                  chunk_bytes=chunk, pool=pool, stats=stats), stats)
    return (tmp_path / "host" / "x.pt").read_bytes()


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("chunk_pages", [1, 3, 16])
@pytest.mark.parametrize("algorithm", ["crc32", "blake3"])
def test_device_image_written_through_the_bounce_buffer_is_the_host_file(
    tmp_path, direct_io, chunk_pages, algorithm
):
    """Two passes over device memory (CRCs, then fill-in + hash + write) give byte for byte the
    file the host path writes, which loads back equal and verifies."""
    state = {
        "w": torch.randn(300, 77),
        "b": torch.arange(5000, dtype=torch.int16),
        "step": 12,
        "t": torch.randn(64, 64).t(),
        "meta": torch.empty(10, device="meta"),
        "nested": {"x": [1.5, "a"]},
    }
    image = plan_torch_file(state)
    buf = _device_buffer(image, 0xEE)
    stage_on_device(image, buf)
    chunk = chunk_pages * 4096
    store = LocalStore(str(tmp_path / "dev"), direct_io=direct_io)
    stats = WriteStats()
    with cf.ThreadPoolExecutor(3) as pool:
        written = write_device_data(
            store,
            FileToWrite("x.pt", image, None, device_data=buf.tensor),
            algorithm=algorithm,
            chunk_bytes=chunk,
            pool=pool,
            stats=stats,
            kvikio=None,
        )
    assert not (tmp_path / "dev" / "x.pt").exists()  # only the temporary so far
    _sealed(store, written, stats)
    data = (tmp_path / "dev" / "x.pt").read_bytes()
    assert data == _host_file(tmp_path, image, chunk, algorithm)
    assert stats.write_s > 0
    out = torch.load(tmp_path / "dev" / "x.pt", weights_only=True)
    assert (
        torch.equal(out["w"], state["w"])
        and torch.equal(out["b"], state["b"])
        and out["step"] == 12
    )
    assert torch.equal(out["t"], state["t"]) and out["nested"] == {"x": [1.5, "a"]}
    assert zipfile.ZipFile(tmp_path / "dev" / "x.pt").testzip() is None
    assert stagesave.verify(tmp_path / "dev" / "x.pt").status == "verified"
    assert sorted(os.listdir(tmp_path / "dev")) == ["x.pt"]  # no temporary left


def test_a_failing_device_write_leaves_no_temporary_and_no_write_after_the_abort(
    tmp_path, monkeypatch
):
    """ENOSPC from the second chunk's write (injected at ``_fsops.pwrite``, as tests/faults does):
    the error comes out, every other chunk's write has ended before the temporary is removed."""
    import errno
    import threading
    import time

    from stagesave.stores import posix as _fsops

    image = plan_torch_file({"w": torch.randn(1_000_000)})  # 4 MB: 16 chunks of 256 KiB
    buf = _device_buffer(image, 0)
    stage_on_device(image, buf)
    store = LocalStore(str(tmp_path))
    real_pwrite, calls, lock = _fsops.pwrite, [], threading.Lock()
    aborted = threading.Event()

    def pwrite(fd, data, offset):
        with lock:
            calls.append(aborted.is_set())
            n = len(calls)
        if n == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        time.sleep(0.01)  # the other chunks are still writing when the failure comes out
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(_fsops, "pwrite", pwrite)
    real_unlink = _fsops.unlink

    def unlink(path):
        aborted.set()
        real_unlink(path)

    monkeypatch.setattr(_fsops, "unlink", unlink)
    with cf.ThreadPoolExecutor(4) as pool, pytest.raises(OSError, match="No space left on device"):
        write_device_data(
            store,
            FileToWrite("x.pt", image, None, device_data=buf.tensor),
            algorithm="crc32",
            chunk_bytes=256 << 10,
            pool=pool,
            stats=WriteStats(),
            kvikio=None,
        )
    assert aborted.is_set() and os.listdir(tmp_path) == []
    assert len(calls) > 2 and not any(calls)  # no write started after the abort


class _StandInKvikio:
    """kvikio's CuFile contract (``CuFile(path, "r+")``, ``pwrite(buf, size, offset)`` returning a
    future whose ``get()`` is the bytes written, ``close()``) over plain ``os.pwrite`` of host
    memory: kvikio itself needs a GPU and its driver. ``short`` makes the write fall short, a
    storage fault that cannot be caused on purpose."""

    def __init__(self, short: int = 0) -> None:
        self.short = short
        self.opened: list[str] = []
        self.closed_with_pending = False

    def CuFile(self, path, flags):  # kvikio's name
        assert flags == "r+"  # the temporary already exists (fallocated): never truncate it
        kvikio, fd = self, os.open(path, os.O_RDWR)
        self.opened.append(path)

        class Future:
            def __init__(self, n):
                self.n, self.got = n, False

            def get(self):
                self.got = True
                return self.n

        class File:
            def __init__(self):
                self.futures: list[Future] = []

            def pwrite(self, buf, size, file_offset):
                data = bytes(buf.numpy()[:size])
                n = os.pwrite(fd, data[: size - kvikio.short], file_offset)
                self.futures.append(Future(n))
                return self.futures[-1]

            def close(self):
                kvikio.closed_with_pending |= not all(f.got for f in self.futures)
                os.close(fd)

        return File()


@pytest.mark.parametrize("short", [0, 1000])
def test_gpudirect_write_path_with_kvikio_contract(tmp_path, short):
    state = {"w": torch.randn(70_000), "i": torch.arange(999), "step": 3}
    image = plan_torch_file(state)
    buf = _device_buffer(image, 0x11)
    stage_on_device(image, buf)
    kvikio = _StandInKvikio(short)
    store = LocalStore(str(tmp_path / "dev"))
    f = FileToWrite("x.pt", image, None, device_data=buf.tensor)
    covered = image.covered
    with cf.ThreadPoolExecutor(2) as pool:
        if short:
            with pytest.raises(
                OSError,
                match=f"short GPUDirect Storage write: {covered - short} of {covered} bytes",
            ):
                write_device_data(store, f, algorithm="crc32", chunk_bytes=65536, pool=pool,
                                  stats=WriteStats(), kvikio=kvikio)
            assert os.listdir(tmp_path / "dev") == []  # the temporary is gone
        else:
            stats = WriteStats()
            written = write_device_data(store, f, algorithm="crc32", chunk_bytes=65536, pool=pool,
                                        stats=stats, kvikio=kvikio)
            _sealed(store, written, stats)
            # kvikio wrote the image with empty CRC fields; the pages holding them were rewritten
            assert (tmp_path / "dev" / "x.pt").read_bytes() == _host_file(tmp_path, image, 65536)
            assert len(written.entry.chunks) == -(-covered // 65536)
    assert len(kvikio.opened) == 1 and not kvikio.closed_with_pending


def test_device_staging_option_is_validated(tmp_path):
    with pytest.raises(TypeError, match="device_staging must be True or False, got 'yes'"):
        stagesave.Checkpointer(tmp_path, device_staging="yes")


def test_host_state_with_device_staging_is_staged_on_the_host(tmp_path):
    assert device_of([plan_torch_file({"w": torch.ones(3)})], LocalStore(str(tmp_path))) is None
    with stagesave.Checkpointer(tmp_path, device_staging=True) as ck:
        h = ck.save({"w": torch.ones(3)}, "h.pt")
        h.result()
        assert h.telemetry.staged_on == "host" and h.telemetry.gpudirect is None
        assert ck.memory.devices == {}
        assert torch.equal(ck.load("h.pt")["w"], torch.ones(3))


def test_checkpointer_device_path_end_to_end_with_host_memory_as_the_device(tmp_path, monkeypatch):
    """The whole save path of device staging (pool, layout, bounce writes, commit, retention),
    with host memory standing in for the device: no CUDA here, the code is the same."""
    monkeypatch.setattr(staging_mod, "device_of",
                        lambda images, store: CPU if isinstance(store, LocalStore) else None)
    monkeypatch.setattr(device_mod, "gpudirect_kvikio", lambda: None)
    w = torch.randn(512, 1024)
    with stagesave.Checkpointer(
        tmp_path, device_staging=True, keep_last=2, chunk_bytes=1 << 20
    ) as ck:
        for step in range(4):
            before = w.clone()
            h = ck.save({"w": w, "step": step}, f"s{step}.pt")
            w.add_(1)  # the next step changes the tensor in place
            h.result()
            assert h.telemetry.staged_on == "cpu" and h.telemetry.gpudirect is False
        assert [c.name for c in ck.list()] == ["s3.pt", "s2.pt"]
        assert len(ck.memory.devices[CPU]._free) == 1  # one device buffer, reused
        out = ck.load("s3.pt")
        assert out["step"] == 3 and torch.equal(out["w"], before)
    assert stagesave.verify(tmp_path / "s3.pt").status == "verified"


def test_save_dir_device_path_end_to_end_with_host_memory_as_the_device(tmp_path, monkeypatch):
    """save_dir (Accelerate's save_state) through device staging: safetensors and torch files in
    one device buffer, written by the bounce writer, committed as one folder."""
    from safetensors.torch import load_file

    from stagesave.formats import Safetensors

    monkeypatch.setattr(staging_mod, "device_of",
                        lambda images, store: CPU if isinstance(store, LocalStore) else None)
    monkeypatch.setattr(device_mod, "gpudirect_kvikio", lambda: None)
    weights = {"a": torch.randn(300, 70), "b": torch.arange(4099, dtype=torch.int32)}
    optim = {"state": {0: {"exp_avg": torch.randn(300, 70), "step": torch.tensor(5.0)}}, "lr": 0.1}
    with stagesave.Checkpointer(tmp_path, device_staging=True, chunk_bytes=64 << 10) as ck:
        h = ck.save_dir({"model.safetensors": Safetensors(weights), "optimizer.bin": optim,
                         "scheduler.bin": {"last_epoch": 3}}, "checkpoint_0")
        weights["a"].zero_()  # changed right after: not in the checkpoint
        h.result()
        assert h.telemetry.staged_on == "cpu" and h.telemetry.gpudirect is False
    folder = tmp_path / "checkpoint_0"
    assert stagesave.verify(folder).status == "verified"
    got = load_file(folder / "model.safetensors")
    assert torch.equal(got["b"], weights["b"]) and float(got["a"].abs().sum()) > 0
    opt = torch.load(folder / "optimizer.bin", weights_only=True)
    assert (
        torch.equal(opt["state"][0]["exp_avg"], optim["state"][0]["exp_avg"]) and opt["lr"] == 0.1
    )
    assert torch.load(folder / "scheduler.bin", weights_only=True) == {"last_epoch": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_0"]  # no staging folder left


def test_no_room_on_the_device_stages_in_host_memory_and_warns_once(tmp_path, monkeypatch):
    """A device buffer that cannot be allocated (out of GPU memory: injected, no GPU here) must
    not fail the save: it is staged in host memory, with one warning."""
    monkeypatch.setattr(staging_mod, "device_of",
                        lambda images, store: CPU if isinstance(store, LocalStore) else None)

    attempts = []

    def no_room(capacity, device):
        attempts.append(capacity)
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {capacity} bytes")

    monkeypatch.setattr(HostBuffer, "on_device", staticmethod(no_room))
    w = torch.randn(1000)
    with stagesave.Checkpointer(tmp_path, device_staging=True) as ck:
        with pytest.warns(
            RuntimeWarning,
            match=r"device_staging: no room on cpu for a 0\.00 GiB staging "
            r"buffer \(CUDA out of memory\..*staging in host memory instead",
        ):
            first = ck.save({"w": w}, "a.pt")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # only once
            second = ck.save({"w": w}, "b.pt")
        for h in (first, second):
            h.result()
            assert h.telemetry.staged_on == "host"
        assert torch.equal(ck.load("b.pt")["w"], w)
        assert ck.memory.devices[CPU].in_use() == 0  # the failed allocation left no count behind
        assert len(attempts) == 1  # a size that did not fit is not retried on every save


# ----------------------------------------------------------------------------- on a real GPU


@pytest.mark.gpu
@pytest.mark.parametrize("use_kvikio", [False, True])
def test_cuda_state_staged_on_the_device_round_trips(ckpt_dir, monkeypatch, use_kvikio):
    if use_kvikio and gpudirect_kvikio() is None:
        pytest.skip(
            "kvikio is not installed (pip install kvikio-cu12) or in its compatibility mode: "
            "GPUDirect Storage path untested"
        )
    if not use_kvikio:
        monkeypatch.setattr(device_mod, "gpudirect_kvikio", lambda: None)
    w = torch.randn(4096, 4096, device="cuda")  # 64 MiB
    step = torch.tensor(7.0)  # a host tensor in the same state (Adam's step counters are)
    expected_w, expected_step = w.cpu(), step.clone()
    with stagesave.Checkpointer(ckpt_dir, device_staging=True) as ck:
        h = ck.save({"w": w, "step": step, "meta": {"lr": 0.1}}, "d.pt")
        w.mul_(0)  # queued after the device copy: must not reach the checkpoint
        step.add_(1)
        h.result()
        assert h.telemetry.staged_on == str(w.device) and h.telemetry.gpudirect is use_kvikio
        out = ck.load("d.pt", map_location="cpu")
    assert torch.equal(out["w"], expected_w) and torch.equal(out["step"], expected_step)
    assert out["meta"] == {"lr": 0.1}
    assert stagesave.verify(ckpt_dir / "d.pt").status == "verified"


@pytest.mark.gpu
def test_device_layout_on_cuda_matches_the_host_layout():
    state = {"a": torch.randn(1000, device="cuda"), "b": torch.arange(77, device="cuda")[3:],
             "c": torch.ones(5), "m": torch.empty(4, device="meta"), "n": 3}
    image = plan_torch_file(state)
    buf = HostBuffer.on_device(image.size + 4096, torch.device("cuda"))
    buf.tensor.fill_(0x77)
    wait = stage_on_device(image, buf)
    assert wait is not None
    wait()
    assert bytes(buf.tensor[: image.size].cpu().numpy()) == _host_image(image, 0x11)


@pytest.mark.gpu
def test_many_small_device_tensors_are_staged_by_one_batched_copy(ckpt_dir):
    """The device copies of a state of many small tensors (Adam moments of a mixture of experts,
    scaled down) go in one ``_foreach_copy_`` and land byte for byte as the host layout."""
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"e{i}": torch.randn(1 + i % 97, device="cuda", generator=g) for i in range(5000)}
    state["half"] = torch.ones(3, device="cuda", dtype=torch.bfloat16)
    state["view"] = state["e96"][2:]  # shares e96's storage
    image = plan_torch_file(state)
    buf = HostBuffer.on_device(image.size, torch.device("cuda"))
    wait = stage_on_device(image, buf)
    assert wait is not None
    wait()
    assert bytes(buf.tensor[: image.size].cpu().numpy()) == _host_image(image, 0x11)
    with stagesave.Checkpointer(ckpt_dir, device_staging=True) as ck:
        ck.save(state, "many.pt").result()
        out = ck.load("many.pt", map_location="cpu")
    assert all(torch.equal(out[k], v.cpu()) for k, v in state.items())
