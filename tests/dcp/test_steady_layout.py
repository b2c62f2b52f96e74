"""Sharded saves of an unchanged plan reuse the rank file's layout and ``.metadata``'s pickle:
the files are the bytes a fresh writer writes, every value is this save's, and any change of
the plan (a shape, a dtype, a key, an object's pickled length) lays the file out again."""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_helpers import assert_same, folder_proof, proof
from hypothesis import given, settings
from hypothesis import strategies as st
from test_single_process import expected, mixed_state, zeros_like_state
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

import stagesave
import stagesave.dcp as sdcp
import stagesave.dcp._reader as reader_module  # its stored_tensor is observed by a spy
from stagesave.dcp._metadata_bytes import PROTOCOL, MetadataPickler
from stagesave.dcp._rankfile import SkeletonCache, layout_rank_file
from stagesave.dcp._read_items import stored_tensor
from stagesave.dcp._recent import Recent

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def save(writer: sdcp.StagedStorageWriter, state: dict[str, Any], name: str) -> Path:
    sdcp.save(state, name, writer=writer).result(60)
    return Path(writer.checkpointer.targets.root.url) / name  # type: ignore[union-attr]


def data_bytes(folder: Path) -> bytes:
    """The rank file's items (its proof, which names the save, follows them)."""
    rank = folder / "__0_0.distcp"
    summary = proof(rank).summary
    assert summary is not None
    return rank.read_bytes()[: summary.proof_offset]


def metadata_pickle(folder: Path) -> bytes:
    raw = (folder / ".metadata").read_bytes()
    return raw[: folder_proof(folder).files[0].end]


def loads_as(folder: Path, state: dict[str, Any]) -> None:
    """torch's own reader (no stagesave) gives back ``state``'s values."""
    got = zeros_like_state(state)
    dcp.load(got, checkpoint_id=str(folder))
    assert_same(got["model"], expected(state)["model"], "model")
    for key in ("step", "name", "sched"):
        assert got[key] == state[key], key
    assert np.array_equal(got["rng"], state["rng"])


def test_an_unchanged_plan_reuses_its_layout_and_writes_what_a_fresh_writer_writes(writers):
    steady, fresh = writers
    state = mixed_state()
    save(steady, state, "s1")
    layout = steady._layouts.entries[0]
    with torch.no_grad():
        state["model"]["w"].mul_(-2)  # training changed the values, not the structure
        state["model"]["column"].add_(1)  # a view of a bigger storage (copied contiguous)
    state["step"] = 13  # a byte item of the same pickled length
    second = save(steady, state, "s2")
    assert steady._layouts.entries == [layout]  # reused, not laid out again
    assert steady._metadata_pickler.reused == 1
    first_of_fresh = save(fresh, state, "s2")
    assert data_bytes(second) == data_bytes(first_of_fresh)
    md, md_fresh = (pickle.loads(metadata_pickle(f)) for f in (second, first_of_fresh))
    assert isinstance(md, Metadata) and md.storage_meta is not None
    assert dataclasses.replace(md, storage_meta=None) == dataclasses.replace(
        md_fresh, storage_meta=None)
    loads_as(second, state)
    assert md.storage_meta.save_id == folder_proof(second).metadata["dcp_save_id"]
    assert str(md.storage_meta.checkpoint_id).endswith("s2")


def test_tensors_at_new_addresses_are_copied_from_there(writers):
    """A reused layout keeps the host copies of its last save: reused while every tensor is at
    the same address, made again when one moved (a new tensor of the same shape)."""
    steady, fresh = writers
    state = {"model": {"w": torch.randn(64, 64), "b": torch.randn(64), "big": torch.randn(40_000),
                       "ids": torch.arange(10)}, "step": 1}
    save(steady, state, "s1")
    layout = steady._layouts.entries[0]
    assert layout.host is not None
    copies = layout.host[2]
    assert len(copies.small) == 3 and len(copies.big) == 1  # 160 KB: copied by memmove
    with torch.no_grad():
        state["model"]["w"].add_(1)
    state["step"] = 2
    second = save(steady, state, "s2")
    assert steady._layouts.entries == [layout] and layout.host[2] is copies  # same addresses
    assert data_bytes(second) == data_bytes(save(fresh, state, "s2"))
    for key in ("w", "big"):  # new storages: the old ones are freed (their memory reused)
        state["model"][key] = torch.randn(state["model"][key].shape)
    state["step"] = 3
    third = save(steady, state, "s3")
    assert steady._layouts.entries == [layout] and layout.host[2] is not copies
    fresh_third = save(fresh, state, "s3")
    assert data_bytes(third) == data_bytes(fresh_third)
    md, md_fresh = (pickle.loads(metadata_pickle(f)) for f in (third, fresh_third))
    assert md.storage_data == md_fresh.storage_data
    got = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    dcp.load(got, checkpoint_id=str(third))  # torch's own reader
    for k, v in state["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["step"] == 3


@pytest.mark.parametrize(
    "change",
    ["shape", "dtype", "new key", "key removed", "longer object", "tensor becomes object"],
)
def test_any_change_of_the_plan_lays_the_file_out_again(writers, change):
    steady, fresh = writers
    state = mixed_state()
    save(steady, state, "s1")
    layout = steady._layouts.entries[0]
    model = state["model"]
    if change == "shape":
        model["w"] = torch.randn(64, 49)
    elif change == "dtype":
        model["half"] = model["half"].float()
    elif change == "new key":
        model["extra"] = torch.arange(5)
    elif change == "key removed":
        del model["ids"]
    elif change == "longer object":
        state["name"] = "run-" + "a" * 300  # beyond the zip's alignment
    else:
        model["scalar"] = 2.5
    second = save(steady, state, "s2")
    assert steady._layouts.entries[0] is not layout and steady._layouts.entries[1] is layout
    assert data_bytes(second) == data_bytes(save(fresh, state, "s2"))
    got = zeros_like_state(state)
    dcp.load(got, checkpoint_id=str(second))
    assert_same(got["model"], expected(state)["model"], "model")
    assert got["name"] == state["name"]


def test_a_buffer_that_held_another_layout_gets_every_header_again(writers):
    """Plan A, plan B (another shape), plan A: the third save's staging buffer last held B's
    headers, so A's are written into it again (the files are a fresh writer's bytes)."""
    steady, fresh = writers
    a = mixed_state()
    b = mixed_state()
    b["model"]["w"] = torch.randn(48, 64)
    for name, state in (("a1", a), ("b", b), ("a2", a)):
        last = save(steady, state, name)
    assert data_bytes(last) == data_bytes(save(fresh, a, "a"))
    loads_as(last, a)


def test_the_spliced_metadata_pickle_is_the_pickle_of_the_metadata():
    base = Metadata(
        state_dict_metadata={},
        planner_data={"a": ("a",)},
        storage_data={},
        storage_meta=StorageMeta(checkpoint_id="/ckpt/step-1", save_id="1" * 32),
        version="1.0.0",
    )
    pickler = MetadataPickler()
    assert pickler.dumps(base) == pickle.dumps(base, protocol=PROTOCOL)
    for cid, sid in (("/ckpt/step-2", "2" * 32), ("s3://bucket/a/much/longer/path/step-3", "ä")):
        nxt = dataclasses.replace(base, storage_meta=StorageMeta(checkpoint_id=cid, save_id=sid))
        out = pickler.dumps(nxt)
        assert out == pickle.dumps(nxt, protocol=PROTOCOL) and pickle.loads(out) == nxt
    assert pickler.reused == 2
    changed = dataclasses.replace(nxt, planner_data={"b": ("b",)})  # another plan: pickled anew
    assert pickler.dumps(changed) == pickle.dumps(changed, protocol=PROTOCOL)
    assert pickler.reused == 2
    odd = dataclasses.replace(base, storage_meta=StorageMeta(checkpoint_id=Path("/p"), save_id="x"))
    assert pickle.loads(pickler.dumps(odd)) == odd  # not a plain string: pickled whole
    bare = dataclasses.replace(base, storage_meta=None)
    assert pickle.loads(pickler.dumps(bare)).storage_meta is None


_ITEM = st.one_of(
    st.integers(0, 300).map(lambda n: b"\x01" * n),  # a byte item's blob (any length)
    st.tuples(st.sampled_from([torch.float32, torch.float16, torch.int8, torch.bool]),
              st.lists(st.integers(0, 9), max_size=3)),  # a tensor: dtype, shape
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_ITEM, min_size=1, max_size=12))
def test_headers_padding_data_and_blobs_tile_the_file(specs):
    """Whatever the order of tensors (empty ones too) and blobs of any length, the image's
    pieces and slots cover every byte once (a reused buffer keeps no stale byte), items start
    64-byte aligned, and the file ends with its last item."""
    items, objects = [], []
    for i, spec in enumerate(specs):
        index = MetadataIndex(f"k{i}")
        if isinstance(spec, bytes):
            items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
            objects.append(io.BytesIO(spec))
        else:
            items.append(WriteItem(index=index, type=WriteItemType.TENSOR))
            objects.append(torch.ones(spec[1], dtype=spec[0]))
    by_index = dict(zip((item.index for item in items), objects))
    rank = layout_rank_file(items, lambda item: by_index[item.index], "f", SkeletonCache())
    image = rank.image
    spans = sorted([(off, off + len(data)) for off, data in image.pieces if data]
                   + [(s.offset, s.offset + s.nbytes) for s in image.slots])
    covered = 0
    for lo, hi in spans:
        assert lo == covered, f"gap or overlap at {covered}..{lo}"
        covered = hi
    assert covered == image.size and image.gapless
    infos = [r.storage_data for r in rank.results]
    assert all(i.offset % 64 == 0 for i in infos) and infos[0].offset == 0
    assert infos[-1].offset + infos[-1].length == image.size
    known: Recent[Any] = Recent()
    known.add(rank.layout)
    again = layout_rank_file(items, lambda item: by_index[item.index], "f", SkeletonCache(),
                             known)
    assert again.layout is rank.layout and again.image.pieces == image.pieces


class _Marked(torch.Tensor):
    """A tensor subclass: DCP's items for it may depend on more than its dtype and size."""


@pytest.mark.parametrize(
    "change",
    ["values only", "shape", "dtype", "requires_grad", "key order", "flattening",
     "tensor subclass"],
)
def test_the_planner_reuses_its_plans_only_for_the_same_structure(tmp_path, change):
    writer = sdcp.StagedStorageWriter(root=tmp_path, commit_timeout=60)
    try:
        state: dict[str, Any] = {"a": {"w": torch.randn(4, 3), "b.c": torch.arange(6.0)},
                                 "step": 1}
        save(writer, state, "s1")
        a = state["a"]
        if change == "values only":
            a["w"] = a["w"] * 2  # a new tensor object, same structure
        elif change == "shape":
            a["w"] = torch.randn(3, 4)
        elif change == "dtype":
            a["w"] = a["w"].double()
        elif change == "requires_grad":
            a["w"] = torch.nn.Parameter(a["w"])
        elif change == "key order":
            state["a"] = {"b.c": a["b.c"], "w": a["w"]}
        elif change == "flattening":  # the same flat keys from another nesting
            state = {"a": {"w": a["w"]}, "a.b": {"c": a["b.c"]}, "step": 1}
        else:
            a["w"] = a["w"].as_subclass(_Marked)
        state["step"] = 2
        folder = save(writer, state, "s2")
        reused = (writer.planner.reused_local, writer.planner.reused_global)
        if change == "tensor subclass":  # planned by DCP, whose plan is the same as before
            assert reused == (0, 1)
        else:
            assert reused == ((1, 1) if change == "values only" else (0, 0))
        # a subclass is pickled whole, as FileSystemWriter does: torch.load must know the class
        with torch.serialization.safe_globals([_Marked]):
            whole = sdcp.to_state_dict(folder)
        assert torch.equal(whole["a"]["w"].as_subclass(torch.Tensor),
                           state["a"]["w"].detach().as_subclass(torch.Tensor))
        c = whole["a.b"]["c"] if change == "flattening" else whole["a"]["b.c"]
        assert torch.equal(c, torch.arange(6.0))
        assert whole["step"] == 2
    finally:
        writer.close()


def test_a_reused_plan_resolves_each_key_to_this_saves_tensor(writers):
    """Items of a reused plan are resolved by their tensors' places in the state: tensors
    swapped between keys, replaced by new objects or changed in place, and a byte item's new
    value, are each saved under their own key, as a fresh writer saves them."""
    steady, fresh = writers
    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {
        "model": {f"l{i}": torch.randn(8, 4, generator=g) for i in range(6)},
        "optim": {"state": {i: {"m": torch.randn(8, 4, generator=g), "step": i}
                            for i in range(3)}},
        "name": "run",
    }
    save(steady, state, "s1")
    save(steady, state, "s2")
    planner = steady.planner
    local = planner._local
    assert local is not None and local.resolved is not None  # the positions were kept
    items = local.resolved[0]
    model = state["model"]
    model["l0"], model["l3"] = model["l3"], model["l0"]  # two tensors swap keys
    model["l1"] = torch.randn(8, 4, generator=g)  # a new object, same facts
    with torch.no_grad():
        state["optim"]["state"][2]["m"].mul_(-1)
    state["optim"]["state"][1]["step"] = 7  # a byte item: resolved again
    state["name"] = "Run"
    third = save(steady, state, "s3")
    assert planner._local is local and local.resolved[0] is items  # resolved by position
    assert planner.reused_local == 2
    assert data_bytes(third) == data_bytes(save(fresh, state, "s3"))
    whole = sdcp.to_state_dict(third)
    for k, v in model.items():
        assert torch.equal(whole["model"][k], v), k
    saved = whole["optim"]["state"]  # DCP's keys are strings
    assert torch.equal(saved["2"]["m"], state["optim"]["state"][2]["m"])
    assert saved["1"]["step"] == 7 and whole["name"] == "Run"
    # the same items in another list (another global plan): resolved by key, the same objects
    again = planner.resolve_items(list(items))
    assert [type(x) for x in again] == [type(x) for x in planner.resolve_items(items)]
    tensors = [x for x in again if isinstance(x, torch.Tensor)]
    assert len(tensors) == 9 and all(
        any(t is v for v in (*model.values(), *(s["m"] for s in state["optim"]["state"].values())))
        for t in tensors)


def test_a_state_without_tensors_is_resolved_by_place_too(writers):
    """Every item a byte item: the places are all DCP's rule, and a steady save writes what a
    fresh writer writes."""
    steady, fresh = writers
    state: dict[str, Any] = {"epoch": 1, "name": "run", "groups": [{"lr": 0.1, "params": [0]}]}
    for i in range(3):
        state["epoch"] = i
        last = save(steady, state, f"s{i}")
    assert steady.planner.resolved_by_place >= 1
    assert data_bytes(last) == data_bytes(save(fresh, state, "s2"))
    assert sdcp.to_state_dict(last)["epoch"] == 2


class _Rewriting(sdcp.SteadySavePlanner):
    """A subclass that changes the state after planning (its ``finish_plan`` runs between the
    plan and the writer's resolution of the items)."""

    def finish_plan(self, new_plan: Any) -> Any:
        for key, value in list(self.state_dict.items()):
            if isinstance(value, torch.Tensor):
                self.state_dict[key] = torch.full_like(value, 5.0)
        return super().finish_plan(new_plan)


def test_a_subclass_changing_the_state_after_planning_is_resolved_from_the_state(tmp_path):
    writer = sdcp.StagedStorageWriter(root=tmp_path, commit_timeout=60)
    planner = _Rewriting()
    try:
        state = {"a": torch.zeros(2), "b": torch.ones(2), "step": 1}
        for step in range(4):
            state["step"] = step
            dcp.save(state, checkpoint_id=str(tmp_path / f"s{step}"), storage_writer=writer,
                     planner=planner)
            writer.wait()
            whole = sdcp.to_state_dict(tmp_path / f"s{step}")
            assert torch.equal(whole["a"], torch.full((2,), 5.0)), step
            assert torch.equal(whole["b"], torch.full((2,), 5.0)), step
        assert planner.reused_local == 3 and planner.resolved_by_place == 0
    finally:
        writer.close()


def test_the_steady_planner_saves_through_dcps_own_writer(tmp_path):
    """The planner's name for its global plans stays its own (``planner_data``): a storage
    writer that fills in ``storage_data`` only where it is empty (``FileSystemWriter``) saves."""
    planner = sdcp.SteadySavePlanner()
    state = {"w": torch.arange(6.0), "n": 1}
    for step in range(3):
        state["n"] = step
        with torch.no_grad():
            state["w"].add_(1)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / f"s{step}")),
                 planner=planner)
        got = {"w": torch.zeros(6), "n": -1}
        dcp.load(got, checkpoint_id=str(tmp_path / f"s{step}"))
        assert torch.equal(got["w"], state["w"]) and got["n"] == step
    assert planner.reused_global == 2


def test_a_rank_given_a_named_plan_again_gets_the_items_it_kept(tmp_path):
    """``finish_plan``: the same name (:class:`ItemsToken`) gives the items list kept with it
    (each of a few names kept); a subclass keeps the items it is given."""
    from torch.distributed.checkpoint.planner import SavePlan

    from stagesave.dcp._steady_planner import ItemsToken

    def plan(name: str, items: list[Any]) -> SavePlan:
        return SavePlan(items=items, planner_data=ItemsToken(name, 0))

    a1, b1, a2, b2 = (["a"], ["b"], ["a"], ["b"])  # equal lists, distinct objects
    planner = sdcp.SteadySavePlanner()
    assert planner.finish_plan(plan("A", a1)).items is a1
    assert planner.finish_plan(plan("B", b1)).items is b1
    assert planner.finish_plan(plan("A", a2)).items is a1  # named before: the kept list
    assert planner.finish_plan(plan("B", b2)).items is b1
    assert planner.finish_plan(SavePlan(items=a2)).items is a2  # no name
    sub = _Rewriting()
    sub.state_dict = {}
    assert sub.finish_plan(plan("A", a1)).items is a1
    assert sub.finish_plan(plan("A", a2)).items is a2


def test_the_planner_refuses_dcp_plan_caching():
    with pytest.raises(ValueError, match="enable_plan_caching"):
        sdcp.SteadySavePlanner(enable_plan_caching=True)


def test_a_writer_alternating_between_structures_reuses_each(tmp_path):
    """Accelerate saves each model and each optimizer as a folder of its own through one writer:
    each structure's plans, layout and metadata pickle are found again."""
    writer = sdcp.StagedStorageWriter(root=tmp_path, commit_timeout=60)
    try:
        model = {"model": {"w": torch.randn(8, 4), "b": torch.randn(8)}}
        optim = {"optimizer": {"state": {"0": {"exp_avg": torch.randn(8, 4), "step": 1}}}}
        for step in range(1, 5):
            model["model"]["w"].add_(1)
            optim["optimizer"]["state"]["0"]["step"] = step
            for name, state in (("model", model), ("optim", optim)):
                folder = save(writer, state, f"{name}-{step}")
                whole = sdcp.to_state_dict(folder)
                if name == "model":
                    assert torch.equal(whole["model"]["w"], model["model"]["w"])
                else:
                    assert whole["optimizer"]["state"]["0"]["step"] == step
        planner = writer.planner
        assert (planner.reused_local, planner.reused_global) == (6, 6)
        assert writer._metadata_pickler.reused == 6 and len(writer._layouts.entries) == 2
        # each structure's items resolved by place from its third save, its shape kept
        assert planner.resolved_by_place == 4
        assert all(e.resolved is not None and e.resolved[3] is not None
                   for e in planner._locals.entries)
    finally:
        writer.close()


def test_tensor_items_of_a_stagesave_folder_are_read_without_unpickling(writers, tmp_path,
                                                                        monkeypatch):
    """An item whose bytes around its data are exactly the zip stagesave writes for its dtype
    and size is read as a view of the bytes read (no torch.load); others (FileSystemWriter's,
    whose zips carry their data's CRCs) are unpickled as before. Both load the same values."""
    found: list[bool] = []
    real = reader_module.stored_tensor

    def spy(*args: Any) -> Any:
        tensor = real(*args)
        found.append(tensor is not None)
        return tensor

    monkeypatch.setattr(reader_module, "stored_tensor", spy)
    state = mixed_state()
    ours = save(writers[0], state, "ours")
    loads_as(ours, state)  # torch's own reader
    whole = sdcp.to_state_dict(ours)
    assert_same(whole["model"], expected(state)["model"], "model")
    assert len(found) >= 10 and all(found)  # every tensor item DCP reads of mixed_state
    reads = len(found)
    found.clear()
    dcp.save(state, checkpoint_id=str(tmp_path / "plain"))  # FileSystemWriter
    whole = sdcp.to_state_dict(tmp_path / "plain", verify=False)
    assert_same(whole["model"], expected(state)["model"], "model")
    assert found == [False] * reads


def test_an_item_that_is_not_the_expected_zip_is_not_read_as_a_view():
    skeletons = SkeletonCache()
    sk = skeletons.get(torch.float32, (3, 4))
    data = torch.arange(12, dtype=torch.float32)
    blob = bytearray(sk.head + data.numpy().tobytes() + sk.tail)
    window = torch.frombuffer(blob, dtype=torch.uint8)
    chunk = (torch.float32, torch.Size([3, 4]))
    got = stored_tensor(window, 0, memoryview(blob), chunk, skeletons)
    assert got is not None and torch.equal(got, data.view(3, 4))
    for where in (10, sk.data_offset - 1, len(blob) - 5):  # the pickle, the header, the tail
        changed = bytearray(blob)
        changed[where] ^= 0x01
        view = memoryview(changed)
        assert stored_tensor(torch.frombuffer(changed, dtype=torch.uint8), 0, view, chunk,
                             skeletons) is None
    other = (torch.float32, torch.Size([4, 3]))  # another size: another pickle
    assert stored_tensor(window, 0, memoryview(blob), other, skeletons) is None
    assert stored_tensor(window, 0, memoryview(blob)[:-1], chunk, skeletons) is None
    assert stored_tensor(window, 0, memoryview(blob), None, skeletons) is None
    huge = (torch.float32, torch.Size([1 << 40]))  # metadata claiming 4 TiB: nothing is planned
    assert stored_tensor(window, 0, memoryview(blob), huge, skeletons) is None
    assert skeletons.misses == 2  # the two sizes that fit the item were planned, no more


@pytest.mark.parametrize("verify", [True, False])
def test_a_load_over_many_windows_reads_each_while_the_last_is_delivered(tmp_path, verify):
    """Windows of one chunk each: the two read buffers take turns many times, and a window's
    bytes are never overwritten before its items were copied out (every value comes back)."""
    ckpt = stagesave.Checkpointer(tmp_path, chunk_bytes=64 << 10)
    writer = sdcp.StagedStorageWriter(checkpointer=ckpt, commit_timeout=60)
    try:
        g = torch.Generator().manual_seed(4)
        state = {f"t{i}": torch.randn(1000 + 37 * i, generator=g) for i in range(60)}
        state["step"] = 9
        folder = save(writer, state, "many")
    finally:
        writer.close()
        ckpt.close()
    reader = sdcp.StagedStorageReader(window_bytes=64 << 10, verify=verify)
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    sdcp.load(got, folder, reader=reader)
    for k, v in state.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


def test_closing_the_writer_drops_what_it_kept_for_later_saves(tmp_path):
    writer = sdcp.StagedStorageWriter(root=tmp_path, commit_timeout=60)
    state = {"w": torch.randn(5), "step": 1}
    save(writer, state, "a")
    save(writer, state, "b")
    assert writer.planner.reused_local == 1 and writer._layouts.entries
    writer.close()
    assert not writer._layouts.entries and writer.planner.reused_local == 0
    assert writer._metadata_pickler.reused == 0


@pytest.mark.skipif(not torch.accelerator.is_available(),
                    reason="needs an accelerator to pin memory; this machine has none "
                           "(GPU path untested here)")
def test_a_tensor_pinned_between_saves_is_planned_again(tmp_path):
    """The plan's tensor properties hold whether a tensor is pinned: pinning one between two
    saves (same shape, dtype, values) must not reuse the plan made before."""
    writer = sdcp.StagedStorageWriter(root=tmp_path, commit_timeout=60)
    try:
        state = {"w": torch.randn(4, 4), "step": 1}
        save(writer, state, "s1")
        state["w"] = state["w"].pin_memory()
        state["step"] = 2
        folder = save(writer, state, "s2")
        assert writer.planner.reused_local == 0
        meta = dcp.FileSystemReader(str(folder)).read_metadata()
        assert meta.state_dict_metadata["w"].properties.pin_memory is True
    finally:
        writer.close()
