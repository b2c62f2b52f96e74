"""A sharded save's first staging buffer is made while DCP plans (issue 20: the first save)."""

from __future__ import annotations

import threading

import pytest
import torch

import stagesave
import stagesave.dcp as sdcp
from stagesave.dcp._rank_bounds import rank_bounds
from stagesave.saving.buffers import HostBuffer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture
def made(monkeypatch):
    """Every host buffer allocated during the test: ``(capacity, thread name)``."""
    seen: list[tuple[int, str]] = []
    real = HostBuffer.allocate.__func__

    def allocate(cls, capacity, pinned, shared=False):
        buf = real(cls, capacity, pinned, shared)
        seen.append((capacity, threading.current_thread().name))
        return buf

    monkeypatch.setattr(HostBuffer, "allocate", classmethod(allocate))
    return seen


def _state(numel: int) -> dict:
    return {"model": {f"w{i}": torch.randn(numel) for i in range(30)}, "step": 1}


def test_the_first_sharded_save_leases_the_buffer_made_while_dcp_planned(tmp_path, made):
    state = _state(200_000)  # 24 MB
    with stagesave.Checkpointer(tmp_path, keep_last=2) as ck:
        writer = sdcp.StagedStorageWriter(checkpointer=ck, commit_timeout=60)
        sdcp.save(state, "one", writer=writer).result(60)
        assert [name for _, name in made] == ["stagesave-buffer"]
        pool = ck.memory.host
        assert pool._count == 1  # the save leased that buffer: no second one
        assert "stagesave-buffer" not in [t.name for t in threading.enumerate()]
        state["step"] = 2
        sdcp.save(state, "two", writer=writer).result(60)  # a free buffer: nothing made
        assert len(made) == 1
        writer.close()
    got = _state(200_000)
    sdcp.load(got, tmp_path / "two")
    for key, t in state["model"].items():
        assert torch.equal(got["model"][key], t)


def test_device_staging_makes_no_buffer_ahead(tmp_path, made):
    with stagesave.Checkpointer(tmp_path, device_staging=True) as ck:
        writer = sdcp.StagedStorageWriter(checkpointer=ck, commit_timeout=60)
        sdcp.save(_state(10_000), "one", writer=writer).result(60)
        writer.close()
    assert "stagesave-buffer" not in [name for _, name in made]


def test_rank_bounds_split_whole_tensors_among_ranks():
    state = {"w": torch.zeros(1000, 1000), "p": torch.nn.Parameter(torch.zeros(250, 1000)),
             "h": torch.zeros(500, 1000, dtype=torch.bfloat16), "step": 3, "names": ["a"]}
    alone, four = rank_bounds(state, 1), rank_bounds(state, 4)
    assert alone[0] == 4_000_000 + 1_000_000 + 1_000_000 + 3 * 2048 + 2 * 4096
    assert four[0] == 6_000_000 // 4 + 3 * 2048 + 2 * 4096
    assert alone[1] > alone[0] and four[1] > four[0]


def test_the_bounds_hold_a_single_ranks_file(tmp_path):
    state = {"model": {f"w{i}": torch.randn(7, 13 + i) for i in range(50)},
             "opt": {"lr": 0.1, "names": ["a", "b"]}, "step": 3}
    with sdcp.StagedStorageWriter(root=tmp_path, commit_timeout=60) as writer:
        sdcp.save(state, "one", writer=writer).result(60)
        assert not writer.planner.set_up_pending  # the writer took it as the save began
        least, most = rank_bounds(writer.planner.state_dict, 1)  # the flat state
    size = (tmp_path / "one" / "__0_0.distcp").stat().st_size
    assert least >= size - 8192 and most >= size  # the proof (a few KiB) follows the items
