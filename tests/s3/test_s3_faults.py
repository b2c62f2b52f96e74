"""Faults object stores are known for, injected by a proxy between s3fs and a real server.

Retried faults must end in a checkpoint whose every byte matches its manifest; faults beyond the
retry budget must leave no manifest, no open multipart upload, and the previous checkpoint
intact; access errors are never retried; a byte flipped in transit is caught on load.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from faultproxy import Fault
from s3help import big_state, object_names, open_uploads, small_state

import stagesave
import stagesave.restore.verify as verify_mod
from stagesave.stores.s3 import RetryPolicy

pytestmark = pytest.mark.s3


def _roundtrip_ok(ckpt: stagesave.Checkpointer, name: str, state: dict) -> None:
    assert ckpt.verify(name).status == "verified"  # every chunk digest matches the staged bytes
    loaded = ckpt.load(name)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == state["step"]


@pytest.mark.parametrize(
    "faults",
    [
        pytest.param([Fault("UploadPart", "drop_request", times=2, drop_after=256 * 1024)],
                     id="dropped-mid-part"),
        pytest.param([Fault("UploadPart", "status", times=3, status=503, code="SlowDown")],
                     id="slowdown-burst"),
        pytest.param(
            [Fault("UploadPart", "status", times=2, status=503, code="ServiceUnavailable"),
             Fault("CreateMultipartUpload", "status", times=2, status=500, code="InternalError"),
             Fault("CompleteMultipartUpload", "status", times=2, status=503, code="SlowDown")],
            id="5xx-everywhere",
        ),
        pytest.param([Fault("CompleteMultipartUpload", "drop_response", times=1)],
                     id="complete-reply-lost"),
        pytest.param([Fault("PutObject", "status", times=2, status=500, code="InternalError")],
                     id="5xx-small-put"),
    ],
)
def test_transient_faults_are_retried_to_identical_bytes(proxy, make_store, s3_url, faults):
    proxy.add(*faults)
    state = small_state() if faults[0].op == "PutObject" else big_state(7)
    with stagesave.Checkpointer(make_store(s3_url, proxy.endpoint)) as ckpt:
        ckpt.save(state, "a.ckpt").result()
        assert sum(proxy.injected.values()) == sum(f.hits for f in faults) > 0
        assert all(f.times == 0 for f in faults)  # every injected fault was hit
        _roundtrip_ok(ckpt, "a.ckpt", state)


def test_a_timed_out_part_is_retried(proxy, make_store, s3_url):
    slow = Fault("UploadPart", "delay", times=1, delay_s=8.0)
    proxy.add(slow)
    state = big_state(8)
    # the timeout well above a loaded machine's part upload, well below the injected stall
    with stagesave.Checkpointer(make_store(s3_url, proxy.endpoint, read_timeout=3.0)) as ckpt:
        ckpt.save(state, "slow.ckpt").result()
        assert slow.times == 0  # the stall was hit, and the save went on past it
        assert proxy.requests["UploadPart"] >= 4  # three parts, one of them twice (at least)
        _roundtrip_ok(ckpt, "slow.ckpt", state)


def test_beyond_the_retry_budget_nothing_is_published(proxy, make_store, s3_url, s3_server):
    store = make_store(s3_url, proxy.endpoint, retry=RetryPolicy(max_attempts=3, base_delay_s=0.01))
    with stagesave.Checkpointer(store) as ckpt:
        proxy.add(Fault("UploadPart", "status", times=-1, status=503, code="SlowDown"))
        with pytest.raises(stagesave.StorageError,
                           match=r"UploadPart .* failed after 3 attempts \(SlowDown"):
            ckpt.save(big_state(), "a.ckpt").result()
    assert proxy.requests["AbortMultipartUpload"] == 1
    assert proxy.requests["PutObject"] == 0  # nothing else was ever written
    assert object_names(s3_server, s3_url) == []
    assert open_uploads(s3_server, s3_url) == []


def test_failed_publish_keeps_the_previous_checkpoint(proxy, make_store, s3_url, s3_server):
    store = make_store(s3_url, proxy.endpoint, retry=RetryPolicy(max_attempts=2, base_delay_s=0.01))
    old = big_state(1)
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save(old, "last.ckpt").result()
        proxy.add(Fault("CompleteMultipartUpload", "status", times=-1, status=500,
                        code="InternalError"))
        with pytest.raises(stagesave.StorageError,
                           match="CompleteMultipartUpload .* after 2 attempts"):
            ckpt.save(big_state(2), "last.ckpt").result()
        proxy.clear()
        info = ckpt.latest()
        # every byte of the old one
        assert info is not None and info.name == "last.ckpt" and info.status == "verified"
        _roundtrip_ok(ckpt, "last.ckpt", old)
    assert object_names(s3_server, s3_url) == ["last.ckpt"]  # the old file, whole
    assert open_uploads(s3_server, s3_url) == []


@pytest.mark.parametrize("op", ["UploadPart", "CreateMultipartUpload", "PutObject"])
def test_access_denied_surfaces_at_once(proxy, make_store, s3_url, s3_server, op):
    proxy.add(Fault(op, "status", times=-1, status=403, code="AccessDenied"))
    state = small_state() if op == "PutObject" else big_state()
    with (
        stagesave.Checkpointer(make_store(s3_url, proxy.endpoint)) as ckpt,
        pytest.raises(stagesave.CheckpointPermissionError,
                      match=f"S3 {op} .* refused \\(AccessDenied"),
    ):
        ckpt.save(state, "a.ckpt").result()
    # each part tried once, never again
    assert proxy.requests[op] <= (3 if op == "UploadPart" else 1)
    assert object_names(s3_server, s3_url) == []
    assert open_uploads(s3_server, s3_url) == []


def test_a_byte_flipped_on_the_way_up_is_caught_on_load(proxy, make_store, s3_url):
    # SeaweedFS does not check the signed payload hash, so the flipped part is stored as sent.
    proxy.add(Fault("UploadPart", "flip_request", times=1, flip_offset=4096))
    with stagesave.Checkpointer(make_store(s3_url, proxy.endpoint)) as ckpt:
        ckpt.save(big_state(3), "f.ckpt").result()
        with pytest.raises(stagesave.IntegrityError, match="checksum mismatch"):
            ckpt.load("f.ckpt")
        info = ckpt.verify("f.ckpt")
        assert info.status == "corrupt" and "checksum mismatch" in info.problems[0]


def test_latest_verify_skips_a_corrupt_checkpoint_of_a_store_root(proxy, make_store, s3_url):
    proxy.add(Fault("UploadPart", "flip_request", times=1, flip_offset=4096))
    with stagesave.Checkpointer(make_store(s3_url, proxy.endpoint)) as ckpt:
        ckpt.save(big_state(3), "f.ckpt").result()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ckpt.latest(verify=True) is None
        assert any("checksum mismatch" in str(w.message) for w in caught)


def test_a_byte_flipped_on_the_way_down_is_caught_on_load(proxy, make_store, s3_url):
    state = big_state(4)
    with stagesave.Checkpointer(make_store(s3_url, proxy.endpoint)) as ckpt:
        ckpt.save(state, "f.ckpt").result()
        proxy.add(Fault("GetObject", "flip_response", times=-1, flip_offset=100_000,
                        path_suffix="/f.ckpt"))
        with pytest.raises(stagesave.IntegrityError, match="checksum mismatch"):
            ckpt.load("f.ckpt")
        proxy.clear()
        _roundtrip_ok(ckpt, "f.ckpt", state)  # the stored object was never damaged


def test_reads_dropped_mid_body_are_retried(proxy, make_store, s3_url):
    state = big_state(5)
    with stagesave.Checkpointer(make_store(s3_url, proxy.endpoint)) as ckpt:
        ckpt.save(state, "r.ckpt").result()
        proxy.add(Fault("GetObject", "drop_response", times=3),
                  Fault("HeadObject", "status", times=1, status=503))
        loaded = ckpt.load("r.ckpt")
        assert proxy.injected["GetObject"] == 3
        assert torch.equal(loaded["w"], state["w"])


def test_an_unreachable_server_fails_clearly_after_the_budget(proxy, make_store, s3_url):
    store = make_store(s3_url, proxy.endpoint, retry=RetryPolicy(max_attempts=3, base_delay_s=0.01))
    proxy.down = True
    with (
        stagesave.Checkpointer(store) as ckpt,
        pytest.raises(stagesave.StorageError, match="after 3 attempts"),
    ):
        ckpt.save(small_state(), "a.ckpt").result()


@pytest.mark.parametrize("times", [1, 3], ids=["once", "on-every-read-of-one-listing"])
def test_latest_verifies_again_a_file_replaced_while_it_reads_it(
    make_store, s3_url, monkeypatch, times
):
    """latest() verifies every byte: another writer replacing the object under that read makes
    the pinned read fail (PreconditionFailed). latest() reads the new version (and lists
    again), as a load does: never an error, never a skipped checkpoint."""
    store = make_store(s3_url)
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save(small_state(1), "last.ckpt").result()
        # fault injection: a replacement between a file's proof and its bytes
        real = verify_mod.check_file
        replaced: list[int] = []

        def replace_first(reader, manifest, io, reuse):
            # another writer replaces last.ckpt between its proof and its bytes
            if len(replaced) < times:
                with stagesave.Checkpointer(make_store(s3_url)) as other:
                    other.save(small_state(len(replaced) + 2), "last.ckpt").result()
                replaced.append(1)
            return real(reader, manifest, io, reuse)

        monkeypatch.setattr(verify_mod, "check_file", replace_first)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a replacement is neither damage nor a reason to skip
            info = ckpt.latest()
        assert len(replaced) == times
        assert info is not None and info.name == "last.ckpt" and info.status == "verified"
        _roundtrip_ok(ckpt, "last.ckpt", small_state(times + 1))


@pytest.mark.parametrize("verify", [True, False])
def test_a_load_from_s3_keeps_the_memory_it_read_each_chunk_into(proxy, make_store, s3_url,
                                                                   verify):
    """One pass: the object's chunks are fetched into one buffer and the tensors are views of
    it (the distances between their storages are those between their records in the file: no
    second copy into separate storages), equal to what was saved; a flipped byte on the way
    down is caught in the same pass when verifying."""
    state = {"a": torch.randn(300_000), "b": torch.arange(200_000, dtype=torch.int64),
             "c": torch.randn(50, 70).t(), "step": 7}
    with stagesave.Checkpointer(make_store(s3_url, proxy.endpoint), chunk_bytes=1 << 20) as ck:
        ck.save(state, "v.ckpt").result()
        manifest = ck.verify("v.ckpt").manifest
        assert manifest is not None
        offsets = sorted(r.offset for r in manifest.files[0].storages)
        got = ck.load("v.ckpt", verify=verify)
        for k in ("a", "b", "c"):
            assert torch.equal(got[k], state[k]) and got[k].stride() == state[k].stride()
        assert got["step"] == 7
        ptrs = sorted(got[k].untyped_storage().data_ptr() for k in ("a", "b", "c"))
        assert [p - ptrs[0] for p in ptrs] == [o - offsets[0] for o in offsets]
        if verify:
            proxy.add(Fault("GetObject", "flip_response", times=-1, flip_offset=100_000,
                            path_suffix="/v.ckpt"))
            with pytest.raises(stagesave.IntegrityError, match="checksum mismatch"):
                ck.load("v.ckpt")
