"""Bad input gets a clear error at save() time and loses nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
import torch

import stagesave
from stagesave.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    ClosedError,
    StorageError,
    UnsupportedObjectError,
)


def _mount_tmpfs(path, options):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({r.stderr.strip()}); needs root in a sandbox that allows "
            "mounts"
        )


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "size=2m")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def readonly_fs(tmp_path):
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "size=4m")
    stagesave.save({"old": torch.ones(3)}, mnt / "prev.ckpt")
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_unpicklable_object_named_at_save(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        with pytest.raises(UnsupportedObjectError, match=r"optimizer\.hook .*lock") as ei:
            ck.save({"optimizer": {"hook": threading.Lock()}, "w": torch.ones(1)}, "x.ckpt")
        assert isinstance(ei.value, TypeError)
        assert ck.pending() == 0
    assert list(ckpt_dir.iterdir()) == []


def test_disk_full_at_save_time_keeps_previous(small_fs):
    with stagesave.Checkpointer(small_fs) as ck:
        ck.save({"w": torch.ones(1000)}, "good.ckpt").result()
        with pytest.raises(StorageError, match="no space left") as ei:
            ck.save({"w": torch.ones(4 << 20)}, "big.ckpt")  # 16 MiB on a 2 MiB disk
        assert isinstance(ei.value, OSError)
        assert torch.equal(ck.load("good.ckpt")["w"], torch.ones(1000))
        ck.save({"w": torch.zeros(10)}, "after.ckpt").result()  # works once it fits
    assert sorted(p.name for p in small_fs.iterdir() if not p.name.endswith(".json")) == [
        "after.ckpt",
        "good.ckpt",
    ]


def test_disk_full_at_save_time_names_the_folder_not_its_hidden_sibling(small_fs):
    from stagesave.formats import Safetensors

    with stagesave.Checkpointer(small_fs) as ck, pytest.raises(StorageError) as ei:
        ck.save_dir({"model.safetensors": Safetensors({"w": torch.ones(4 << 20)}),
                     "optimizer.bin": {"step": 1}}, "checkpoint_0")
    message = str(ei.value)
    assert f"cannot write checkpoint {small_fs / 'checkpoint_0'}: no space left" in message
    assert ".stagesave-tmp" not in message
    assert list(small_fs.iterdir()) == []


def test_disk_full_during_background_write_surfaces_and_leaves_no_debris(small_fs):
    filler = small_fs / "filler"
    with stagesave.Checkpointer(small_fs) as ck:
        ck.save({"w": torch.ones(1000)}, "good.ckpt").result()
        # Passes the synchronous check, then the disk fills before the background write.
        gate = threading.Event()
        ck.pipeline.queue.submit(gate.wait)
        h = ck.save({"w": torch.ones(300_000)}, "late.ckpt")  # ~1.2 MB
        filler.write_bytes(b"x" * (small_fs.stat().st_size and 0))
        with open(filler, "wb") as f:
            try:
                f.write(b"x" * (3 << 20))
            except OSError:
                pass
        gate.set()
        with pytest.raises(StorageError, match="no space left"):
            h.result(timeout=30)
        filler.unlink()
        ck.save({"w": torch.zeros(3)}, "late.ckpt").result()  # the next save succeeds
    names = sorted(p.name for p in small_fs.iterdir())
    assert not any(".stagesave-tmp" in n for n in names), names
    assert torch.equal(stagesave.load(small_fs / "late.ckpt")["w"], torch.zeros(3))


def test_read_only_target_fails_at_save_time(readonly_fs):
    with stagesave.Checkpointer(readonly_fs) as ck:
        with pytest.raises(CheckpointPermissionError, match="read-only"):
            ck.save({"w": torch.ones(3)}, "new.ckpt")
        assert torch.equal(ck.load("prev.ckpt")["old"], torch.ones(3))


def test_permission_denied_as_unprivileged_user(tmp_path):
    target = tmp_path / "rootonly"
    target.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    code = (
        "import os, sys, torch, stagesave\n"
        "os.setgid(65534); os.setuid(65534)  # everything imported first: ~root is not readable\n"
        "try:\n"
        f"    stagesave.Checkpointer().save({{'w': torch.ones(1)}}, {str(target / 'x.ckpt')!r})\n"
        "except PermissionError as e:\n"
        "    print(type(e).__name__, e); sys.exit(3)\n"
    )
    if os.getuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HOME": "/tmp"}, check=False)
    assert r.returncode == 3, r.stderr
    assert "CheckpointPermissionError" in r.stdout and "permission" in r.stdout.lower()


def test_target_is_a_directory_or_under_a_file(ckpt_dir):
    (ckpt_dir / "adir").mkdir()
    (ckpt_dir / "afile").write_text("x")
    with stagesave.Checkpointer(ckpt_dir) as ck:
        with pytest.raises(CheckpointError, match="a directory of that name exists"):
            ck.save({}, "adir")
        with pytest.raises(CheckpointError, match="not a directory"):
            ck.save({}, "afile/x.ckpt")


def test_the_root_itself_is_not_a_checkpoint_name(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        for name in ("", ".", "./"):
            with pytest.raises(ValueError, match=rf"invalid checkpoint name '{re.escape(name)}': "
                               r"it names the root .* itself; name a file or folder inside it"):
                ck.save({"a": 1}, name)
            with pytest.raises(ValueError, match=r"it names the root .* itself"):
                ck.save_dir({"o.bin": {"a": 1}}, name)
    assert os.listdir(ckpt_dir) == []


def test_load_of_a_folder_says_it_is_one(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save_dir({"optimizer.bin": {"a": 1}}, "ck").result()
        with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint file at .*/ck: it is a "
                           r"folder \(a folder checkpoint's files load one by one"):
            ck.load(ckpt_dir / "ck")
        assert ck.load(ckpt_dir / "ck" / "optimizer.bin") == {"a": 1}


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="max_pending"):
        stagesave.Checkpointer(max_pending=0)
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'.*blake3"):
        stagesave.Checkpointer(checksum="md5")
    with pytest.raises(ValueError, match="keep_last"):
        stagesave.Checkpointer(keep_last=0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        stagesave.Checkpointer(chunk_bytes=1000)


def test_traversal_names_refused(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        for bad in ("../escape.ckpt", "a/../../b.ckpt"):
            with pytest.raises(ValueError, match="invalid checkpoint name"):
                ck.save({}, bad)
        with pytest.raises(ValueError, match="invalid file name"):
            ck.save_dir({"../x.bin": {}}, "d")


def test_missing_checkpoint_is_file_not_found(ckpt_dir):
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
        stagesave.load(ckpt_dir / "nope.ckpt")
    with pytest.raises(FileNotFoundError):
        stagesave.verify(ckpt_dir / "nope.ckpt")
    assert stagesave.latest(ckpt_dir / "empty") is None


def test_save_after_close(ckpt_dir):
    ck = stagesave.Checkpointer(ckpt_dir)
    ck.close()
    with pytest.raises(ClosedError, match="closed"):
        ck.save({}, "x.ckpt")
    ck.close()  # idempotent


def test_background_error_surfaces_once_via_next_save_wait_and_close(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    ck = stagesave.Checkpointer(victim)
    gate = threading.Event()
    ck.save({"a": 1}, "warm.ckpt").result()
    ck.pipeline.queue.submit(gate.wait)
    h = ck.save({"a": torch.ones(10)}, "x.ckpt")
    victim.rename(tmp_path / "moved")  # the target directory is replaced by a file under the save
    victim.write_text("not a directory")
    gate.set()
    assert isinstance(h.exception(timeout=30), StorageError)
    with pytest.raises(StorageError, match="saving checkpoint .*x.ckpt failed"):
        ck.wait()
    ck.wait()  # delivered once: not raised again
    ck.close()
    assert not (tmp_path / "moved" / "x.ckpt").exists()


def test_close_raises_undelivered_failure_but_context_manager_never_masks(tmp_path):
    victim = tmp_path / "v"
    victim.mkdir()
    with pytest.raises(KeyError, match="user error"), stagesave.Checkpointer(victim) as ck:
        gate = threading.Event()
        ck.save({"a": 1}, "warm.ckpt").result()
        ck.pipeline.queue.submit(gate.wait)
        ck.save({"a": 2}, "x.ckpt")
        victim.rename(tmp_path / "gone")
        victim.write_text("not a directory")
        gate.set()
        raise KeyError("user error")


@pytest.mark.parametrize(("metadata", "message"), [
    ({"lr": float("nan")}, "JSON values"),
    ({"x": object()}, "JSON values"),
    ("not a dict", "must be a dict"),
])
def test_metadata_a_reader_would_refuse_is_refused_at_save(tmp_path, metadata, message):
    with (
        stagesave.Checkpointer(tmp_path) as ck,
        pytest.raises(UnsupportedObjectError, match=message),
    ):
        ck.save({"w": torch.ones(2)}, "a.ckpt", metadata=metadata)
    assert os.listdir(tmp_path) == []


def test_metadata_nested_deeper_than_a_reader_accepts_is_refused_at_save(tmp_path):
    deep: dict[str, object] = {}
    inner = deep
    for _ in range(150):
        inner["d"] = {}
        inner = inner["d"]  # type: ignore[assignment]
    with stagesave.Checkpointer(tmp_path) as ck:
        with pytest.raises(UnsupportedObjectError, match="nests deeper than 100 levels"):
            ck.save({"w": torch.ones(2)}, "a.ckpt", metadata={"deep": deep})
        ck.save(
            {"w": torch.ones(2)}, "b.ckpt", metadata={"ok": {"a": [1, 2, {"b": None}]}}
        ).result()
    assert os.listdir(tmp_path) == ["b.ckpt"]
    assert stagesave.verify(tmp_path / "b.ckpt").manifest.metadata == {  # type: ignore[union-attr]
        "ok": {"a": [1, 2, {"b": None}]}
    }
