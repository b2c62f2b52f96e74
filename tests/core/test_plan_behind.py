"""A save held to be planned behind the caller writes what ``torch.save`` writes of the state as
it was when ``save()`` returned, whatever happens to the state afterwards; states it cannot
rebuild from their walk, and states cheap to plan, are planned on the caller's time as before.

The oracle: ``torch.save``'s bytes of the state taken just before the save, compared record by
record with the checkpoint (:func:`test_steady.assert_file_is_what_torch_save_writes`).
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import time
from typing import Any

import heldchild
import pytest
import torch
from agentwatch import exited
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_steady import (
    CHANGES,
    assert_file_is_what_torch_save_writes,
    base_state,
    torch_save_bytes,
)

import stagesave
from stagesave.agent.segments import owned_segments
from stagesave.saving import behind
from stagesave.saving.walk import walk


@pytest.fixture
def any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hold states of any number and size of tensors (the defaults hold only many small ones)."""
    monkeypatch.setattr(behind, "MIN_TENSORS", 1)
    monkeypatch.setattr(behind, "MEAN_BYTES", 1 << 40)


def _eligible(state: dict[str, Any]) -> dict[str, Any]:
    """``base_state`` without what a held save cannot rebuild from its walk (bytes, an object
    of its own pickle; keys of tuple and float types)."""
    del state["raw"], state["odd_keys"]
    return state


def test_the_default_holds_with_a_writer_thread_only(ckpt_dir: Any) -> None:
    with stagesave.Checkpointer(ckpt_dir, writer="thread") as ck:
        assert ck.plan_behind is True
    with stagesave.Checkpointer(ckpt_dir, writer="process") as ck:
        assert ck.plan_behind is False
    with stagesave.Checkpointer(ckpt_dir, writer="process", plan_behind=True) as ck:
        assert ck.plan_behind is True
    with pytest.raises(TypeError, match="plan_behind must be True, False or None, got 'yes'"):
        stagesave.Checkpointer(ckpt_dir, plan_behind="yes")  # type: ignore[arg-type]


@pytest.mark.usefixtures("any_size")
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_a_held_save_is_not_in_it_and_the_next_save_has_it(
        ckpt_dir: Any, change: str) -> None:
    state = _eligible(base_state())
    before = torch_save_bytes(state)
    with stagesave.Checkpointer(ckpt_dir, writer="thread") as ck:
        first = ck.save(state, "first.ckpt")
        CHANGES[change](state)  # at once: while the held save is planned, staged, written
        first.result()
        assert first.telemetry.plan_behind_s > 0, "the save was not held"
        assert_file_is_what_torch_save_writes(ckpt_dir / "first.ckpt", None, theirs_bytes=before)
        after = torch_save_bytes(state)
        second = ck.save(state, "second.ckpt")
        second.result()
        assert_file_is_what_torch_save_writes(ckpt_dir / "second.ckpt", None, theirs_bytes=after)
        assert ck.memory.host.in_use() == 0  # every buffer given back


@pytest.mark.usefixtures("any_size")
def test_the_template_a_held_save_made_serves_the_next_saves(ckpt_dir: Any) -> None:
    state = _eligible(base_state())
    with stagesave.Checkpointer(ckpt_dir, writer="thread") as ck:
        ck.save(state, "first.ckpt").result()
        template = ck.plans._template
        assert template is not None
        for step in range(3):
            state["global_step"] = step
            state["model"]["w"].add_(1)
            handle = ck.save(state, f"step-{step}.ckpt")
            handle.result()
            assert handle.telemetry.plan_behind_s == 0.0
            assert ck.plans._template is template
            assert_file_is_what_torch_save_writes(ckpt_dir / f"step-{step}.ckpt", state)


def test_a_held_plan_stands_for_the_state_it_was_copied_from(ckpt_dir: Any) -> None:
    """Once the held save is staged, its template has the real state's tensor addresses and
    storage objects (not the scratch copy's): the next save matches it without looking at
    every storage again, and writes what torch.save writes."""
    state = _many(1_250, 64)
    with stagesave.Checkpointer(ckpt_dir, writer="thread") as ck:
        handle = ck.save(state, "first.ckpt")
        handle.result()
        assert handle.telemetry.plan_behind_s > 0
        template = ck.plans._template
        assert template is not None
        walked = walk(state)
        assert template.addresses == walked.addresses
        assert template.storage_ids == walked.storage_ids
        state["state"][3]["exp_avg_sq"].add_(1)
        state["step"] = 4
        want = torch_save_bytes(state)
        ck.save(state, "next.ckpt").result()
        assert ck.plans._template is template
        assert_file_is_what_torch_save_writes(ckpt_dir / "next.ckpt", None, theirs_bytes=want)


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8,
           torch.bool, torch.complex64, torch.uint8]


@st.composite
def _states(draw: Any) -> Any:
    """Nested dicts, lists, tuples and ``OrderedDict``s of tensors (of one storage or sharing
    one, views at offsets and strides, one object named twice, empty, ``Parameter``s) and
    leaves."""
    pool: list[torch.Tensor] = []

    def tensor() -> torch.Tensor:
        if pool and draw(st.integers(0, 3)) == 0:
            return draw(st.sampled_from(pool))  # the same object again
        dtype = draw(st.sampled_from(_DTYPES))
        n = draw(st.integers(0, 40))
        base = torch.arange(n).to(dtype)
        how = draw(st.sampled_from(["whole", "view", "strided", "of another", "param"]))
        if how == "view" and n > 2:
            t = base[1 : n - 1]
        elif how == "strided" and n >= 6:
            t = base[: n // 2 * 2].reshape(-1, 2).t()
        elif how == "of another" and pool:
            other = draw(st.sampled_from(pool))
            t = other.detach().reshape(-1)[: max(0, other.numel() - 1)]
        elif how == "param" and dtype.is_floating_point:
            t = torch.nn.Parameter(base, requires_grad=draw(st.booleans()))
        else:
            t = base
        pool.append(t)
        return t

    # strings as new objects: one str object named twice is pickled once by torch.save and
    # spliced twice by any template (loaded the same; the bytes differ: not this module's)
    text = st.text(min_size=2, max_size=8).map(lambda s: (s + "\0")[:-1])
    leaf = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.booleans(),
                     st.none(), text)
    keys = st.one_of(st.text(max_size=6), st.integers(-3, 300), st.booleans(), st.none())

    def node(depth: int) -> Any:
        kind = draw(st.sampled_from(["tensor", "leaf", "dict", "list", "tuple", "odict"]
                                    if depth < 3 else ["tensor", "leaf"]))
        if kind == "tensor":
            return tensor()
        if kind == "leaf":
            return draw(leaf)
        width = draw(st.integers(0, 4))
        if kind in ("dict", "odict"):
            ks = draw(st.lists(keys, max_size=width, unique_by=lambda k: (type(k) is bool, k)))
            made = {k: node(depth + 1) for k in ks}
            if kind == "dict":
                return made
            od = collections.OrderedDict(made)
            if draw(st.booleans()):
                od._metadata = {"": {"version": draw(st.integers(0, 3))}}  # type: ignore[attr-defined]
            return od
        items = [node(depth + 1) for _ in range(width)]
        return items if kind == "list" else tuple(items)

    return {"state": node(0), "tensors": [tensor() for _ in range(draw(st.integers(1, 5)))]}


@pytest.mark.usefixtures("any_size")
@settings(max_examples=60, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(_states())
def test_any_plain_state_held_is_written_as_torch_save_writes_it(tmp_path_factory: Any,
                                                                  state: Any) -> None:
    d = tmp_path_factory.mktemp("held")
    before = torch_save_bytes(state)
    values = [t.detach().clone() for t in state["tensors"]]
    with stagesave.Checkpointer(d, writer="thread") as ck:
        handle = ck.save(state, "s.ckpt")
        for t in state["tensors"]:  # changed at once, in place: not in the checkpoint
            if t.numel() and not t.requires_grad:
                t.fill_(True if t.dtype is torch.bool else 7)
        handle.result()
        assert handle.telemetry.plan_behind_s > 0
    assert_file_is_what_torch_save_writes(d / "s.ckpt", None, theirs_bytes=before)
    loaded = stagesave.Checkpointer(d, writer="thread")
    try:
        got = loaded.load(d / "s.ckpt")
    finally:
        loaded.close()
    for a, b in zip(got["tensors"], values):
        assert torch.equal(a.detach(), b.detach())


def _conj() -> dict[str, Any]:
    return {"z": torch.tensor([1 + 2j, 3 - 1j]).conj(), "w": torch.ones(2)}


def _non_leaf() -> dict[str, Any]:
    w = torch.ones(3, requires_grad=True)
    return {"y": w * 2, "w": torch.ones(2)}


def _twice(group: dict[str, Any]) -> dict[str, Any]:
    return {"a": group, "b": group, "w": torch.ones(2)}


def _two_dtypes() -> dict[str, Any]:
    w = torch.arange(4.0)
    return {"w": w, "bits": w.view(torch.int32)[:2]}


DECLINED = {
    "bytes (an object by its own pickle)": lambda: {"raw": b"\x00", "w": torch.ones(2)},
    "a tuple key": lambda: {(0, "a"): torch.ones(2), "w": torch.ones(2)},
    "a float key": lambda: {0.5: torch.ones(2), "w": torch.ones(2)},
    "a conjugate view": _conj,
    "a tensor that requires grad and is not a leaf": _non_leaf,
    "one container twice": lambda: _twice({"w": torch.ones(2)}),
}


@pytest.mark.usefixtures("any_size")
@pytest.mark.parametrize("case", list(DECLINED))
def test_what_its_walk_cannot_rebuild_is_planned_on_the_callers_time(ckpt_dir: Any,
                                                                      case: str) -> None:
    state = DECLINED[case]()
    with stagesave.Checkpointer(ckpt_dir, writer="thread") as ck:
        handle = ck.save(state, "s.ckpt")
        handle.result()
        assert handle.telemetry.plan_behind_s == 0.0
        got = ck.load(ckpt_dir / "s.ckpt")
    assert got.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key].detach().resolve_conj(), value.detach().resolve_conj())


def _many(n: int, numel: int) -> dict[str, Any]:
    return {"state": {i: {"exp_avg": torch.full((numel,), float(i)),
                          "exp_avg_sq": torch.full((numel,), -float(i))} for i in range(n)},
            "step": 3}


@pytest.mark.parametrize(("n", "numel", "held"), [
    (1_250, 64, True),  # 2,500 tensors of 256 bytes: planning costs more than copying
    (500, 64, False),  # 1,000 tensors: a plan of milliseconds, on the caller's time
    (1_250, 16_384, False),  # 64 KiB per tensor: copying costs more than planning
])
def test_the_default_holds_only_many_small_tensors(ckpt_dir: Any, n: int, numel: int,
                                                   held: bool) -> None:
    state = _many(n, numel)
    before = torch_save_bytes(state)
    with stagesave.Checkpointer(ckpt_dir, writer="thread") as ck:
        handle = ck.save(state, "s.ckpt")
        state["state"][0]["exp_avg"].fill_(99.0)
        handle.result()
        assert (handle.telemetry.plan_behind_s > 0) is held
    assert_file_is_what_torch_save_writes(ckpt_dir / "s.ckpt", None, theirs_bytes=before)


def test_a_state_larger_than_the_limit_is_not_held(ckpt_dir: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(behind, "MAX_BYTES", 100_000)  # the state: 2,500 × 256 bytes
    with stagesave.Checkpointer(ckpt_dir, writer="thread") as ck:
        handle = ck.save(_many(1_250, 64), "s.ckpt")
        handle.result()
        assert handle.telemetry.plan_behind_s == 0.0


def test_saves_in_a_row_are_each_held_up_to_max_pending(ckpt_dir: Any) -> None:
    """Lightning saves ``last.ckpt`` right after the epoch's checkpoint: both held (one scratch
    copy each, at most ``max_pending``); each file as the state was at its save."""
    state = _many(1_250, 64)
    snapshots = []
    with stagesave.Checkpointer(ckpt_dir, writer="thread", max_pending=2) as ck:
        handles = []
        for i in range(4):
            state["step"] = i
            state["state"][1]["exp_avg"].fill_(float(i))
            snapshots.append(torch_save_bytes(state))
            handles.append(ck.save(state, f"s{i}.ckpt"))
        for h in handles:
            h.result()
        assert handles[0].telemetry.plan_behind_s > 0
        assert ck.memory.host.in_use() == 0
    for i, snap in enumerate(snapshots):
        assert_file_is_what_torch_save_writes(ckpt_dir / f"s{i}.ckpt", None, theirs_bytes=snap)


def test_close_right_after_a_held_save_commits_it(ckpt_dir: Any) -> None:
    state = _many(1_250, 64)
    before = torch_save_bytes(state)
    ck = stagesave.Checkpointer(ckpt_dir, writer="thread")
    handle = ck.save(state, "s.ckpt")
    ck.close()
    assert handle.done() and handle.telemetry.plan_behind_s > 0
    assert_file_is_what_torch_save_writes(ckpt_dir / "s.ckpt", None, theirs_bytes=before)


def test_a_held_save_is_written_by_the_writer_agent(ckpt_dir: Any) -> None:
    state = _many(1_250, 64)
    before = torch_save_bytes(state)
    with stagesave.Checkpointer(ckpt_dir, writer="process", plan_behind=True) as ck:
        t0 = time.perf_counter()
        handle = ck.save(state, "s.ckpt")
        waited = time.perf_counter() - t0
        state["state"][0]["exp_avg"].fill_(5.0)
        handle.result()
        tel = handle.telemetry
        assert tel.plan_behind_s > 0
        assert tel.blocking_s <= waited  # the background's plan is not counted as blocking
        agent = ck.writer.agent
        assert agent is not None and agent.pid is not None and agent.pid != os.getpid()
    assert_file_is_what_torch_save_writes(ckpt_dir / "s.ckpt", None, theirs_bytes=before)


_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "stagesave", "heldchild"])


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_trainer_killed_while_its_save_is_held_loses_at_most_that_save(
        tmp_path: Any, shm: Any, writer: str) -> None:
    """Real SIGKILLs at 10 moments after a held save returned (0 to 0.5 s: while its state is
    rebuilt, planned, staged, written, committed): the checkpoint before it is intact and
    ``latest()`` whenever the held one is not committed; a committed held save verifies and
    loads as saved; nothing else is listed; the agent exits."""
    outcomes = []
    for trial, delay in enumerate([0.0, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.25, 0.5]):
        root = tmp_path / f"t{trial}"
        parent, child = _ctx.Pipe()
        p = _ctx.Process(target=heldchild.held_then_die,
                         args=(str(root), str(shm), writer, delay, child))
        p.start()
        child.close()
        plan_s, agent = parent.recv()
        assert plan_s > 0  # the held save returned
        p.join(60)
        assert p.exitcode == -signal.SIGKILL, p.exitcode
        if writer == "process":  # it finishes what it was handed, then exits by itself
            assert agent is not None and exited(agent), "the agent did not exit"
        with stagesave.Checkpointer(root, writer="thread") as ck:
            listed = sorted(os.path.basename(i.path) for i in ck.list())
            assert listed in (["step-000.ckpt"], ["step-000.ckpt", "step-001.ckpt"]), listed
            for name in listed:
                assert ck.verify(root / name).status == "verified"
            best = ck.latest()
            assert best is not None
            got = ck.load(best.path)
        step = 1 if listed[-1] == "step-001.ckpt" else 0
        want = heldchild.held_state(1) if step else heldchild.small_state(0)
        assert got["step"] == step
        if step:
            assert all(torch.equal(got["state"][i][k], want["state"][i][k])
                       for i in (0, 617, 1_249) for k in ("exp_avg", "exp_avg_sq"))
        else:
            assert torch.equal(got["w"], want["w"])
        outcomes.append(step)
        for seg in owned_segments(str(shm)):  # the agent's snapshot of what it committed
            os.unlink(seg)
            if os.path.exists(seg + ".json"):
                os.unlink(seg + ".json")
    print(f"held saves committed before the kill ({writer}): {outcomes}")


@pytest.mark.usefixtures("any_size")
def test_odd_geometries_are_held_as_they_are(ckpt_dir: Any) -> None:
    """Tensors of no elements past their storage, a storage larger than its tensors, an
    expanded view (stride 0), a transposed view, one tensor over another's storage."""
    at5 = torch.empty(0, dtype=torch.float64)
    at5.set_(torch.UntypedStorage(16), 5, (0, 3), (3, 1))
    big = torch.arange(10.0)
    state = {"row": torch.zeros(2, 0)[1:], "at5": at5, "part": big[2:4],
             "again": big[::3], "expanded": torch.ones(3).expand(4, 3),
             "t": torch.arange(6.0).reshape(2, 3).t(), "step": 1}
    before = torch_save_bytes(state)
    with stagesave.Checkpointer(ckpt_dir, writer="thread") as ck:
        handle = ck.save(state, "s.ckpt")
        big.fill_(-1)
        handle.result()
        held = handle.telemetry.plan_behind_s > 0
    assert held
    assert_file_is_what_torch_save_writes(ckpt_dir / "s.ckpt", None, theirs_bytes=before)


@pytest.mark.usefixtures("any_size")
def test_what_torch_save_refuses_is_refused_by_save_itself(ckpt_dir: Any) -> None:
    """Two dtypes over one storage: ``save()`` raises (as without the option), nothing is
    written."""
    with stagesave.Checkpointer(ckpt_dir, writer="thread") as ck:
        with pytest.raises(stagesave.UnsupportedObjectError,
                           match="view the same data as different types"):
            ck.save(_two_dtypes(), "s.ckpt")
        assert ck.list() == []


def test_no_memory_for_the_held_copy_and_its_buffer_plans_on_the_callers_time(
        tmp_path: Any) -> None:
    """A real address-space limit with room for the state and one staging buffer, not for a
    held copy beside them: the save is planned on the caller's time and written (the copy, or
    the buffer leased after it, fails to map and is let go), never an error."""
    parent, child = _ctx.Pipe()
    p = _ctx.Process(target=heldchild.held_under_a_memory_limit, args=(str(tmp_path), child))
    p.start()
    child.close()
    held = parent.recv()
    p.join(120)
    assert p.exitcode == 0
    assert held is False
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        got = ck.load(tmp_path / "b.ckpt")
    assert torch.equal(got["t6999"], torch.full((7_000,), 6999.0))


def _saver(ck: stagesave.Checkpointer, state: dict[str, Any], tag: str, n: int,
           errors: list[BaseException]) -> None:
    try:
        for i in range(n):
            state["step"] = i
            ck.save(state, f"{tag}-{i}.ckpt").result()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


@pytest.mark.parametrize("max_pending", [1, 2])
def test_threads_saving_held_and_other_states_at_once_never_wait_on_each_other(
        ckpt_dir: Any, max_pending: int) -> None:
    """Three threads, one saving a state that is held at its first save, two saving small ones,
    through one Checkpointer: every save returns and is committed as saved (a held save's
    buffer was once leased on the writer thread, where a later save's buffer, leased first,
    could leave it none: a deadlock the review found)."""
    import threading

    errors: list[BaseException] = []
    states = [_many(1_250, 64), {"w": torch.ones(10), "step": 0}, {"v": torch.zeros(3), "step": 0}]
    with stagesave.Checkpointer(ckpt_dir, writer="thread", max_pending=max_pending) as ck:
        threads = [threading.Thread(target=_saver, args=(ck, s, f"t{k}", 6, errors), daemon=True)
                   for k, s in enumerate(states)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a save never returned"
        assert errors == []
        assert ck.memory.host.in_use() == 0
        got = ck.load(ckpt_dir / "t0-5.ckpt")
    assert got["step"] == 5 and torch.equal(got["state"][7]["exp_avg"], torch.full((64,), 7.0))


def test_two_storage_objects_over_one_memory_are_not_held(ckpt_dir: Any) -> None:
    """torch.save keeps two storage objects over one memory apart; a copy would make them two
    memories, and their template would never be reused: such a state is planned on the
    caller's time."""
    import numpy as np

    memory = np.arange(4, dtype=np.float32)
    state = {"a": torch.from_numpy(memory), "b": torch.from_numpy(memory)}
    state.update(_many(1_250, 64))
    with stagesave.Checkpointer(ckpt_dir, writer="thread") as ck:
        handle = ck.save(state, "s.ckpt")
        handle.result()
        assert handle.telemetry.plan_behind_s == 0.0
        got = ck.load(ckpt_dir / "s.ckpt")
    assert torch.equal(got["a"], torch.arange(4.0)) and torch.equal(got["b"], got["a"])


def test_a_held_save_that_fails_lets_its_copy_go(ckpt_dir: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan that fails on the writer thread (injected: nothing known fails there for real
    once ``save()`` held the state): the error reaches the caller, and neither it nor its
    traceback keeps the held copy (the rebuilt state's tensors view it)."""
    import gc
    import weakref

    copies: list[Any] = []
    real_hold = behind.hold

    def watched(*args: Any) -> Any:
        held = real_hold(*args)
        if held is not None:
            copies.append(weakref.ref(held.scratch))
        return held

    def failing(state: Any) -> Any:
        raise RuntimeError("injected: the plan failed")

    monkeypatch.setattr(behind, "hold", watched)
    ck = stagesave.Checkpointer(ckpt_dir, writer="thread")
    monkeypatch.setattr(ck.plans, "plan", failing)  # the writer thread's plan of the held save
    handle = ck.save(_many(1_250, 64), "s.ckpt")
    with pytest.raises(stagesave.CheckpointError, match="injected: the plan failed") as caught:
        handle.result()
    gc.collect()
    assert copies and copies[0]() is None, "the failed save's copy is still mapped"
    assert ck.memory.host.in_use() == 0
    del caught
    monkeypatch.undo()
    try:
        ck.close()
    except stagesave.CheckpointError as exc:  # the failure, if not delivered yet
        assert "injected" in str(exc)
    assert ck.list() == []


def test_saves_pending_when_close_times_out_are_still_written(ckpt_dir: Any) -> None:
    """``close(timeout)`` that gives up waiting says the saves are not committed yet and lets
    them go on while the process runs (its documented promise): a held save, whose staging
    comes after the close released the copy threads, and a plain one queued behind it are
    both written (before, the held one failed "closed", the plain one "cannot schedule new
    futures after shutdown")."""
    held_state = _many(1_250, 64)
    held_bytes = torch_save_bytes(held_state)
    plain = {"w": torch.arange(10.0), "step": 1}
    plain_bytes = torch_save_bytes(plain)
    ck = stagesave.Checkpointer(ckpt_dir, writer="thread")
    first = ck.save(held_state, "held.ckpt")
    second = ck.save(plain, "plain.ckpt")
    with pytest.raises(TimeoutError, match="not committed yet"):
        ck.close(timeout=0.001)
    first.result(60)
    second.result(60)
    assert first.telemetry.plan_behind_s > 0
    assert_file_is_what_torch_save_writes(ckpt_dir / "held.ckpt", None, theirs_bytes=held_bytes)
    assert_file_is_what_torch_save_writes(ckpt_dir / "plain.ckpt", None,
                                          theirs_bytes=plain_bytes)
