"""``StagedStorageWriter(extra_files=...)``: small files the coordinator commits with a sharded
folder (how Lightning's ``meta.pt`` gets into its sharded checkpoints through the core)."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest
import torch

import stagesave
import stagesave.dcp as sdcp
from stagesave.stores.local import LocalStore


def _meta(epoch: int) -> bytes:
    out = io.BytesIO()
    torch.save({"epoch": epoch}, out)
    return out.getvalue()


def test_extra_files_are_committed_with_the_folder_and_proven_by_it(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    data = _meta(4)
    with sdcp.StagedStorageWriter(root=root, commit_timeout=30, extra_files={"meta.pt": data}) as w:
        sdcp.save({"w": torch.ones(16)}, "sharded", writer=w).result(30)
        sdcp.save({"w": torch.ones(16)}, "next", writer=w).result(30)  # consumed by the first
    folder = root / "sharded"
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert (folder / "meta.pt").read_bytes() == data
    assert torch.load(folder / "meta.pt", weights_only=True) == {"epoch": 4}
    assert sorted(os.listdir(root / "next")) == [".metadata", "__0_0.distcp"]
    with stagesave.Checkpointer(root) as ck:
        info = ck.verify("sharded")
        assert info.status == "verified"
        assert info.manifest is not None and info.manifest.folder is not None
        assert [(e.name, e.size) for e in info.manifest.folder.listed] == [("meta.pt", len(data))]
        with open(folder / "meta.pt", "r+b") as f:
            f.seek(20)
            byte = f.read(1)
            f.seek(20)
            f.write(bytes([byte[0] ^ 0xFF]))
        checked = ck.verify("sharded")
    assert checked.status == "corrupt"
    assert any("meta.pt: checksum mismatch" in p for p in checked.problems), checked.problems


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "sub/meta.pt", "..", ""])
def test_an_extra_file_that_cannot_be_one_is_refused_before_anything_is_written(
    tmp_path: Path, name: str
) -> None:
    root = tmp_path / "ckpt"
    with sdcp.StagedStorageWriter(root=root, commit_timeout=30) as w:
        w.extra_files = {name: b"x"}
        with pytest.raises(ValueError, match="extra file|name"):
            sdcp.save({"w": torch.ones(4)}, "sharded", writer=w)
        assert not root.exists() or os.listdir(root) == []  # nothing written
        w.extra_files = {}
        sdcp.save({"w": torch.ones(4)}, "sharded", writer=w).result(30)  # the writer still works
    assert sorted(os.listdir(root / "sharded")) == [".metadata", "__0_0.distcp"]


def test_a_failed_extra_file_fails_the_save_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    real = LocalStore.put_atomic

    def full(self: LocalStore, name: str, data: bytes) -> None:
        # fault injection: a disk that fills up while the extra file is written
        if name.endswith("meta.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", name)
        real(self, name, data)

    with sdcp.StagedStorageWriter(root=root, commit_timeout=30) as w:
        sdcp.save({"w": torch.ones(4)}, "sharded", writer=w).result(30)  # the previous checkpoint
        monkeypatch.setattr(LocalStore, "put_atomic", full)
        w.extra_files = {"meta.pt": _meta(1)}
        with pytest.raises(stagesave.CheckpointError, match="cannot write the extra files.*space"):
            sdcp.save({"w": torch.full((4,), 2.0)}, "sharded", writer=w)
        monkeypatch.setattr(LocalStore, "put_atomic", real)
        w.wait(30)
    assert sorted(os.listdir(root)) == ["sharded"]  # no staging folder, no lease left behind
    assert sorted(os.listdir(root / "sharded")) == [".metadata", "__0_0.distcp"]
    got = {"w": torch.zeros(4)}
    sdcp.load(got, root / "sharded")
    assert torch.equal(got["w"], torch.ones(4))  # the previous checkpoint stands
