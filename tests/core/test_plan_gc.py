"""The plan pauses Python's garbage collector, and leaves its on/off state as it found it."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

# _plan_torch_file: the same plan without the collector pause, to compare with
from stagesave.saving.plan import _plan_torch_file, gc_paused, plan_torch_file


def _state(n: int = 200) -> dict:
    return {"model": {f"w{i}": torch.full((4,), float(i)) for i in range(n)},
            "meta": [{"step": i, "name": f"layer{i}"} for i in range(n)]}


def _count_collections(run: Any) -> int:
    starts: list[int] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(info["generation"])

    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation, if the collector is on
    gc.callbacks.append(callback)
    try:
        run()
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*old)
    return len(starts)


def test_no_collection_runs_while_planning():
    state = _state()
    with gc_paused():
        paused = _count_collections(lambda: [{"x": [i]} for i in range(1000)])
    unpaused = _count_collections(lambda: _plan_torch_file(state))  # the same plan, no pause
    images: list[Any] = []
    # only around the pause: entering and leaving it allocates a little
    during_plan = _count_collections(lambda: images.append(plan_torch_file(state)))
    after = _count_collections(lambda: [{"x": [i]} for i in range(1000)])  # back on afterwards
    assert paused == 0
    assert unpaused > 100 and during_plan <= 8, (unpaused, during_plan)
    assert after > 0 and gc.isenabled()
    assert len(images[0].slots) == 200

def test_a_disabled_collector_stays_disabled():
    gc.disable()
    try:
        plan_torch_file(_state(3))
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_collector_is_back_on_after_an_unpicklable_state():
    import threading

    from stagesave.errors import UnsupportedObjectError

    try:
        plan_torch_file({"lock": threading.Lock()})
    except UnsupportedObjectError:
        pass
    else:  # pragma: no cover - the assertion below says why
        raise AssertionError("a lock must be refused")
    assert gc.isenabled()


def test_pauses_nest_and_overlap_across_threads():
    import threading

    inside = threading.Event()
    leave = threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        assert inside.wait(10) and not gc.isenabled()
    assert not gc.isenabled()  # the other thread's pause is still on
    leave.set()
    t.join(10)
    assert gc.isenabled()
    with gc_paused(), gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def _cyclic_garbage_of(action: Any) -> int:
    """How many objects ``action`` leaves that only the cyclic collector can free."""
    gc.collect()
    gc.disable()
    try:
        action()
        return gc.collect()
    finally:
        gc.enable()


def test_planning_leaves_no_garbage_for_the_collector():
    # A reference cycle in a plan keeps its per-tensor objects alive until the collector runs,
    # and that collection (400,000 objects at 100,000 tensors: ~0.2 s) then runs inside the
    # next save. The first save (planner, template, index, marked copy) and a steady one.
    from stagesave.saving import fastplan
    from stagesave.saving.steady import PlanCache
    from stagesave.saving.walk import walk

    state = _state(50)
    cache = PlanCache()
    first = _cyclic_garbage_of(lambda: cache.plan(state))
    assert cache._template is not None  # the first save made a template
    state["meta"][0]["step"] = 7
    steady = _cyclic_garbage_of(lambda: cache.plan(state))
    walked = _cyclic_garbage_of(lambda: walk(state))
    scratch = _cyclic_garbage_of(lambda: fastplan.plan(state))
    assert (first, steady, walked, scratch) == (0, 0, 0, 0)


def test_a_whole_save_and_a_load_run_no_collection(tmp_path):
    """Not only the plan: staging and handing the layout to the writer agent made enough
    objects at the first save of 100,000 tensors for the collector to take 0.5 s there; a load
    makes a few objects per tensor. Saves and loads leave the collector as they found it."""
    import stagesave

    state = _state()
    with stagesave.Checkpointer(tmp_path, writer="process") as ck:
        handles = []
        counts = [_count_collections(lambda i=i: handles.append(ck.save(state, f"c{i}.ckpt")))
                  for i in range(2)]  # the first save of a structure, then a steady one
        for h in handles:
            h.result()
        loaded: list[Any] = []
        counts.append(_count_collections(lambda: loaded.append(ck.load("c1.ckpt"))))
        assert gc.isenabled()
        gc.disable()
        try:
            ck.save(state, "c2.ckpt").result()
            assert not gc.isenabled()
        finally:
            gc.enable()
    # entering and leaving a pause allocates a little; unpaused this state makes hundreds
    assert all(n <= 16 for n in counts), counts  # unpaused: 831 and 143 for the two saves
    assert torch.equal(loaded[0]["model"]["w7"], state["model"]["w7"])
    assert _count_collections(lambda: [{"x": [i]} for i in range(1000)]) > 0


def _collections_at_default_thresholds(run: Any) -> int:
    starts: list[int] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(info["generation"])

    gc.collect()  # the young generations empty: what follows counts from zero
    gc.callbacks.append(callback)
    try:
        run()
    finally:
        gc.callbacks.remove(callback)
    return len(starts)


def test_a_large_load_leaves_no_collection_behind(tmp_path):
    """The objects of a loaded state go to the oldest generation when the pause ends: the
    next allocations do not start a collection of all of them (at the end of a 100,000-tensor
    load: 90-205 ms)."""
    import stagesave

    state = {"model": {f"w{i}": torch.full((2,), float(i)) for i in range(5000)}}
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.save(state, "c.ckpt").result()
        loaded: list[Any] = []
        after: list[Any] = []
        n = _collections_at_default_thresholds(
            lambda: (loaded.append(ck.load("c.ckpt")), after.extend({} for _ in range(300))))
        assert n == 0
        assert gc.get_count()[0] < gc.get_threshold()[0]
        assert torch.equal(loaded[0]["model"]["w4321"], state["model"]["w4321"])
        # the state is still collected normally once it is garbage
        probe = loaded[0]["model"]
        probe["self"] = probe  # a cycle through the loaded dict
        ref = weakref.ref(loaded[0]["model"]["w1"])
        loaded.clear()
        del probe
        gc.collect()
        assert ref() is None


def test_a_small_pause_leaves_the_generations_alone():
    gc.collect()
    young = [{} for _ in range(300)]
    before = gc.get_count()[0]
    with gc_paused():
        pass
    assert gc.get_count()[0] >= before - 5  # nothing promoted: the count was not reset
    assert len(young) == 300


def test_objects_the_process_froze_stay_frozen(tmp_path):
    import stagesave

    state = {"model": {f"w{i}": torch.full((2,), float(i)) for i in range(5000)}}
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
            ck.save(state, "c.ckpt").result()
            loaded = ck.load("c.ckpt")
        assert gc.get_freeze_count() == frozen
        assert torch.equal(loaded["model"]["w7"], state["model"]["w7"])
    finally:
        gc.unfreeze()
