"""A sharded save's rank file reuses its layout by torch's compiled check of its tensors
(:mod:`stagesave.dcp._rank_guard`, issue 20): no tensor's facts read in Python when nothing
changed, and every tensor that must not be copied as it is (a conjugate or negative view, a
transposed one, another dtype) still goes through the full path and is written as a fresh
writer writes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_steady_layout import data_bytes, save

from stagesave.dcp import _rankfile
from stagesave.saving import tensor_guard

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g),
                      "z": torch.randn(4, dtype=torch.complex64, generator=g),
                      "ids": torch.arange(5)},
            "step": 1}


def _count_full_paths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = _rankfile._resolved

    def spy(items: Any, resolved: Any) -> Any:
        calls.append(len(items))
        return real(items, resolved)

    monkeypatch.setattr(_rankfile, "_resolved", spy)
    return calls


def _loads_as(folder: Path, state: dict[str, Any]) -> None:
    got = {"model": {k: torch.zeros_like(v.resolve_conj().resolve_neg())
                     for k, v in state["model"].items()}, "step": 0}
    dcp.load(got, checkpoint_id=str(folder))  # torch's own reader
    for k, v in state["model"].items():
        assert torch.equal(got["model"][k], v.resolve_conj().resolve_neg()), k
    assert got["step"] == state["step"]


def test_an_unchanged_rank_file_is_laid_out_by_the_compiled_check(
        writers: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    steady, fresh = writers
    state = _state()
    full = _count_full_paths(monkeypatch)
    save(steady, state, "s1")
    layout = steady._layouts.entries[0]
    assert layout.guard is not None and len(full) == 1
    with torch.no_grad():
        state["model"]["w"].mul_(3)
    state["model"]["b"] = torch.randn(8)  # a new tensor object, same facts
    state["step"] = 2
    second = save(steady, state, "s2")
    assert len(full) == 1 and steady._layouts.entries == [layout]  # no tensor read in Python
    assert data_bytes(second) == data_bytes(save(fresh, state, "s2"))
    _loads_as(second, state)


def test_a_layout_the_planners_check_vouched_for_is_not_checked_again(
        writers: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's compiled check of this save's tensors read the facts the layout's check
    would read: a layout whose check was made in a save the same planner check vouched for is
    not asked again; once the planner's check was made again (a transposed tensor of the same
    shape keeps the plan, not the layout), the layout's own check decides."""
    steady, fresh = writers
    state = _state()
    asked: list[Any] = []
    real = tensor_guard.Guard.same

    def spy(self: Any, tensors: Any) -> bool:
        asked.append(self)
        return real(self, tensors)

    monkeypatch.setattr(tensor_guard.Guard, "same", spy)
    full = _count_full_paths(monkeypatch)
    save(steady, state, "s1")
    layout = steady._layouts.entries[0]
    assert layout.vouch is None  # the items list seen once: no places kept for it yet
    state["step"] = 1
    save(steady, state, "s1b")  # seen twice: places kept, the layout's check held with it
    assert layout.vouch is not None and layout.vouch[0] is steady.planner._local.guard
    asked.clear()
    state["model"]["b"] = torch.randn(8)  # a new object, same facts
    state["step"] = 2
    second = save(steady, state, "s2")
    assert len(full) == 1 and layout.guard not in asked  # vouched for
    assert data_bytes(second) == data_bytes(save(fresh, state, "s2"))
    asked.clear()
    checked_by, paths = layout.guard, len(full)  # (the fresh writer's save took one)
    state["model"]["w"] = state["model"]["w"].t()
    state["step"] = 3
    third = save(steady, state, "s3")
    assert steady.planner.reused_local == 3  # the plan kept (same dtype and shape)
    assert checked_by in asked and len(full) == paths + 1  # asked, said no: the full path
    assert data_bytes(third) == data_bytes(save(fresh, state, "s3"))
    _loads_as(third, state)


CHANGES = {
    "a conjugate view": lambda m: m.update(z=m["z"].conj()),
    "a negative view": lambda m: m.update(b=m["b"]._neg_view()),
    "transposed, same shape": lambda m: m.update(w=m["w"].t()),
    "another dtype": lambda m: m.update(ids=m["ids"].to(torch.int32)),
    "another shape": lambda m: m.update(w=m["w"].reshape(4, 16)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_tensor_that_cannot_be_copied_as_it_was_takes_the_full_path(
        writers: list[Any], monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    steady, fresh = writers
    state = _state()
    full = _count_full_paths(monkeypatch)
    save(steady, state, "s1")
    CHANGES[change](state["model"])
    state["step"] = 2
    second = save(steady, state, "s2")
    assert len(full) == 2
    assert data_bytes(second) == data_bytes(save(fresh, state, "s2"))
    _loads_as(second, state)
    third = save(steady, state, "s3")  # and again: whatever the change left is reused right
    assert data_bytes(third) == data_bytes(save(fresh, state, "s3"))
    _loads_as(third, state)


_REFUSED = """
import sys, tempfile, warnings
warnings.filterwarnings("ignore")
import torch
import stagesave.dcp as sdcp
from stagesave.errors import UnsupportedObjectError
kind, when = sys.argv[1], sys.argv[2]
dense = torch.eye(4)
odd = {"coo": dense.to_sparse, "csr": dense.to_sparse_csr, "csc": dense.to_sparse_csc,
       "bsr": lambda: dense.to_sparse_bsr((2, 2)), "bsc": lambda: dense.to_sparse_bsc((2, 2)),
       "zero": lambda: torch._efficientzerotensor(4, 4)}[kind]
w = sdcp.StagedStorageWriter(root=tempfile.mkdtemp(), commit_timeout=60)
state = {"w": torch.ones(3, 3), "s": odd() if when == "first" else dense.clone(), "step": 1}
try:
    sdcp.save(state, "s1", writer=w).result(60)  # plans kept, with the check of a dense tensor
    state["s"] = odd()
    sdcp.save(state, "s2", writer=w).result(60)
    print("saved")
except UnsupportedObjectError as exc:
    print(exc)
finally:
    w.close()
"""


@pytest.mark.parametrize("when", ["first", "later"])
@pytest.mark.parametrize("kind", ["coo", "csr", "csc", "bsr", "bsc", "zero"])
def test_a_sparse_or_zero_tensor_is_refused_with_its_name_and_never_reaches_torchs_check(
        kind: str, when: str) -> None:
    # torch's check reads strides, which a compressed-sparse tensor does not have, and that
    # aborts the process; a zero tensor has no data (copied from address 0: a segfault). In a
    # child, so that an abort or a segfault fails this test instead of the run. DCP's
    # FileSystemWriter cannot save them either.
    out = subprocess.run([sys.executable, "-c", _REFUSED, kind, when], check=False,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    why = "zero tensor" if kind == "zero" else "sharded checkpoint cannot hold"
    assert out.stdout.startswith("cannot save s: it is a "), out.stdout
    assert why in out.stdout


def test_tied_tensors_and_a_save_under_inference_mode_keep_the_checked_layout(
        writers: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    steady, fresh = writers
    tied = torch.randn(6, 6)
    state = {"model": {"embed": tied, "head": tied, "b": torch.zeros(6)}, "step": 1}
    full = _count_full_paths(monkeypatch)
    save(steady, state, "s1")
    layout = steady._layouts.entries[0]
    assert layout.guard is not None and len(full) == 1
    for step in (2, 3, 4):
        state["step"] = step
        if step == 3:
            with torch.inference_mode():
                folder = save(steady, state, f"s{step}")
        else:
            folder = save(steady, state, f"s{step}")
        assert len(full) == 1, step  # no tensor read in Python
        assert steady.planner.reused_local == step - 1
    assert data_bytes(folder) == data_bytes(save(fresh, state, "s4"))
    _loads_as(folder, state)
