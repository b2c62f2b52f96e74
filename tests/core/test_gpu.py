"""The CUDA path: pinned staging buffers, non-blocking copies on a side stream, stream ordering.

These tests need a CUDA device; on machines without one they are skipped with that reason
(see tests/conftest.py) and this path is untested there.
"""

from __future__ import annotations

import pytest
import torch

import stagesave

pytestmark = pytest.mark.gpu


def test_cuda_state_round_trips_and_pool_is_pinned(ckpt_dir):
    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.arange(10, device="cuda"),
             "cpu": torch.ones(3)}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save(state, "g.ckpt").result()
        assert ck.memory.host.pinned
        out = ck.load("g.ckpt", map_location="cuda")
        assert out["w"].is_cuda and torch.equal(out["w"], state["w"])
        cpu = ck.load("g.ckpt", map_location="cpu")
        assert torch.equal(cpu["b"], state["b"].cpu()) and torch.equal(cpu["cpu"], state["cpu"])


def test_in_place_update_right_after_save_does_not_race_the_copy(ckpt_dir):
    w = torch.randn(8192, 8192, device="cuda")  # 256 MiB: the D2H copy takes a while
    expected = w.cpu()
    with stagesave.Checkpointer(ckpt_dir) as ck:
        h = ck.save({"w": w}, "race.ckpt")
        w.mul_(0)  # queued on the current stream, which waits for the side-stream copy
        h.result()
        assert torch.equal(ck.load("race.ckpt")["w"], expected)
    assert float(w.abs().sum()) == 0.0


def test_tensor_freed_after_save_is_still_saved_correctly(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        w = torch.full((4096, 4096), 3.0, device="cuda")
        h = ck.save({"w": w}, "freed.ckpt")
        del w
        junk = torch.full((4096, 4096), 7.0, device="cuda")  # may reuse the freed block
        h.result()
        assert bool((ck.load("freed.ckpt")["w"] == 3.0).all())
        del junk


def test_process_writer_segments_are_registered_pinned_and_unregistered(tmp_path, monkeypatch):
    """writer="process": the shared segments are pinned with cudaHostRegister (fast
    device-to-host copies), a CUDA state round-trips, and an in-place update right after save()
    does not reach the checkpoint (the copy is complete before the agent is handed the order)."""
    monkeypatch.setenv("STAGESAVE_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    w = torch.randn(4096, 4096, device="cuda")
    expected = w.cpu()
    with stagesave.Checkpointer(tmp_path / "ck", writer="process") as ck:
        h = ck.save({"w": w}, "g.ckpt")
        w.mul_(0)
        h.result(120)
        (buf,) = ck.memory.host._free
        assert buf.segment is not None and buf.pinned
        assert buf.tensor.is_pinned()  # cudaHostRegister'ed memory counts as pinned
        out = ck.load(tmp_path / "ck" / "g.ckpt", map_location="cuda")
        assert out["w"].is_cuda and torch.equal(out["w"].cpu(), expected)
    assert list((tmp_path / "shm").iterdir()) == []


def test_many_small_cuda_tensors_round_trip_through_one_batched_copy(ckpt_dir):
    """Host staging copies all of a device's storages in one ``_foreach_copy_``: a state of
    many small tensors (with views and a bf16 one) lands byte for byte, and an in-place update
    right after ``save()`` does not reach it."""
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"m{i}": torch.randn(1 + i % 61, device="cuda", generator=g) for i in range(4000)}
    state["half"] = torch.ones(5, device="cuda", dtype=torch.bfloat16)
    state["view"] = state["m60"][3:]
    expected = {k: v.cpu() for k, v in state.items()}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        h = ck.save(state, "many.ckpt")
        for v in state.values():
            v.zero_()  # queued after the copies on the device's stream
        h.result()
        out = ck.load("many.ckpt", map_location="cpu")
    assert all(torch.equal(out[k], v) for k, v in expected.items())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_state_on_two_devices_waits_for_both(ckpt_dir):
    a = torch.randn(4096, 1024, device="cuda:0")
    b = torch.randn(4096, 1024, device="cuda:1")
    expected = {"a": a.cpu(), "b": b.cpu()}
    with stagesave.Checkpointer(ckpt_dir) as ck:
        h = ck.save({"a": a, "b": b}, "two.ckpt")
        a.mul_(0)
        b.mul_(0)
        h.result()
        out = ck.load("two.ckpt", map_location="cpu")
    assert torch.equal(out["a"], expected["a"]) and torch.equal(out["b"], expected["b"])


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_buffer_made_ahead_is_pinned_from_the_callers_device(tmp_path, monkeypatch, writer):
    """The first save's buffer is made on a thread while the state is planned: pinned with the
    saving thread's current device (a rank's own GPU), and a CUDA state round-trips."""
    monkeypatch.setenv("STAGESAVE_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    last = torch.cuda.device_count() - 1
    with torch.cuda.device(last):
        w = torch.randn(2048, 2048, device=f"cuda:{last}")
        with stagesave.Checkpointer(tmp_path / "ck", writer=writer) as ck:
            ck.save({"w": w}, "g.ckpt").result(120)
            (buf,) = ck.memory.host._free
            assert buf.pinned and buf.tensor.is_pinned()
            out = ck.load(tmp_path / "ck" / "g.ckpt", map_location=f"cuda:{last}")
            assert torch.equal(out["w"], w)
