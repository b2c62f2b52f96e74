"""Folder checkpoints on a tiered root assembled in ``staging_dir``: the checkpoint folder (the
local tier) never holds anything but committed folders, the committed folder is uploaded to the
remote tier (SeaweedFS on loopback, behind the fault proxy), and a failure leaves no staging
debris and the previous checkpoint intact on both tiers."""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from s3help import big_state, object_names, open_uploads, small_state, split_url
from typing_extensions import Self

import stagesave
from stagesave.stores.local import LocalStore
from stagesave.stores.s3 import RetryPolicy
from stagesave.stores.tiered import TieredStore

pytestmark = pytest.mark.s3

@pytest.fixture
def store(tmp_path, proxy, make_store, s3_url) -> Iterator[TieredStore]:
    """A TieredStore over ``tmp_path/local`` and ``s3_url`` through the fault proxy."""
    remote = make_store(
        s3_url, proxy.endpoint, retry=RetryPolicy(max_attempts=2, base_delay_s=0.01)
    )
    tiered = TieredStore(LocalStore(str(tmp_path / "local")), remote, remote_retry_after_s=0.0)
    yield tiered
    tiered.close()


def _remote_bytes(s3_server, url: str, name: str) -> bytes:
    bucket, prefix = split_url(url)
    return s3_server.client().get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read()


def _assert_uploaded(s3_server, s3_url: str, local: Path, folder: str) -> None:
    """Every file of the local committed folder is on the remote tier, byte for byte, and nothing
    else."""
    names = sorted(os.listdir(local / folder))
    bucket, prefix = split_url(s3_url)
    listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{folder}/")
    assert sorted(o["Key"].rpartition("/")[2] for o in listed.get("Contents", [])) == names
    for name in names:
        assert (
            _remote_bytes(s3_server, s3_url, f"{folder}/{name}")
            == (local / folder / name).read_bytes()
        ), name


def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


class _Watcher:
    """Lists a folder over and over from a thread, recording every name it ever saw there."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.seen.update(os.listdir(self.folder))
            except FileNotFoundError:
                pass

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_folder_is_assembled_in_staging_dir_committed_locally_then_uploaded(
        store, tmp_path, s3_server, s3_url, s3_options):
    local, staging = tmp_path / "local", tmp_path / "staging"
    files1 = {"model.bin": small_state(1), "optimizer.bin": {"m": torch.ones(3)}}
    files2 = {"model.bin": big_state(2, mib=6), "optimizer.bin": {"m": torch.full((3,), 2.0)}}
    with stagesave.Checkpointer(store, io_threads=1) as ckpt:
        with _Watcher(local) as watcher:
            ckpt.save_dir(files1, "checkpoint_1", staging_dir=staging).result(timeout=60)
            assert [u.error for u in store.wait_uploads(timeout=60)] == [None]
            # Hold the next save mid-write: its only I/O thread waits behind this gate.
            gate = threading.Event()
            ckpt.pipeline.queue.io_pool.submit(gate.wait)
            handle = ckpt.save_dir(files2, "checkpoint_2", staging_dir=staging)
            _wait_for(lambda: os.listdir(staging) != [], "the staging folder")
            [assembling] = os.listdir(staging)
            assert assembling.startswith(f"checkpoint_2.{os.getpid()}-") and assembling.endswith(
                ".stagesave-tmp"
            )
            assert os.listdir(local) == ["checkpoint_1"]  # the half-written folder is elsewhere
            gate.set()
            tel = handle.result(timeout=60)
            assert sorted(os.listdir(local)) == ["checkpoint_1", "checkpoint_2"]
            assert os.listdir(staging) == []
            uploads = store.wait_uploads(timeout=60)
        # the checkpoint folder never held anything but the two committed folders
        assert watcher.seen == {"checkpoint_1", "checkpoint_2"}
        assert ckpt.verify("checkpoint_2").status == "verified"
        # written as the local tier writes its own files (O_DIRECT where the filesystem allows it)
        plain = ckpt.save(small_state(3), "plain.ckpt").result(timeout=60)
        assert tel.direct_io is not None and tel.direct_io == plain.direct_io
        store.wait_uploads(timeout=60)
    assert [(u.path, u.error) for u in uploads] == [(f"{s3_url}/checkpoint_2", None)]
    _assert_uploaded(s3_server, s3_url, local, "checkpoint_1")
    _assert_uploaded(s3_server, s3_url, local, "checkpoint_2")
    remote = stagesave.load(f"{s3_url}/checkpoint_2/model.bin", storage_options=s3_options)
    assert torch.equal(remote["w"], files2["model.bin"]["w"])


class _FileSizeLimit:
    """A real write failure: files of this process may not grow past ``limit`` bytes (EFBIG).

    ``RLIMIT_FSIZE`` is enforced by the kernel on every write and ``fallocate``; SIGXFSZ is
    ignored meanwhile so that the write fails with ``EFBIG`` instead of killing the process.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __enter__(self) -> Self:
        self._old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        self._old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self._old_limit[1]))
        return self

    def __exit__(self, *exc: object) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, self._old_limit)
        signal.signal(signal.SIGXFSZ, self._old_handler)


def test_a_failure_mid_write_leaves_no_debris_and_the_previous_checkpoint_on_both_tiers(
        store, tmp_path, s3_server, s3_url, s3_options):
    local, staging = tmp_path / "local", tmp_path / "staging"
    old = {"model.bin": small_state(1), "optimizer.bin": {"m": torch.ones(3)}}
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save_dir(old, "checkpoint_1", staging_dir=staging).result(timeout=60)
        assert [u.error for u in store.wait_uploads(timeout=60)] == [None]
        remote_before = {
            n: _remote_bytes(s3_server, s3_url, n) for n in object_names(s3_server, s3_url)
        }
        local_before = {
            n: (local / "checkpoint_1" / n).read_bytes() for n in os.listdir(local / "checkpoint_1")
        }
        # A new save replacing checkpoint_1: its first file is written and published in the
        # staging folder, then the big one fails in the kernel (file size limit: EFBIG).
        new = {"a_small.bin": small_state(7), "model.bin": big_state(7, mib=12)}
        with _FileSizeLimit(4 << 20):
            handle = ckpt.save_dir(new, "checkpoint_1", staging_dir=staging)
            with pytest.raises(stagesave.CheckpointError, match="File too large"):
                handle.result(timeout=60)
        assert os.listdir(staging) == []  # no staging debris
        assert os.listdir(local) == ["checkpoint_1"]
        assert {
            n: (local / "checkpoint_1" / n).read_bytes() for n in os.listdir(local / "checkpoint_1")
        } == local_before
        assert ckpt.verify("checkpoint_1").status == "verified"
        assert torch.equal(ckpt.load("checkpoint_1/model.bin")["w"], old["model.bin"]["w"])
        assert store.wait_uploads(timeout=60) == []  # nothing was committed, nothing uploaded
        assert store.pending_uploads() == []
    assert {
        n: _remote_bytes(s3_server, s3_url, n) for n in object_names(s3_server, s3_url)
    } == remote_before
    assert open_uploads(s3_server, s3_url) == []
    remote = stagesave.verify(f"{s3_url}/checkpoint_1", storage_options=s3_options)
    assert remote.status == "verified"


def test_remote_down_commits_locally_without_debris_and_uploads_after_the_next_save(
        store, proxy, tmp_path, s3_server, s3_url):
    local, staging = tmp_path / "local", tmp_path / "staging"
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save_dir({"model.bin": small_state(1)}, "checkpoint_1", staging_dir=staging).result(
            timeout=60
        )
        store.wait_uploads(timeout=60)
        remote_before = {
            n: _remote_bytes(s3_server, s3_url, n) for n in object_names(s3_server, s3_url)
        }
        proxy.down = True
        ckpt.save_dir({"model.bin": small_state(2)}, "checkpoint_2", staging_dir=staging).result(
            timeout=60
        )
        [failed] = store.wait_uploads(timeout=60)
        assert "local checkpoint is committed" in failed.error
        assert store.pending_uploads() == ["checkpoint_2"]
        assert (
            sorted(os.listdir(local)) == ["checkpoint_1", "checkpoint_2"]
            and os.listdir(staging) == []
        )
        assert {
            n: _remote_bytes(s3_server, s3_url, n) for n in object_names(s3_server, s3_url)
        } == remote_before
        proxy.down = False
        ckpt.save_dir({"model.bin": small_state(3)}, "checkpoint_3", staging_dir=staging).result(
            timeout=60
        )
        uploads = store.wait_uploads(timeout=60)
    assert [(u.path.rpartition("/")[2], u.error) for u in uploads] == [
        ("checkpoint_3", None),
        ("checkpoint_2", None),
    ]
    for folder in ("checkpoint_1", "checkpoint_2", "checkpoint_3"):
        _assert_uploaded(s3_server, s3_url, local, folder)
    assert os.listdir(staging) == []


def test_staging_dir_on_another_filesystem_is_refused_at_save_time(store, tmp_path):
    other = Path("/dev/shm") / f"stagesave-test-{secrets.token_hex(4)}"
    if not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the temporary directory")
    try:
        with stagesave.Checkpointer(store) as ckpt:
            with pytest.raises(
                ValueError,
                match="is on another filesystem than .*local: the finished folder is renamed",
            ):
                ckpt.save_dir({"model.bin": small_state(1)}, "checkpoint_1", staging_dir=other)
            assert ckpt.pending() == 0
        assert os.listdir(tmp_path / "local") == [] and os.listdir(other) == []
    finally:
        shutil.rmtree(other, ignore_errors=True)
