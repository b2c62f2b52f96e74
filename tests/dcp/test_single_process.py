"""Sharded checkpoints in one process (DCP without a process group): format, staging semantics,
integrity, safety, retention, and the errors users meet."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_helpers import assert_same, folder_proof, proof
from proofkit import flip_byte as flip
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

import stagesave
import stagesave.dcp as sdcp
import stagesave.dcp._rankjob as writer_module  # faults wrap write_rank where the rank job calls it
from stagesave.dcp._metadata import load_metadata  # reads .metadata to inspect what was stored
from stagesave.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    StorageError,
    UnsafeCheckpointError,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def mixed_state() -> dict[str, Any]:
    """Every kind of leaf DCP meets: dtypes, 0-d/empty/views/expanded tensors, plain objects."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(40, 30, generator=g)
    return {
        "model": {
            "w": torch.randn(64, 48, generator=g),
            "half": torch.randn(7, 5, generator=g).half(),
            "bf16": torch.randn(9, generator=g).bfloat16(),
            "ids": torch.arange(11, dtype=torch.int64),
            "mask": torch.rand(13, generator=g) > 0.5,
            "cplx": torch.randn(4, 3, dtype=torch.complex64, generator=g),
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
            "column": base[:, 7],  # a strided view of a bigger storage
            "rows": base[10:20],  # a contiguous view into it
            "expanded": torch.randn(1, 6, generator=g).expand(4, 6),  # stride 0
        },
        "step": 12,
        "name": "run-a",
        "rng": np.random.RandomState(0).get_state()[1][:8].copy(),
        "sched": {"milestones": [3, 5], "gamma": 0.5},
    }


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = zeros_like_state(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        else:
            out[k] = None
    return out


def expected(state: dict[str, Any]) -> dict[str, Any]:
    """What a load yields: every tensor as a plain contiguous copy, other leaves as they were."""
    return {
        k: expected(v)
        if isinstance(v, dict)
        else (v.contiguous().clone() if isinstance(v, torch.Tensor) else v)
        for k, v in state.items()
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def writer(root: Path):
    w = sdcp.StagedStorageWriter(root=root, commit_timeout=60)
    yield w
    w.close()


def saved(writer: sdcp.StagedStorageWriter, state: dict[str, Any], name: str, **kw: Any) -> Path:
    sdcp.save(state, name, writer=writer, **kw).result(60)
    return Path(writer.checkpointer.targets.root.url) / name  # type: ignore[union-attr]


# ------------------------------------------------------------------ format and round trips
def test_round_trip_through_torch_reader_and_stagesave_reader(writer):
    state = mixed_state()
    folder = saved(writer, state, "step-12")
    want = expected(state)
    plain = zeros_like_state(state)
    dcp.load(plain, checkpoint_id=str(folder))  # torch's own FileSystemReader, no stagesave
    ours = zeros_like_state(state)
    sdcp.load(ours, folder)
    for got in (plain, ours):
        assert_same(got["model"], want["model"], "model")
        assert got["step"] == 12 and got["name"] == "run-a" and got["sched"] == state["sched"]
        assert np.array_equal(got["rng"], state["rng"])
    whole = sdcp.to_state_dict(folder)
    assert_same(whole["model"], want["model"], "to_state_dict")
    assert stagesave.verify(folder).status == "verified"


def test_save_returns_after_staging_and_later_changes_do_not_leak(writer, root, monkeypatch):
    gate = threading.Event()
    real = writer_module.write_rank

    def held(*args: Any, **kwargs: Any) -> Any:
        gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "write_rank", held)
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    handle = sdcp.save(state, "step-1", writer=writer)
    # dcp.save returned while nothing was written yet: the bytes are only in the staging buffer.
    assert not handle.done() and not (root / "step-1").exists()
    state["w"].add_(1)  # training goes on and updates the tensor in place
    gate.set()
    found = stagesave.latest(root)  # in this process, latest() waits for the pending save
    assert found is not None and found.name == "step-1" and handle.done()
    tel = handle.result(30)
    assert tel.error is None and tel.blocking_s > 0 and tel.committed_at is not None
    assert tel.bytes == (root / "step-1" / "__0_0.distcp").stat().st_size
    # The staged bytes are the file's data; its proof follows them.
    rank = proof(root / "step-1" / "__0_0.distcp")
    assert (
        rank.summary is not None
        and 4000 < rank.summary.proof_offset < tel.bytes
        and tel.tensor_bytes == 4000
    )
    loaded = {"w": torch.zeros(1000), "step": 0}
    sdcp.load(loaded, root / "step-1")
    assert torch.equal(loaded["w"], torch.arange(1000, dtype=torch.float32)) and loaded["step"] == 1


@pytest.mark.gpu
def test_cuda_state_is_staged_on_a_side_stream_into_pinned_memory(writer, root):
    dev = torch.device("cuda")
    w = torch.randn(1024, 1024, device=dev)
    strided = torch.arange(10, device=dev)[::2]
    ref_w, ref_v = w.clone(), strided.clone()
    handle = sdcp.save({"w": w, "v": strided, "step": 3}, "gpu", writer=writer)
    w.add_(1)  # on the current stream: ordered after the staging copy, never seen by the save
    handle.result(60)
    assert writer.checkpointer.memory.host.pinned
    got = {
        "w": torch.zeros(1024, 1024, device=dev),
        "v": torch.zeros(5, dtype=torch.long, device=dev),
        "step": 0,
    }
    sdcp.load(got, root / "gpu")
    assert got["w"].device.type == "cuda" and torch.equal(got["w"], ref_w)
    assert torch.equal(got["v"], ref_v) and got["step"] == 3


def test_folder_holds_what_filesystemwriter_writes_and_each_file_carries_its_proof(
    writer, root, tmp_path
):
    state = {"a": torch.randn(3, 3), "b": torch.randn(5), "n": 1}
    folder = saved(writer, state, "s")
    dcp.save(state, checkpoint_id=str(tmp_path / "plain"))  # torch's own FileSystemWriter
    assert (
        sorted(os.listdir(folder))
        == sorted(os.listdir(tmp_path / "plain"))
        == [".metadata", "__0_0.distcp"]
    )
    assert sorted(os.listdir(root)) == ["s"]  # no staging folder, no marker beside it

    raw_md = (folder / ".metadata").read_bytes()
    md = pickle.loads(raw_md)  # what FileSystemReader does: the proof after the pickle is ignored
    assert (
        isinstance(md, Metadata) and load_metadata(raw_md, "test").storage_data == md.storage_data
    )

    carrier = folder_proof(folder)  # .metadata carries the folder's proof
    assert carrier.files[0].kind == "dcp-metadata" and carrier.seq == 1
    assert (
        carrier.folder is not None
        and carrier.folder.carrier == ".metadata"
        and carrier.folder.listed == []
    )
    save_id = carrier.metadata["dcp_save_id"]
    assert (
        carrier.folder.token == save_id
        and md.storage_meta is not None
        and md.storage_meta.save_id == save_id
    )
    assert (
        carrier.metadata["dcp_world_size"] == 1
        and carrier.metadata["format"] == "torch.distributed.checkpoint"
    )
    assert carrier.files[0].end < len(raw_md)  # the proof follows the pickle

    rank = proof(folder / "__0_0.distcp")  # the rank file carries its own, pinned by the carrier
    assert rank.manifest is not None and rank.summary is not None
    assert (
        rank.manifest.files[0].kind == "dcp"
        and rank.manifest.seq is None
        and rank.summary.seq is None
    )
    assert rank.summary.folder == save_id and rank.summary.carrier == ".metadata"
    assert [(m.name, m.size, m.proof_crc) for m in carrier.folder.members] == [
        ("__0_0.distcp", (folder / "__0_0.distcp").stat().st_size, rank.proof_crc)]

    data = (folder / "__0_0.distcp").read_bytes()
    ends = []
    for index, info in md.storage_data.items():
        assert info.relative_path == "__0_0.distcp" and info.offset % 64 == 0
        ends.append(info.offset + info.length)
        if index.fqn != "n":
            # a torch.save zip per tensor
            assert data[info.offset : info.offset + 4] == b"PK\x03\x04"
    assert min(i.offset for i in md.storage_data.values()) == 0  # no header before the first item
    # the proof follows the last item
    assert rank.manifest.files[0].end == max(ends) == rank.summary.proof_offset

    second = folder_proof(saved(writer, state, "t"))
    assert second.seq == 2 and second.folder is not None and second.folder.token != save_id


def test_replacing_a_folder_keeps_one_committed_copy(writer, root):
    saved(writer, {"w": torch.zeros(8), "step": 1}, "last")
    saved(writer, {"w": torch.ones(8), "step": 2}, "last")
    assert sorted(os.listdir(root)) == ["last"]  # no staging or aside folder left
    got = {"w": torch.empty(8), "step": 0}
    sdcp.load(got, root / "last")
    assert torch.equal(got["w"], torch.ones(8)) and got["step"] == 2


def test_split_replicated_planner_stores_row_blocks(writer):
    w = torch.randn(10, 4)
    planner = sdcp.SplitReplicatedPlanner(split_bytes=64, pieces=3)
    folder = saved(writer, {"w": w, "b": torch.ones(2)}, "split", planner=planner)
    md = load_metadata((folder / ".metadata").read_bytes(), "test")
    chunks = md.state_dict_metadata["w"].chunks  # type: ignore[union-attr]
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [
        ((0, 0), (4, 4)),
        ((4, 0), (3, 4)),
        ((7, 0), (3, 4)),
    ]
    got = {"w": torch.zeros(10, 4), "b": torch.zeros(2)}
    dcp.load(got, checkpoint_id=str(folder))  # torch's reader reassembles the blocks
    assert torch.equal(got["w"], w)
    with pytest.raises(ValueError, match="enable_plan_caching"):
        sdcp.SplitReplicatedPlanner(enable_plan_caching=True)


# ------------------------------------------------------------------ the core sees sharded folders
def test_retention_latest_and_remove_treat_the_folder_as_one_checkpoint(root):
    ckpt = stagesave.Checkpointer(root, keep_last=2)
    seen: list[Any] = []
    ckpt.telemetry_callback = seen.append
    w = sdcp.StagedStorageWriter(checkpointer=ckpt, metadata={"step": 0})
    for step in (1, 2, 3):
        w.metadata = {"step": step}
        sdcp.save({"w": torch.full((4,), float(step))}, f"step-{step}", writer=w)
    ckpt.wait()
    assert sorted(os.listdir(root)) == ["step-2", "step-3"]
    latest = ckpt.latest()
    assert latest is not None and latest.name == "step-3" and latest.manifest is not None
    assert latest.manifest.metadata["step"] == 3
    assert [t.path.rsplit("/", 1)[1] for t in seen] == ["step-1", "step-2", "step-3"]
    assert all(t.committed_at is not None and t.error is None for t in seen)
    ckpt.remove("step-3").result()  # ordered after the saves, like any checkpoint
    assert [c.name for c in ckpt.list()] == ["step-2"]
    w.close()
    ckpt.close()


def test_tiered_store_uploads_the_committed_folder(tmp_path):
    from stagesave.stores.tiered import TieredStore

    tier = TieredStore(tmp_path / "local", tmp_path / "remote")
    ckpt = stagesave.Checkpointer(tier)
    w = sdcp.StagedStorageWriter(checkpointer=ckpt)
    for step in (1, 2):
        sdcp.save(
            {"w": torch.full((100, 10), float(step)), "step": step}, f"step-{step}", writer=w
        ).result(30)
    uploads = tier.wait_uploads(60)
    assert [u.error for u in uploads] == [None, None]
    assert sorted(os.listdir(tmp_path / "remote" / "step-2")) == [".metadata", "__0_0.distcp"]
    remote = stagesave.latest(tmp_path / "remote", verify=True)
    assert remote is not None and remote.name == "step-2" and remote.status == "verified"
    got = {"w": torch.zeros(100, 10), "step": 0}
    sdcp.load(got, tmp_path / "remote" / "step-2")
    assert torch.equal(got["w"], torch.full((100, 10), 2.0)) and got["step"] == 2
    w.close()
    ckpt.close()
    tier.close()


# ------------------------------------------------------------------ integrity
@pytest.fixture
def two_saves(writer, root) -> tuple[Path, Path]:
    a = saved(writer, {"w": torch.randn(256, 64), "step": 1}, "step-1")
    b = saved(writer, {"w": torch.randn(256, 64), "step": 2}, "step-2")
    return a, b


def test_flipped_byte_in_a_rank_file_is_caught(two_saves, root):
    _, b = two_saves
    md = load_metadata((b / ".metadata").read_bytes(), "test")
    info = md.storage_data[MetadataIndex("w", torch.Size([0, 0]))]
    flip(b / "__0_0.distcp", info.offset + info.length - 100)  # inside the tensor's bytes
    with pytest.raises(
        IntegrityError, match=r"__0_0\.distcp: checksum mismatch in bytes \[0, \d+\) \(chunk 0\)"
    ):
        sdcp.load({"w": torch.zeros(256, 64), "step": 0}, b)
    assert stagesave.verify(b).status == "corrupt"
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-2"):
        latest = stagesave.latest(root, verify=True)
    assert latest is not None and latest.name == "step-1"


def test_tampered_metadata_is_caught_before_unpickling(two_saves):
    _, b = two_saves
    flip(b / ".metadata", 40)
    with pytest.raises(IntegrityError, match=r"\.metadata: checksum mismatch"):
        sdcp.load({"w": torch.zeros(256, 64), "step": 0}, b)


def test_truncated_and_stale_rank_files_are_refused(two_saves, writer, root):
    a, b = two_saves
    # The same shapes give the same data size; the proofs' numbers (CRCs, times) may differ in
    # width by a byte or two: save A and B again, in turn, until the sizes match, so only the
    # proofs tell them apart (re-saving A alone failed once in 50 tries when B's proof was the
    # rare short one).
    for i in range(50):
        if (a / "__0_0.distcp").stat().st_size == (b / "__0_0.distcp").stat().st_size:
            break
        if i % 2:
            saved(writer, {"w": torch.randn(256, 64), "step": 2}, "step-2")
        else:
            saved(writer, {"w": torch.randn(256, 64), "step": 1}, "step-1")
    assert (a / "__0_0.distcp").stat().st_size == (b / "__0_0.distcp").stat().st_size
    shutil.copy(a / "__0_0.distcp", b / "__0_0.distcp")
    with pytest.raises(
        IntegrityError, match=r"__0_0\.distcp belongs to another save than its folder"
    ):
        sdcp.load({"w": torch.zeros(256, 64), "step": 0}, b)
    assert stagesave.verify(b).status == "corrupt"
    with open(a / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(
        IntegrityError, match=r"__0_0\.distcp is 1000 bytes, its folder's proof says \d+"
    ):
        sdcp.load({"w": torch.zeros(256, 64), "step": 0}, a)
    # Neither is chosen: step-1's rank file is truncated, step-2's belongs to another save (its
    # summary names another token: caught by a listing, without reading the data)
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-"):
        assert stagesave.latest(root) is None
    statuses = {c.name: c.status for c in stagesave.list_checkpoints(root)}
    assert statuses == {"step-1": "corrupt", "step-2": "corrupt"}


def test_a_file_the_proof_does_not_list_is_never_read(two_saves):
    _, b = two_saves
    (b / "notes.txt").write_text("added after the commit")
    # a rank file of no rank, that torch's reader would read if the metadata named it
    (b / "__1_0.distcp").write_bytes(b"\x00" * 100)
    info = stagesave.verify(b)
    assert (info.status, info.beside) == ("verified", ["__1_0.distcp", "notes.txt"])
    got = {"w": torch.zeros(256, 64), "step": 0}
    sdcp.load(got, b)
    assert got["step"] == 2

def test_the_newest_is_the_highest_sequence_number_not_the_newest_clock(writer, root):
    saved(writer, {"w": torch.zeros(4)}, "b")
    saved(writer, {"w": torch.ones(4)}, "a")
    old = 1_000_000_000
    os.utime(root / "a", (old, old))
    for f in (root / "a").iterdir():
        os.utime(f, (old, old))
    assert [(c.name, c.seq) for c in stagesave.list_checkpoints(root)] == [("a", 2), ("b", 1)]
    assert stagesave.latest(root).name == "a"


def test_folder_without_manifest_needs_verify_false(tmp_path):
    state = {"w": torch.randn(5, 5), "step": 4}
    dcp.save(state, checkpoint_id=str(tmp_path / "plain"))  # torch's FileSystemWriter
    with pytest.raises(
        IntegrityError, match="has no stagesave proof, so it cannot be proven complete"
    ):
        sdcp.load({"w": torch.zeros(5, 5), "step": 0}, tmp_path / "plain")
    got = {"w": torch.zeros(5, 5), "step": 0}
    sdcp.load(got, tmp_path / "plain", reader=sdcp.StagedStorageReader(verify=False))
    assert torch.equal(got["w"], state["w"]) and got["step"] == 4
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
        sdcp.load({"w": torch.zeros(5, 5)}, tmp_path / "missing")


# ------------------------------------------------------------------ safety
class Hyper:
    """A user class stored as a non-tensor item (not on the safe allow-list)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Hyper) and other.lr == self.lr


def test_unsafe_items_need_an_allow_list_entry_or_trust(writer):
    folder = saved(writer, {"w": torch.ones(2), "hyper": Hyper(0.1)}, "h")
    with pytest.raises(
        UnsafeCheckpointError, match=r"needs the global .*Hyper.*allow_globals\(Hyper\)"
    ):
        sdcp.load({"w": torch.zeros(2), "hyper": None}, folder)
    for reader in (
        sdcp.StagedStorageReader(safe_globals=[Hyper]),
        sdcp.StagedStorageReader(trusted=True),
    ):
        got: dict[str, Any] = {"w": torch.zeros(2), "hyper": None}
        sdcp.load(got, folder, reader=reader)
        assert got["hyper"] == Hyper(0.1)


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned",))


def test_metadata_unpickler_refuses_code():
    evil = pickle.dumps(  # type: ignore[list-item]
        Metadata(state_dict_metadata={}, storage_meta=StorageMeta(modules=[_Evil()]))
    )
    with pytest.raises(
        UnsafeCheckpointError, match=r"needs posix\.system, which is not one of the classes"
    ):
        load_metadata(evil, "x/.metadata")
    with pytest.raises(ManifestError, match="not a readable DCP metadata pickle"):
        load_metadata(b"not a pickle", "x/.metadata")
    with pytest.raises(ManifestError, match="holds a dict, not DCP metadata"):
        load_metadata(pickle.dumps({"a": 1}), "x/.metadata")


def test_storage_data_cannot_point_outside_the_folder(tmp_path):
    folder = tmp_path / "plain"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(folder))
    md = pickle.loads((folder / ".metadata").read_bytes())
    index = next(iter(md.storage_data))
    md.storage_data[index] = _StorageInfo("../../etc/passwd", 0, 10)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(
        ManifestError, match=r"points outside the folder \('\.\./\.\./etc/passwd'\)"
    ):
        sdcp.load({"w": torch.zeros(3)}, folder, reader=sdcp.StagedStorageReader(verify=False))


# ------------------------------------------------------------------ failures and misuse
def test_background_failure_is_delivered_and_nothing_is_committed(writer, root, monkeypatch):
    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module, "write_rank", disk_full)
    handle = sdcp.save({"w": torch.ones(4)}, "step-1", writer=writer)
    assert isinstance(handle.exception(30), StorageError)
    monkeypatch.undo()
    # Not claimed through the handle: the next save raises it, as for every stagesave save.
    with pytest.raises(StorageError, match="no space left on the device"):
        sdcp.save({"w": torch.ones(4)}, "step-2", writer=writer)
    assert stagesave.latest(root) is None and os.listdir(root) == []  # no staging debris
    sdcp.save({"w": torch.ones(4)}, "step-3", writer=writer).result(30)  # and it recovers
    assert stagesave.latest(root).name == "step-3"


def test_misuse_is_refused_with_the_reason(writer, root):
    with pytest.raises(ValueError, match="needs dcp.save\\(use_collectives=True\\)"):
        dcp.save(
            {"w": torch.ones(2)},
            checkpoint_id=str(root / "a"),
            storage_writer=writer,
            use_collectives=False,
        )
    response = dcp.async_save(
        {"w": torch.ones(2)}, checkpoint_id=str(root / "b"), storage_writer=writer
    )
    with pytest.raises(CheckpointException, match="meant for dcp.save, not dcp.async_save"):
        response.result(60)  # type: ignore[union-attr]
    planner = DefaultSavePlanner(enable_plan_caching=True)
    sdcp.save({"w": torch.ones(2)}, "c1", writer=writer, planner=planner).result(30)
    # stagesave.dcp.save re-raises a stagesave error as itself (a UsageError is a RuntimeError too)
    with pytest.raises(stagesave.UsageError, match="enable_plan_caching=False"):
        sdcp.save({"w": torch.ones(2)}, "c2", writer=writer, planner=planner)
    with pytest.raises(ValueError, match="got a checkpointer and checkpointer options"):
        sdcp.StagedStorageWriter(checkpointer=writer.checkpointer, keep_last=2)
    assert issubclass(sdcp.CommitTimeoutError, CheckpointError) and issubclass(
        sdcp.CommitTimeoutError, TimeoutError
    )


# ------------------------------------------------------------------ format 1 and other layouts
def _format1_folder(folder: Path, state: dict[str, Any], chunk_bytes: int = 4096) -> None:
    """A sharded folder as stagesave 1.x committed it: DCP's files plus
    ``checkpoint.stagesave.json``
    (every file with its size and the xxh3-128 digests of its chunks), written last."""
    from stagesave.ondisk.checksum import digest
    from stagesave.ondisk.manifest import FileEntry, Manifest

    dcp.save(state, checkpoint_id=str(folder))
    entries = []
    for name in sorted(os.listdir(folder)):
        data = (folder / name).read_bytes()
        chunks = tuple(
            digest("xxh3_128", data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)
        )
        entries.append(FileEntry(name, len(data), "xxh3_128", chunk_bytes, chunks,
                                 "dcp-metadata" if name == ".metadata" else "dcp"))
    manifest = Manifest(
        entries, 1_700_000_000_000_000_000, metadata={"format": "torch.distributed.checkpoint"}
    )
    (folder / "checkpoint.stagesave.json").write_bytes(manifest.to_json())


def test_format1_folders_still_list_verify_and_load(writer, root):
    state = {"w": torch.randn(128, 64), "step": 7}
    _format1_folder(root / "old", state)
    info = stagesave.latest(root)  # verifies by default, format-1 folders too
    assert (
        info is not None
        and info.name == "old"
        and info.format == 1
        and info.is_dir
        and info.status == "verified"
    )
    cheap = stagesave.latest(root, verify=False)
    assert (
        cheap is not None
        and cheap.name == "old"
        and cheap.format == 1
        and cheap.status == "committed"
    )
    assert stagesave.verify(root / "old").status == "verified"
    got = {"w": torch.zeros(128, 64), "step": 0}
    sdcp.load(got, root / "old")
    assert torch.equal(got["w"], state["w"]) and got["step"] == 7
    # A format-2 save in the same root is newer than any format-1 checkpoint, whatever the clocks
    # say.
    saved(writer, {"w": torch.ones(2)}, "new")
    assert [(c.name, c.format) for c in stagesave.list_checkpoints(root)] == [
        ("new", 2),
        ("old", 1),
    ]
    # Chunks are still checked against the format-1 manifest before DCP sees a byte.
    md = load_metadata((root / "old" / ".metadata").read_bytes(), "test")
    info_w = md.storage_data[MetadataIndex("w", torch.Size([0, 0]))]
    flip(root / "old" / info_w.relative_path, info_w.offset + info_w.length - 10)
    with pytest.raises(
        IntegrityError, match=r"\.distcp: checksum mismatch in bytes \[\d+, \d+\) \(chunk \d+\)"
    ):
        sdcp.load({"w": torch.zeros(128, 64), "step": 0}, root / "old")
    assert stagesave.verify(root / "old").status == "corrupt"


def test_replacing_a_format1_folder_leaves_a_format2_one(writer, root):
    _format1_folder(root / "last", {"w": torch.zeros(8), "step": 1})
    saved(writer, {"w": torch.ones(8), "step": 2}, "last")
    assert sorted(os.listdir(root / "last")) == [".metadata", "__0_0.distcp"]
    info = stagesave.latest(root)
    assert info is not None and info.format == 2 and info.seq == 1


def test_object_store_commit_rewrites_in_place_and_leaves_nothing_else(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    url = "memory://dcp-objects"
    with sdcp.StagedStorageWriter(root=url, commit_timeout=30) as w:
        sdcp.save({"w": torch.zeros(64, 8), "step": 1}, "last", writer=w).result(30)
        # A file the next save will not write (e.g. the part of a rank that the new world lacks).
        fs.pipe_file("/dcp-objects/last/__3_0.distcp", b"left by an older save of four ranks")
        sdcp.save({"w": torch.ones(64, 8), "step": 2}, "last", writer=w).result(30)
    assert sorted(p.rpartition("/")[2] for p in fs.find("/dcp-objects")) == [
        ".metadata",
        "__0_0.distcp",
    ]
    info = stagesave.latest(url)
    # The old carrier was gone before the new one took its number: the only checkpoint, seq 1.
    assert info is not None and info.name == "last" and info.status == "verified" and info.seq == 1
    assert [c.name for c in stagesave.list_checkpoints(url)] == ["last"]
    assert stagesave.verify(f"{url}/last").status == "verified"
    got = {"w": torch.zeros(64, 8), "step": 0}
    sdcp.load(got, f"{url}/last")
    assert torch.equal(got["w"], torch.ones(64, 8)) and got["step"] == 2
    # The old carrier goes before any rank writes: a half-rewritten folder is never valid.
    data = bytearray(fs.cat_file("/dcp-objects/last/__0_0.distcp"))
    data[10] ^= 0xFF
    fs.pipe_file("/dcp-objects/last/__0_0.distcp", bytes(data))
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        sdcp.load({"w": torch.zeros(64, 8), "step": 0}, f"{url}/last")
    fs.rm("/dcp-objects", recursive=True)


class _WriterWithHookFile(sdcp.StagedStorageWriter):
    """Like Lightning's sharded writer: the coordinator puts a file into the folder being staged."""

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        plans = super().prepare_global_plan(plans)
        staging = plans[0].storage_data.staging
        local = self.checkpointer.targets.root.local_path(staging)
        os.makedirs(local, exist_ok=True)
        with open(os.path.join(local, "meta.pt"), "wb") as f:
            torch.save({"epoch": 4}, f)
        return plans


def test_files_put_into_the_staging_folder_are_proven_with_it(root):
    with _WriterWithHookFile(root=root, commit_timeout=30) as w:
        sdcp.save({"w": torch.ones(16)}, "sharded", writer=w).result(30)
    folder = root / "sharded"
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "meta.pt"]
    carrier = folder_proof(folder)
    assert carrier.folder is not None
    assert [(e.name, e.size) for e in carrier.folder.listed] == [
        ("meta.pt", (folder / "meta.pt").stat().st_size)
    ]
    assert torch.load(folder / "meta.pt", weights_only=True) == {"epoch": 4}
    assert stagesave.verify(folder).status == "verified"
    flip(folder / "meta.pt", 40)
    checked = stagesave.verify(folder)
    assert checked.status == "corrupt" and any(
        "meta.pt: checksum mismatch" in p for p in checked.problems
    )


_REPLACER = """
import os, sys, time, warnings
warnings.simplefilter("ignore")
import torch
import stagesave.dcp as sdcp
root = sys.argv[1]
cap = time.monotonic() + 180
with sdcp.StagedStorageWriter(root=root, commit_timeout=60, chunk_bytes=256 * 1024) as w:
    step = 0
    # on until the reader has seen enough (its stop file) and 3 saves were made
    while not (step >= 3 and os.path.exists(root + "/stop")) and time.monotonic() < cap:
        step += 1
        sdcp.save({"w": torch.full((1024, 1024), float(step)), "step": step}, "last",
                  writer=w).result(60)
        if step == 1:
            open(root + "/ready", "w").close()
print(step)
"""


def test_loads_while_another_process_replaces_the_folder_never_fail(root):
    import subprocess
    import sys
    import time

    root.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", _REPLACER, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not (root / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the replacing process did not start"
            )
            time.sleep(0.05)
        loads, errors = 0, []
        enough = time.monotonic() + 6  # loads for 6 s at least, and at least 10
        while proc.poll() is None:
            if loads >= 10 and time.monotonic() > enough and not (root / "stop").exists():
                (root / "stop").touch()
            got = {"w": torch.zeros(1024, 1024), "step": 0}
            try:
                if loads % 2:
                    latest = stagesave.latest(root)
                    assert latest is not None and latest.name == "last"
                    sdcp.load(got, latest.path)
                else:
                    sdcp.load(got, root / "last")
            except Exception as exc:  # noqa: BLE001 - counted: there must be none
                errors.append(f"{type(exc).__name__}: {exc}")
            else:  # one save's tensor and step, never a mix
                assert got["step"] >= 1 and torch.equal(
                    got["w"], torch.full((1024, 1024), float(got["step"]))
                )
            loads += 1
        saves = int(proc.communicate(timeout=60)[0])
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and saves >= 3
    assert errors == [] and loads >= 10, (loads, errors[:3])


@pytest.mark.parametrize(
    ("checksum", "checksum_in"),
    [("crc32", "background"), ("sha256", "staging"), ("xxh3_128", "background")],
)
def test_every_checksum_and_where_it_is_computed(root, checksum, checksum_in):
    state = {"w": torch.randn(300, 200), "step": 5}
    with sdcp.StagedStorageWriter(
        root=root,
        commit_timeout=30,
        checksum=checksum,
        checksum_in=checksum_in,
        chunk_bytes=64 * 1024,
    ) as w:
        sdcp.save(state, "s", writer=w).result(30)
    carrier = folder_proof(root / "s")
    rank = proof(root / "s" / "__0_0.distcp")
    assert carrier.files[0].algorithm == checksum and rank.manifest is not None
    assert rank.manifest.files[0].algorithm == checksum and len(rank.manifest.files[0].chunks) > 1
    assert stagesave.verify(root / "s").status == "verified"
    got = {"w": torch.zeros(300, 200), "step": 0}
    sdcp.load(got, root / "s")
    assert torch.equal(got["w"], state["w"]) and got["step"] == 5
    md = load_metadata((root / "s" / ".metadata").read_bytes(), "test")
    info = md.storage_data[MetadataIndex("w", torch.Size([0, 0]))]
    flip(root / "s" / "__0_0.distcp", info.offset + info.length - 1)
    with pytest.raises(
        IntegrityError,
        match=r"__0_0\.distcp: checksum mismatch in bytes \[\d+, \d+\) \(chunk \d+\)",
    ):
        sdcp.load({"w": torch.zeros(300, 200), "step": 0}, root / "s")


def test_an_item_in_a_file_the_proof_does_not_list_is_refused_without_verifying(two_saves):
    """Without ``verify`` the reader still knows the proof's list when given it (Lightning's
    ``verify_on_load=False``): an item stored in any other file is refused before it is read."""
    from stagesave.dcp import StagedStorageReader

    _, b = two_saves
    reader = StagedStorageReader(b, verify=False, listed=frozenset({".metadata"}))
    with pytest.raises(IntegrityError, match=r"is stored in __0_0\.distcp, which its proof does "
                                             r"not list as a data file"):
        reader.read_metadata()
    listed = stagesave.verify(b).manifest.folder.names()
    assert StagedStorageReader(b, verify=False, listed=frozenset(listed)).read_metadata()
