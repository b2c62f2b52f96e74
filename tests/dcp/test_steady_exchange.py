"""``stagesave.dcp.save`` of an unchanged structure exchanges the plans' names instead of running
``dcp.save`` (one process here; two gloo ranks in ``test_dcp_multiprocess.py``): the files are a
fresh writer's, each ``Stateful`` is asked for its state once per save, only the writer's own
steady planner takes that path, and a failure found while setting up is raised once."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from dcp_helpers import folder_proof
from test_single_process import mixed_state
from test_steady_layout import data_bytes, loads_as, metadata_pickle, save

import stagesave
import stagesave.dcp as sdcp
from stagesave.dcp import _rankjob  # the rank job calls write_rank: a fault wraps it there

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _Counted:
    """A ``Stateful`` (DCP asks it for ``state_dict()``), counting the calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.w = torch.arange(6.0)

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w = state["w"]


def _same_metadata(a: Path, b: Path) -> bool:
    md_a, md_b = (pickle.loads(metadata_pickle(f)) for f in (a, b))
    return dataclasses.replace(md_a, storage_meta=None) == dataclasses.replace(
        md_b, storage_meta=None)


def test_saves_of_a_kept_structure_exchange_names_and_write_a_fresh_writers_files(writers):
    steady, fresh = writers
    state = mixed_state()
    for step in (1, 2, 3):
        with torch.no_grad():
            state["model"]["w"].add_(step)
        state["step"] = step
        folder = save(steady, state, f"s{step}")
        # the first save of the structure runs dcp.save (it names the global plan), then names
        assert steady.exchanged.saves == step - 1
        ref = save(fresh, state, f"s{step}")
        assert data_bytes(folder) == data_bytes(ref)
        assert _same_metadata(folder, ref)
        loads_as(folder, state)
        md = pickle.loads(metadata_pickle(folder))
        assert md.storage_meta.save_id == folder_proof(folder).metadata["dcp_save_id"]
    assert steady.planner.reused_local == 2 and steady.planner.reused_global == 2


def test_a_changed_structure_runs_dcp_save_then_exchanges_again(writers):
    steady, fresh = writers
    state = mixed_state()
    save(steady, state, "a")
    save(steady, state, "b")
    state["model"]["extra"] = torch.ones(3)  # a new key: planned again by dcp.save
    changed = save(steady, state, "c")
    assert steady.exchanged.saves == 1
    assert data_bytes(changed) == data_bytes(save(fresh, state, "c"))
    save(steady, state, "d")
    assert steady.exchanged.saves == 2
    loads_as(changed, state)


def test_each_stateful_is_asked_for_its_state_once_per_save(tmp_path):
    counted = _Counted()
    with sdcp.StagedStorageWriter(root=tmp_path) as writer:
        for i in range(3):
            sdcp.save({"app": counted, "step": i}, f"s{i}", writer=writer).result(60)
            assert counted.calls == i + 1
        assert writer.exchanged.saves == 2
    whole = sdcp.to_state_dict(tmp_path / "s2")
    assert torch.equal(whole["app"]["w"], counted.w) and whole["step"] == 2


@pytest.mark.parametrize("planner", ["subclass", "another"])
def test_only_the_writers_own_steady_planner_exchanges_names(tmp_path, planner):
    class Mine(sdcp.SteadySavePlanner):
        pass

    with sdcp.StagedStorageWriter(root=tmp_path) as writer:
        given = Mine() if planner == "subclass" else sdcp.SteadySavePlanner()
        state = mixed_state()
        for i in range(3):
            sdcp.save(state, f"s{i}", writer=writer, planner=given).result(60)
        assert writer.exchanged.saves == 0
        assert given.reused_local == 2  # its plans are still reused inside dcp.save
        loads_as(tmp_path / "s2", state)


def test_a_background_failure_found_while_exchanging_is_raised_once(tmp_path):
    state = mixed_state()
    with sdcp.StagedStorageWriter(root=tmp_path) as writer:
        save(writer, state, "a")
        save(writer, state, "b")  # names exchanged from here on
        real = _rankjob.write_rank

        def disk_full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        _rankjob.write_rank = disk_full  # type: ignore[assignment]
        try:
            handle = sdcp.save(state, "c", writer=writer)
            handle.exception(60)  # failed in the background, not delivered yet
        finally:
            _rankjob.write_rank = real  # type: ignore[assignment]
        assert writer.exchanged.saves == 2
        with pytest.raises(stagesave.StorageError, match="no space left on the device"):
            sdcp.save(state, "d", writer=writer)
        folder = save(writer, state, "e")
        assert writer.exchanged.saves == 3
        loads_as(folder, state)
    names = [c.name for c in stagesave.list_checkpoints(tmp_path)]
    assert names == ["e", "b", "a"]


def test_a_save_failing_before_its_set_up_leaves_the_last_saves_failure_to_the_next(tmp_path):
    """Save b fails in the background (not delivered yet); save c fails while its state is
    taken (a ``Stateful`` raising, before the writer is set up); save d raises b's failure."""
    state = mixed_state()

    class Raising(_Counted):
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("state_dict failed")

    with sdcp.StagedStorageWriter(root=tmp_path) as writer:
        save(writer, state, "a")
        real = _rankjob.write_rank

        def disk_full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        _rankjob.write_rank = disk_full  # type: ignore[assignment]
        try:
            sdcp.save(state, "b", writer=writer).exception(60)
        finally:
            _rankjob.write_rank = real  # type: ignore[assignment]
        with pytest.raises(BaseException, match="state_dict failed"):
            sdcp.save({**state, "app": Raising()}, "c", writer=writer)
        with pytest.raises(stagesave.StorageError, match="no space left on the device"):
            sdcp.save(state, "d", writer=writer)
        loads_as(save(writer, state, "e"), state)
