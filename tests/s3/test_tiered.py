"""The tiered store: local commit first, background upload to S3, per-tier retention, restore
from the best tier. The remote tier is the loopback SeaweedFS behind the fault proxy, so "the
remote is down" is a real refused connection."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from faultproxy import Fault
from s3help import FAST_RETRY, object_names, open_uploads, small_state

import stagesave
from stagesave.stores.local import LocalStore
from stagesave.stores.s3 import RetryPolicy, abort_stale_multipart_uploads
from stagesave.stores.tiered import TieredStore

pytestmark = pytest.mark.s3


@pytest.fixture
def tiered(tmp_path, proxy, make_store, s3_url):
    """``tiered(**kw)``: a TieredStore over ``tmp_path/local`` and ``s3_url`` through the proxy."""
    made = []

    def make(remote_kw: dict | None = None, **kw) -> TieredStore:
        remote_kw = {"retry": RetryPolicy(max_attempts=2, base_delay_s=0.01), **(remote_kw or {})}
        remote = make_store(s3_url, proxy.endpoint, **remote_kw)
        store = TieredStore(LocalStore(str(tmp_path / "local")), remote,
                            remote_retry_after_s=0.0, **kw)
        made.append(store)
        return store

    yield make
    for s in made:
        s.close()


def _local_names(store: TieredStore) -> list[str]:
    return sorted(i.name for i in store.local.list() if not i.name.endswith(".stagesave.json"))


def _remote_names(s3_server, url: str) -> list[str]:
    return [n for n in object_names(s3_server, url) if not n.endswith(".stagesave.json")]


def test_commits_locally_then_uploads_the_same_checkpoint(tiered, s3_server, s3_url, s3_options):
    telemetry = []
    store = tiered()  # the Checkpointer's callback receives the tier's upload records too
    state = small_state(1)
    with stagesave.Checkpointer(store, telemetry_callback=telemetry.append) as ckpt:
        local = ckpt.save(state, "a.ckpt").result()
        assert local.path == os.path.join(store.local.url, "a.ckpt")  # committed on local disk
        assert ckpt.verify(local.path).status == "verified"
        uploads = store.wait_uploads()
    assert [(u.tier, u.path, u.error, u.bytes) for u in uploads] == [
        ("remote", f"{s3_url}/a.ckpt", None, local.bytes)
    ]
    # both commits are in the telemetry: the local one first, then the upload
    assert [(t.path, t.tier) for t in telemetry] == [
        (local.path, "local"), (f"{s3_url}/a.ckpt", "remote")
    ]
    assert telemetry[1].committed_at >= telemetry[0].committed_at
    remote_manifests = [n for n in object_names(s3_server, s3_url) if n.endswith(".stagesave.json")]
    local_manifests = [n for n in os.listdir(store.local.url) if n.endswith(".stagesave.json")]
    assert remote_manifests == local_manifests
    remote = stagesave.verify(f"{s3_url}/a.ckpt", storage_options=s3_options)
    assert remote.status == "verified"
    loaded = stagesave.load(f"{s3_url}/a.ckpt", storage_options=s3_options)
    assert torch.equal(loaded["w"], state["w"])


def test_remote_down_keeps_local_commits_and_the_next_save_uploads(
    tiered, proxy, s3_server, s3_url, capfd
):
    store = tiered()
    with stagesave.Checkpointer(store) as ckpt:
        proxy.down = True
        ckpt.save(small_state(1), "a.ckpt").result()  # the save itself succeeds
        failed = store.wait_uploads()
        assert len(failed) == 1 and failed[0].tier == "remote"
        assert "uploading" in failed[0].error and "local checkpoint is committed" in failed[0].error
        assert "stagesave: uploading" in capfd.readouterr().err
        assert store.pending_uploads() == ["a.ckpt"]
        assert ckpt.load("a.ckpt")["step"] == 1
        proxy.down = False
        ckpt.save(small_state(2), "b.ckpt").result()
        uploads = store.wait_uploads()
    assert [(u.path.rpartition("/")[2], u.error) for u in uploads] == [
        ("b.ckpt", None), ("a.ckpt", None)
    ]
    assert store.pending_uploads() == []
    assert _remote_names(s3_server, s3_url) == ["a.ckpt", "b.ckpt"]


def test_a_hanging_remote_does_not_hold_up_local_commits(tiered, proxy):
    store = tiered(remote_kw={"read_timeout": 1.0, "connect_timeout": 1.0}, remote_timeout_s=1.0)
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save(small_state(1), "a.ckpt").result()
        store.wait_uploads()
        proxy.add(Fault(None, "delay", times=-1, delay_s=30.0))  # every remote request hangs
        # the commit lists its directory (a remote read): it gives up on the remote after 1 s
        ckpt.save(small_state(2), "b.ckpt").result(timeout=20)
        assert ckpt.load("b.ckpt")["step"] == 2
        info = ckpt.latest()
        assert info is not None and info.name == "b.ckpt" and store.tier_of("b.ckpt") == "local"
        records = store.wait_uploads(timeout=60)
    assert [r.path.rpartition("/")[2] for r in records] == ["b.ckpt"]
    assert "failed" in records[0].error


def test_latest_prefers_the_valid_local_copy_and_falls_back_to_remote(tiered, s3_url, s3_options):
    store = tiered()
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save(small_state(1), "a.ckpt").result()
        ckpt.save(small_state(2), "b.ckpt").result()
        store.wait_uploads()
        # a plain torch file (no manifest) beside them: discovery checks whether the root is a
        # folder checkpoint, which must not tie the other files' routes to the root's
        plain = os.path.join(store.local.url, "plain.pt")
        torch.save({"x": 1}, plain)
        os.utime(plain, (1e9, 1e9))  # older than the others
        info = ckpt.latest()
        assert (info.name, info.path, store.tier_of("b.ckpt")) == (
            "b.ckpt", os.path.join(store.local.url, "b.ckpt"), "local"
        )
        with open(info.path, "r+b") as f:  # the local copy is torn (node crash, bad disk)
            f.truncate(100)
        info = ckpt.latest()  # the committed remote copy wins over the torn local one
        assert info.name == "b.ckpt" and info.path == f"{s3_url}/b.ckpt"
        assert store.tier_of("b.ckpt") == "remote"
        assert ckpt.load("b.ckpt")["step"] == 2  # read from the remote tier
        os.remove(os.path.join(store.local.url, "a.ckpt"))
        assert ckpt.load("a.ckpt")["step"] == 1


def test_latest_picks_a_newer_checkpoint_written_to_the_remote_elsewhere(
    tiered, s3_url, s3_options
):
    store = tiered()
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save(small_state(1), "last.ckpt").result()
        store.wait_uploads()
        # another node (or a restart elsewhere) commits a newer last.ckpt straight to S3
        stagesave.save(small_state(9), f"{s3_url}/last.ckpt", storage_options=s3_options)
        info = ckpt.latest()
        assert info.path == f"{s3_url}/last.ckpt" and store.tier_of("last.ckpt") == "remote"
        assert ckpt.load("last.ckpt")["step"] == 9


def test_each_tier_has_its_own_retention(tiered, s3_server, s3_url):
    store = tiered(keep_local=1, keep_remote=2)
    with stagesave.Checkpointer(store) as ckpt:
        for i in range(4):
            ckpt.save(small_state(i), f"s{i}.ckpt").result()
            store.wait_uploads()
        assert _local_names(store) == ["s3.ckpt"]
        assert _remote_names(s3_server, s3_url) == ["s2.ckpt", "s3.ckpt"]
        assert [c.name for c in ckpt.list()] == ["s3.ckpt", "s2.ckpt"]
        assert ckpt.load("s2.ckpt")["step"] == 2  # only on the remote tier now


def test_local_retention_never_drops_the_only_copy(tiered, proxy, s3_server, s3_url):
    store = tiered(keep_local=1)
    with stagesave.Checkpointer(store) as ckpt:
        proxy.down = True
        for i in range(3):
            ckpt.save(small_state(i), f"s{i}.ckpt").result()
        store.wait_uploads()
        assert _local_names(store) == ["s0.ckpt", "s1.ckpt", "s2.ckpt"]  # none uploaded yet
        proxy.down = False
        ckpt.save(small_state(3), "s3.ckpt").result()
        assert [u.error for u in store.wait_uploads()] == [None] * 4
    assert _local_names(store) == ["s3.ckpt"]
    assert _remote_names(s3_server, s3_url) == ["s0.ckpt", "s1.ckpt", "s2.ckpt", "s3.ckpt"]


def test_folder_checkpoints_are_uploaded_whole(tiered, s3_url, s3_options):
    store = tiered()
    files = {"model.bin": {"w": torch.arange(50.0)}, "optimizer.bin": {"m": torch.ones(3)}}
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save_dir(files, "checkpoint_1").result()
        assert [u.error for u in store.wait_uploads()] == [None]
    with stagesave.Checkpointer(storage_options=s3_options) as remote:
        info = remote.verify(f"{s3_url}/checkpoint_1")
        assert info.status == "verified" and info.is_dir
        assert torch.equal(remote.load(f"{s3_url}/checkpoint_1/model.bin")["w"], torch.arange(50.0))


@pytest.mark.parametrize("where", ["data", "proof"])
def test_a_locally_rotted_copy_is_not_uploaded(tiered, proxy, s3_server, s3_url, where):
    store = tiered()
    with stagesave.Checkpointer(store) as ckpt:
        proxy.down = True
        ckpt.save(small_state(1), "a.ckpt").result()
        store.wait_uploads()  # failed: a.ckpt waits for the remote tier
        path = os.path.join(store.local.url, "a.ckpt")
        # one byte of the local copy rots meanwhile (a tensor's, or its proof's)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 30 if where == "proof" else 4096 * 5 + 10)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        proxy.down = False
        ckpt.save(small_state(2), "b.ckpt").result()
        records = store.wait_uploads()
    errors = {u.path.rpartition("/")[2]: u.error for u in records}
    assert errors["b.ckpt"] is None
    assert "local copy" in errors["a.ckpt"] and "no longer matches its proof" in errors["a.ckpt"]
    assert _remote_names(s3_server, s3_url) == ["b.ckpt"]
    assert open_uploads(s3_server, s3_url) == []


def test_cleanup_call_accepts_the_tiered_store(tiered, s3_server, s3_url):
    store = tiered()
    bucket, _, prefix = s3_url.split("://", 1)[1].partition("/")
    s3_server.client().create_multipart_upload(Bucket=bucket, Key=f"{prefix}/x.ckpt")
    assert abort_stale_multipart_uploads(store, older_than_s=0) == [f"{s3_url}/x.ckpt"]


def test_uploads_finish_before_close_returns(tmp_path, s3_url, s3_options, s3_server):
    from stagesave.stores.s3 import S3Store

    store = TieredStore(str(tmp_path / "l"), S3Store(s3_url, s3_options, retry=FAST_RETRY))
    with stagesave.Checkpointer(store) as ckpt:
        for i in range(3):
            ckpt.save(small_state(i), f"s{i}.ckpt")
    store.close()
    assert _remote_names(s3_server, s3_url) == ["s0.ckpt", "s1.ckpt", "s2.ckpt"]


_EXITING_CHILD = """
import sys, torch, stagesave
from stagesave.stores.tiered import TieredStore
local, url, endpoint, key, secret = sys.argv[1:6]
store = TieredStore(local, url,
                    storage_options={"key": key, "secret": secret, "endpoint_url": endpoint})
ckpt = stagesave.Checkpointer(store)
ckpt.save({"w": torch.arange(10.0)}, "exit.ckpt")
# no wait, no close: the interpreter exits with the save and its upload still queued
"""


def test_interpreter_exit_flushes_saves_then_uploads(tmp_path, s3_server, s3_url, s3_options):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _EXITING_CHILD, str(tmp_path / "l"), s3_url, s3_server.endpoint,
         s3_server.key, s3_server.secret],
        capture_output=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert _remote_names(s3_server, s3_url) == ["exit.ckpt"]
    assert stagesave.verify(f"{s3_url}/exit.ckpt", storage_options=s3_options).status == "verified"


def test_a_removed_checkpoint_is_not_listed_while_its_remote_removal_is_slow(
    tiered, proxy, s3_server, s3_url
):
    """Retention removes a checkpoint from both tiers; the remote removal waits behind the uploads
    queued before it. Until it has run, the remote copy must not reappear in listings (CI once saw
    `list()` return a checkpoint that `keep_last` had just removed)."""
    store = tiered()
    with stagesave.Checkpointer(store, keep_last=2) as ckpt:
        for i in (0, 1):
            ckpt.save(small_state(i), f"s{i}.ckpt").result()
        store.wait_uploads()
        # every remote removal now takes 4 s: a slow object store (s1's, queued behind s0's,
        # cannot have run before the check below unless this machine stalls for seconds)
        proxy.add(Fault("DeleteObject", "delay", times=-1, delay_s=4.0),
                  Fault("DeleteObjects", "delay", times=-1, delay_s=4.0))
        for i in (2, 3):
            ckpt.save(small_state(i), f"s{i}.ckpt").result()
        ckpt.wait()
        assert "s1.ckpt" in _remote_names(s3_server, s3_url)  # its removal has not run yet
        assert [c.name for c in ckpt.list()] == ["s3.ckpt", "s2.ckpt"]
        info = ckpt.latest()
        assert info is not None and info.name == "s3.ckpt"
        with pytest.raises(FileNotFoundError):
            store.info("s1.ckpt")
        store.wait_uploads(timeout=120)
        proxy.clear()
        assert [c.name for c in ckpt.list()] == ["s3.ckpt", "s2.ckpt"]
    assert _remote_names(s3_server, s3_url) == ["s2.ckpt", "s3.ckpt"]


class _SlowRetentionLocal(LocalStore):
    """A local tier whose listings on the save's writer thread take 0.5 s: retention after a
    commit (``keep_last``) is slow, as on a busy parallel filesystem. The upload thread lists at
    full speed."""

    def list(self, prefix: str = "") -> list:  # type: ignore[override]
        if threading.current_thread().name == "stagesave-writer":
            time.sleep(0.5)
        return super().list(prefix)


def test_the_local_commit_reports_before_its_upload_even_when_retention_is_slow(
    tmp_path, proxy, make_store, s3_url
):
    """CI once saw the upload's telemetry arrive before the local commit's: the upload was queued
    at the local publish and finished while the writer thread was still applying retention. The
    upload is queued once the local commit has reported, before ``result()`` returns."""
    remote = make_store(s3_url, proxy.endpoint)
    order: list[tuple[str, str]] = []

    def note(t) -> None:
        order.append((t.path.rpartition("/")[2], t.tier))

    with (TieredStore(_SlowRetentionLocal(str(tmp_path / "local")), remote) as store,
          stagesave.Checkpointer(store, keep_last=5, telemetry_callback=note) as ckpt):
        for i in range(3):
            ckpt.save(small_state(i), f"s{i}.ckpt").result()
            uploads = store.wait_uploads(timeout=60)
            assert [(u.path.rpartition("/")[2], u.error) for u in uploads] == [
                (f"s{i}.ckpt", None)]
    assert order == [(f"s{i}.ckpt", tier) for i in range(3) for tier in ("local", "remote")]


class _SlowRetentionAfter(LocalStore):
    """A local tier whose retention (a listing on the save's writer thread) stalls 5 s once,
    after ``s2.ckpt`` was committed."""

    stalled = False

    def list(self, prefix: str = "") -> list:  # type: ignore[override]
        if (threading.current_thread().name == "stagesave-writer" and not self.stalled
                and os.path.exists(os.path.join(self.url, "s2.ckpt"))):
            self.stalled = True
            time.sleep(5.0)
        return super().list(prefix)


def test_an_upload_queued_earlier_does_not_take_a_commit_that_has_not_reported(
    tmp_path, proxy, make_store, s3_url
):
    """Review finding: a queued upload of the same directory picked up every name committed
    locally, also one whose commit had not reported yet (its telemetry came after the upload's).
    s0's upload stalls 3 s, so s1's starts while s2's commit is still in its retention (5 s)."""
    remote = make_store(s3_url, proxy.endpoint)
    order: list[tuple[str, str]] = []

    def note(t) -> None:
        order.append((t.path.rpartition("/")[2], t.tier))

    proxy.add(Fault("PutObject", "delay", times=1, delay_s=3.0))
    with (TieredStore(_SlowRetentionAfter(str(tmp_path / "local")), remote) as store,
          stagesave.Checkpointer(store, keep_last=5, telemetry_callback=note) as ckpt):
        handles = [ckpt.save(small_state(i), f"s{i}.ckpt") for i in range(3)]
        for h in handles:
            h.result()
        uploads = store.wait_uploads(timeout=60)
        assert sorted((u.path.rpartition("/")[2], u.error) for u in uploads) == [
            (f"s{i}.ckpt", None) for i in range(3)]
    for i in range(3):
        name = f"s{i}.ckpt"
        assert order.index((name, "local")) < order.index((name, "remote")), order
