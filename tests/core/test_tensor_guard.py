"""torch's compiled check of tensors' facts, as a steady save uses it (issue 20:
:mod:`stagesave.saving.tensor_guard`).

Its answer "the same" lets a save reuse a plan without reading each tensor's shape in Python,
so it must never say "the same" for a tensor whose pickle would differ; what it cannot tell
(another dispatch mode) is compared in Python and still reuses the plan.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from statecompare import same_state

import stagesave
from stagesave.saving import steady, tensor_guard
from stagesave.saving.walk import Walked


def _state() -> list[torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32)
    return [base.view(4, 6), base[3:9], torch.zeros(3), torch.nn.Parameter(torch.ones(2, 2)),
            torch.tensor(5.0)]


class _Sub(torch.Tensor):
    pass


CHANGES = {
    "shape": lambda s: [s[0].view(6, 4), *s[1:]],
    "strides": lambda s: [s[0].t().contiguous().t(), *s[1:]],
    "dimensions": lambda s: [s[0], s[1].view(2, 3), *s[2:]],
    "dtype": lambda s: [*s[:2], torch.zeros(3, dtype=torch.float64), *s[3:]],
    "integer dtype": lambda s: [*s[:2], torch.zeros(3, dtype=torch.int32), *s[3:]],
    "requires_grad": lambda s: [*s[:2], torch.zeros(3).requires_grad_(), *s[3:]],
    "a parameter became a tensor": lambda s: [*s[:3], s[3].detach(), s[4]],
    "a tensor became a parameter": lambda s: [*s[:2], torch.nn.Parameter(s[2]), *s[3:]],
    "a parameter's flag": lambda s: [*s[:3], torch.nn.Parameter(s[3].detach(), False), s[4]],
    "a subclass": lambda s: [*s[:2], s[2].as_subclass(_Sub), *s[3:]],
    "a scalar became a vector": lambda s: [*s[:4], torch.tensor([5.0])],
    "one tensor fewer": lambda s: s[:-1],
}


def test_torchs_check_proves_itself_in_this_torch() -> None:
    # CI's torch has it: a steady save checks facts in compiled code there (a torch that lacks
    # it, or where it fails its self-test, compares in Python: test_steady runs both ways).
    assert tensor_guard.usable()


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_of_a_tensors_facts_is_not_the_same(change: str) -> None:
    state = _state()
    guard = tensor_guard.build(state)
    assert guard is not None
    assert guard.same(state)
    assert guard.same([t.detach() if type(t) is torch.Tensor else t for t in state])  # new objects
    assert not guard.same(CHANGES[change](state))


def test_requires_grad_is_compared_with_gradients_off_too() -> None:
    # torch's check reads requires_grad as False while grad mode is off; the guard turns it on
    state = _state()
    with torch.no_grad():
        guard = tensor_guard.build(state)
        assert guard is not None
        assert guard.same(state)
        assert not guard.same(CHANGES["requires_grad"](state))
    assert guard.same(state)


def _spied_walks(monkeypatch: pytest.MonkeyPatch) -> list[Walked]:
    seen: list[Walked] = []
    real = steady.walk

    def spy(state: Any) -> Walked:
        seen.append(real(state))
        return seen[-1]

    monkeypatch.setattr(steady, "walk", spy)
    return seen


def _adam_like(n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    return {"model": {f"w{i}": torch.randn(3, 5, generator=g) for i in range(n)},
            "opt": {i: {"exp_avg": torch.zeros(3, 5), "step": torch.tensor(1.0)}
                    for i in range(n)},
            "global_step": 0}


def test_a_steady_save_reads_no_tensor_shape_in_python(
        monkeypatch: pytest.MonkeyPatch, ckpt_dir: Any) -> None:
    state = _adam_like(20)
    walks = _spied_walks(monkeypatch)
    with stagesave.Checkpointer(ckpt_dir, keep_last=None) as ck:
        ck.save(state, "a.pt").result()
        template = ck.plans._template
        assert template is not None and template.guard is not None
        state["global_step"] = 1
        state["model"]["w0"].add_(1)
        ck.save(state, "b.pt").result()
        assert ck.plans._template is template
        assert "facts" not in vars(walks[-1])  # the compiled check and the offsets sufficed
    same_state(torch.load(os.path.join(ckpt_dir, "b.pt"), weights_only=True), state)


@pytest.mark.parametrize("mode", ["inference", "autocast", "no_grad"])
def test_a_save_inside_a_mode_is_checked_as_any_other(
        monkeypatch: pytest.MonkeyPatch, ckpt_dir: Any, mode: str) -> None:
    # The thread's dispatch keys (inference mode, autocast) are set aside by the check: saves
    # alternating between a mode and none all reuse the plan without reading facts in Python,
    # and a change made inside the mode is still seen.
    modes = {"inference": torch.inference_mode, "no_grad": torch.no_grad,
             "autocast": lambda: torch.autocast("cpu")}
    state = _adam_like(5)
    walks = _spied_walks(monkeypatch)
    with stagesave.Checkpointer(ckpt_dir, keep_last=None) as ck:
        ck.save(state, "a.pt").result()
        template = ck.plans._template
        for step in range(1, 5):
            state["global_step"] = step
            if step % 2:
                with modes[mode]():
                    ck.save(state, f"s{step}.pt").result()
            else:
                ck.save(state, f"s{step}.pt").result()
            assert ck.plans._template is template
            assert "facts" not in vars(walks[-1]), step
            same_state(torch.load(os.path.join(ckpt_dir, f"s{step}.pt"), weights_only=True),
                       state)
        with modes[mode]():
            state["model"]["w1"] = torch.ones(5, 3)
            ck.save(state, "c.pt").result()
        assert ck.plans._template is not template
    same_state(torch.load(os.path.join(ckpt_dir, "c.pt"), weights_only=True), state)


def test_one_tensor_object_in_two_places_is_checked_once(
        monkeypatch: pytest.MonkeyPatch, ckpt_dir: Any) -> None:
    # torch's check says "different" when given one object twice: it is built on the first
    # place, and the other must still hold that object (a tied weight, a monitored score)
    tied = torch.randn(4, 4)
    state = {"model": {"embed": tied, "head": tied, "b": torch.zeros(4)}, "step": 0}
    walks = _spied_walks(monkeypatch)
    with stagesave.Checkpointer(ckpt_dir, keep_last=None) as ck:
        ck.save(state, "a.pt").result()
        template = ck.plans._template
        assert template is not None and template.guard is not None
        state["step"] = 1
        ck.save(state, "b.pt").result()
        assert ck.plans._template is template and "facts" not in vars(walks[-1])
        state["model"]["head"] = tied.clone()  # the same facts, another object: untied
        state["step"] = 2
        ck.save(state, "c.pt").result()
    got = torch.load(os.path.join(ckpt_dir, "c.pt"), weights_only=True)
    same_state(got, state)
    assert (got["model"]["embed"].untyped_storage().data_ptr()
            != got["model"]["head"].untyped_storage().data_ptr())


def test_the_same_address_at_another_storage_offset_is_planned_again(ckpt_dir: Any) -> None:
    # The same data address, shape, strides, dtype and storage size, but the tensor now starts
    # its storage (one that begins where the old view's data did): torch's check, the address
    # and the storage's size agree; only the storage offset tells them apart.
    memory = bytearray(320)
    torch.frombuffer(memory, dtype=torch.float32).copy_(torch.arange(80, dtype=torch.float32))
    old = torch.frombuffer(memory, dtype=torch.float32, count=64)  # bytes 0-256
    state = {"t": old[16:20], "step": 0}
    with stagesave.Checkpointer(ckpt_dir, keep_last=None) as ck:
        ck.save(state, "a.pt").result()
        template = ck.plans._template
        new = torch.frombuffer(memory, dtype=torch.float32, offset=64, count=64)  # bytes 64-320
        state["t"] = new[:4]
        assert state["t"].data_ptr() == old[16:20].data_ptr()
        assert state["t"].untyped_storage().nbytes() == old.untyped_storage().nbytes()
        ck.save(state, "b.pt").result()
        assert ck.plans._template is not template
    got = torch.load(os.path.join(ckpt_dir, "b.pt"), weights_only=True)
    same_state(got, state)
    assert torch.equal(torch.frombuffer(bytearray(got["t"].untyped_storage()), dtype=torch.float32),
                       torch.arange(16, 80, dtype=torch.float32))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_a_nested_or_sparse_tensor_where_a_plain_one_was_never_meets_the_check(
        ckpt_dir: Any) -> None:
    # torch's check reads every tensor's strides; a nested tensor has none and the error
    # aborts the process, so such a tensor never reaches it (nor a sparse one, whose strides
    # Python cannot read either).
    state: dict[str, Any] = {"a": torch.arange(4.0), "b": torch.ones(2, 2), "step": 0}
    with stagesave.Checkpointer(ckpt_dir, keep_last=None) as ck:
        ck.save(state, "a.pt").result()
        assert ck.plans._template is not None and ck.plans._template.guard is not None
        state["a"] = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        ck.save(state, "b.pt").result()  # not an abort: laid out by torch, with its bytes
        assert [t.tolist() for t in ck.load("b.pt")["a"].unbind()] == [[1.0, 1.0], [1.0] * 3]
        state["a"] = torch.eye(2).to_sparse()
        ck.save(state, "c.pt").result()
        ck.save(state, "d.pt").result()
    for name in ("c.pt", "d.pt"):
        got = torch.load(os.path.join(ckpt_dir, name), weights_only=False)
        assert torch.equal(got["a"].to_dense(), torch.eye(2))
        assert torch.equal(got["b"], state["b"])


class _Blind:
    """A torch whose compiled check says "the same" to anything (a fault this torch does not
    have, hence the stand-in)."""

    def __init__(self, *tensors: Any, **kwargs: Any) -> None:
        pass

    def check(self, *tensors: Any) -> bool:
        return True


class _Gone:
    def __init__(self, *tensors: Any, **kwargs: Any) -> None:
        raise TypeError("TensorGuards.__init__() got an unexpected keyword argument")


@pytest.mark.parametrize("fault", [_Blind, _Gone])
def test_a_check_that_fails_its_self_test_is_not_used(
        monkeypatch: pytest.MonkeyPatch, ckpt_dir: Any, fault: type) -> None:
    from torch._C._dynamo import guards

    monkeypatch.setattr(guards, "TensorGuards", fault)
    monkeypatch.setattr(tensor_guard, "_usable", None)  # as in a new process
    assert not tensor_guard.usable()
    state = {"w": torch.ones(2, 3), "step": 0}
    with stagesave.Checkpointer(ckpt_dir, keep_last=None) as ck:
        ck.save(state, "a.pt").result()
        assert ck.plans._template is not None and ck.plans._template.guard is None
        state["w"] = torch.ones(3, 2)  # a blind check would keep the old shape
        ck.save(state, "b.pt").result()
    same_state(torch.load(os.path.join(ckpt_dir, "b.pt"), weights_only=True), state)


_X = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
SWAPS = {  # the same address, shape, strides and dtype: only a conjugate or negative bit differs
    "a conjugate view for the tensor": ({"z": _X}, lambda: _X.conj()),
    "a negative view for the tensor": ({"z": _X.imag}, lambda: _X.conj().imag),
    "the tensor for its conjugate view": ({"z": _X.conj()}, lambda: _X),
}


@pytest.mark.parametrize("swap", list(SWAPS))
@pytest.mark.parametrize("check", ["torch's", "python"])
def test_a_view_that_differs_only_by_its_conjugate_or_negative_bit_is_planned_again(
        ckpt_dir: Any, monkeypatch: pytest.MonkeyPatch, swap: str, check: str) -> None:
    if check == "python":
        monkeypatch.setattr(tensor_guard, "_usable", False)
    first, then = SWAPS[swap]
    state = {**first, "step": 0}
    with stagesave.Checkpointer(ckpt_dir, keep_last=None) as ck:
        ck.save(state, "a.pt").result()
        state["z"], state["step"] = then(), 1
        ck.save(state, "b.pt").result()
    got = torch.load(os.path.join(ckpt_dir, "b.pt"), weights_only=True)
    want = torch.load(_torch_saved(ckpt_dir, state), weights_only=True)
    assert (got["z"].is_conj(), got["z"].is_neg()) == (want["z"].is_conj(), want["z"].is_neg())
    assert torch.equal(got["z"].resolve_conj().resolve_neg(),
                       state["z"].resolve_conj().resolve_neg())


def _torch_saved(directory: Any, state: Any) -> str:
    path = os.path.join(directory, "torch.pt")
    torch.save(state, path)
    return path


_DEFAULTS = """
import sys, tempfile, torch, stagesave
from stagesave.saving import tensor_guard
torch.set_default_dtype(torch.float64)
state = {"w": torch.ones(2, 3, dtype=torch.float32, device="cpu"), "step": 0}
root = tempfile.mkdtemp()
with torch.device("meta"), stagesave.Checkpointer(root) as ck:
    ck.save(state, "a.pt").result()
    state["w"] = torch.ones(3, 2, dtype=torch.float32, device="cpu")
    ck.save(state, "b.pt").result()
print("usable", tensor_guard.usable(), tuple(torch.load(root + "/b.pt")["w"].shape))
"""


def test_the_self_test_holds_under_other_default_devices_and_dtypes() -> None:
    # a fresh process: the self-test runs once per process, on its first save
    out = subprocess.run([sys.executable, "-c", _DEFAULTS], check=False, capture_output=True,
                         text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["usable", "True", "(3,", "2)"]
