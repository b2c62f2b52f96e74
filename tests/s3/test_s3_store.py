"""The S3 fast path against a real server (SeaweedFS on loopback), watched through a proxy.

The proxy (tests/faultproxy.py) only observes here: which requests reach the server, in which
order, and how many at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from s3help import PART, MiB, big_state, object_names, open_uploads, small_state, split_url

import stagesave
from stagesave.stores.s3 import S3Store
from stagesave.stores.s3_upload import (
    MAX_PART_BYTES,
    MAX_PARTS,
    MIN_PART_BYTES,
    abort_stale_multipart_uploads,
    choose_part_size,
)

pytestmark = pytest.mark.s3


# ---------------------------------------------------------------------- part sizes (no server)
@pytest.mark.parametrize(
    ("size", "part"),
    [(0, 16 * MiB), (1 << 30, 16 * MiB), (200 << 30, 21 * MiB), (5 << 40, 525 * MiB)],
)
def test_part_size_examples(size, part):
    assert choose_part_size(size) == part


@given(st.integers(min_value=0, max_value=5 << 40),
       st.integers(min_value=MIN_PART_BYTES, max_value=MAX_PART_BYTES))
def test_part_size_stays_within_s3_limits(size, preferred):
    part = choose_part_size(size, preferred)
    assert MIN_PART_BYTES <= part <= MAX_PART_BYTES
    assert part % MiB == 0
    assert -(-size // part) <= MAX_PARTS


def test_objects_over_5_tib_are_refused():
    with pytest.raises(ValueError, match="5 TiB"):
        choose_part_size((5 << 40) + 1)


def test_url_with_credentials_is_refused_without_echoing_them():
    with pytest.raises(ValueError, match="storage_options") as err:
        S3Store("s3://AKIDSECRETKEY:hunter2secret@bucket/x")
    assert "hunter2secret" not in str(err.value) and "AKIDSECRETKEY" not in str(err.value)


# ---------------------------------------------------------------------- upload shape and order
def test_large_file_is_a_concurrent_multipart_upload_committed_by_completing_it(
    proxy, make_store, s3_url
):
    store = make_store(s3_url, proxy.endpoint, max_connections=2)
    state = big_state(1)
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save(state, "big.ckpt").result()
        assert torch.equal(ckpt.load("big.ckpt")["w"], state["w"])
        assert ckpt.verify("big.ckpt").status == "verified"
    writes = [op for op, _ in proxy.log if op in
              ("CreateMultipartUpload", "UploadPart", "PutObject", "CompleteMultipartUpload")]
    # data parts up (the last one carries the proof), then the atomic publish: no other object
    assert writes == ["CreateMultipartUpload", "UploadPart", "UploadPart", "UploadPart",
                      "CompleteMultipartUpload"]
    assert proxy.max_in_flight["UploadPart"] == 2  # concurrent, and bounded by max_connections
    assert proxy.requests["GetObject"] >= 3  # the load used concurrent ranged reads


def test_small_file_is_a_single_put(proxy, make_store, s3_url):
    store = make_store(s3_url, proxy.endpoint)
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save(small_state(), "small.ckpt").result()
    assert proxy.requests["CreateMultipartUpload"] == 0
    # the file, proof inside
    assert [op for op, _ in proxy.log if op == "PutObject"] == ["PutObject"]


def test_the_one_object_written_is_a_self_proving_torch_file(s3_server, make_store, s3_url):
    state = big_state(2)
    with stagesave.Checkpointer(make_store(s3_url)) as ckpt:
        tel = ckpt.save(state, "run/last.ckpt").result()
    names = object_names(s3_server, s3_url)
    assert names == ["run/last.ckpt"]
    bucket, prefix = split_url(s3_url)
    raw = s3_server.client().get_object(Bucket=bucket, Key=f"{prefix}/run/last.ckpt")["Body"].read()
    assert len(raw) == tel.bytes
    import io

    plain = torch.load(io.BytesIO(raw), weights_only=True)  # a plain torch file
    assert torch.equal(plain["w"], state["w"])
    import zipfile

    assert zipfile.ZipFile(io.BytesIO(raw)).testzip() is None  # real CRCs
    assert open_uploads(s3_server, s3_url) == []


def test_credentials_never_reach_proofs_errors_or_telemetry(
    s3_server, make_store, s3_url, s3_options
):
    seen = []
    with stagesave.Checkpointer(make_store(s3_url), telemetry_callback=seen.append) as ckpt:
        ckpt.save(small_state(), "a.ckpt", metadata={"note": "x"}).result()
    bucket, prefix = split_url(s3_url)
    # the proof is inside the file
    manifest = s3_server.client().get_object(Bucket=bucket, Key=f"{prefix}/a.ckpt")["Body"].read()
    wrong = dict(s3_options, secret="not-the-secret-" + s3_options["secret"][:6])
    with (
        stagesave.Checkpointer(make_store(s3_url, options=wrong)) as ckpt,
        pytest.raises(stagesave.CheckpointPermissionError) as err,
    ):
        ckpt.save(small_state(), "b.ckpt").result()
    texts = [manifest.decode("latin-1"), str(err.value), repr(err.value),
             json.dumps([t.to_dict() for t in seen])]
    for text in texts:
        assert s3_options["secret"] not in text
        assert wrong["secret"] not in text
        assert s3_options["key"] not in text


# ---------------------------------------------------------------------- clear errors, no retries
def test_missing_bucket_fails_the_save_at_once(proxy, make_store):
    store = make_store("s3://no-such-bucket-stagesave/x", proxy.endpoint)
    with stagesave.Checkpointer(store) as ckpt:
        with pytest.raises(stagesave.CheckpointNotFoundError,
                           match="bucket 'no-such-bucket-stagesave' does not exist"):
            ckpt.save(small_state(), "a.ckpt")
        with pytest.raises(stagesave.CheckpointNotFoundError):
            ckpt.load("a.ckpt")
    assert proxy.requests["HeadBucket"] == 1
    assert sum(proxy.requests.values()) <= 3  # nothing retried


def test_access_denied_is_not_retried(proxy, make_store, s3_server, s3_url):
    store = make_store(s3_url, proxy.endpoint, options=s3_server.options(read_only=True))
    with (
        stagesave.Checkpointer(store) as ckpt,
        pytest.raises(stagesave.CheckpointPermissionError, match="AccessDenied.*not retried"),
    ):
        ckpt.save(big_state(), "a.ckpt").result()
    assert proxy.requests["CreateMultipartUpload"] == 1
    assert proxy.requests["UploadPart"] == 0 and proxy.requests["PutObject"] == 0
    assert object_names(s3_server, s3_url) == []


# ---------------------------------------------------------------------- readers never see a mix
def test_reads_pin_one_version_of_an_object(make_store, s3_url):
    reader, writer = make_store(s3_url), make_store(s3_url)
    writer.put_atomic("obj.bin", b"A" * 1000)
    assert reader.info("obj.bin").size == 1000
    assert reader.read_range("obj.bin", 0, 10) == b"A" * 10
    writer.put_atomic("obj.bin", b"B" * 1000)  # replaced between two reads of one load
    with pytest.raises(stagesave.StorageError, match="replaced by another writer"):
        reader.read_range("obj.bin", 10, 10)
    assert reader.info("obj.bin").size == 1000  # a fresh look sees the new version
    assert reader.read_range("obj.bin", 10, 10) == b"B" * 10


def test_overwrite_keeps_readers_on_the_old_version_until_publish(make_store, s3_url):
    store = make_store(s3_url)
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save(big_state(1), "last.ckpt").result()
        import mmap

        mem = mmap.mmap(-1, 13 * MiB)
        image = memoryview(mem)
        image[:] = b"\x07" * len(image)
        pending = store.begin_write("last.ckpt", image, len(image))
        pending.write_range(0, len(image))
        pending.finish()
        # parts up, not published: readers still see the old version
        assert torch.equal(ckpt.load("last.ckpt")["w"], big_state(1)["w"])
        pending.abort()
        assert torch.equal(ckpt.load("last.ckpt")["w"], big_state(1)["w"])


# ---------------------------------------------------------------------- stale uploads
_KILLED_CHILD = textwrap.dedent(
    """
    import sys, torch, stagesave
    from stagesave.stores.s3 import S3Store
    url, endpoint, key, secret = sys.argv[1:5]
    store = S3Store(url, {"key": key, "secret": secret, "endpoint_url": endpoint},
                    part_size=5 << 20, multipart_threshold=5 << 20)
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save({"w": torch.randn(3 << 20)}, "killed.ckpt").result()
    """
)


@pytest.mark.usefixtures("thread_writer")  # the crash point is in the trainer's own writer
def test_upload_of_a_killed_process_is_found_and_aborted(s3_server, s3_url, make_store):
    env = dict(os.environ, STAGESAVE_CRASH_AT="mid_data")
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_CHILD, s3_url, s3_server.endpoint, s3_server.key,
         s3_server.secret],
        env=env, capture_output=True, timeout=120, check=False,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]  # SIGKILL after its first part
    assert [u["Key"].rpartition("/")[2] for u in open_uploads(s3_server, s3_url)] == ["killed.ckpt"]
    assert object_names(s3_server, s3_url) == []  # nothing published, no manifest
    store = make_store(s3_url)
    assert abort_stale_multipart_uploads(store) == []  # younger than an hour: may be a live save
    aborted = abort_stale_multipart_uploads(s3_url, older_than_s=0,
                                            storage_options=s3_server.options())
    assert aborted == [f"{s3_url}/killed.ckpt"]
    assert open_uploads(s3_server, s3_url) == []
    assert stagesave.latest(store) is None


def test_abort_stale_only_touches_its_own_prefix(s3_server, s3_url):
    bucket, prefix = split_url(s3_url)
    client = s3_server.client()
    client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/a/x.ckpt")
    other = client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}-other/x.ckpt")
    try:
        aborted = abort_stale_multipart_uploads(f"{s3_url}/a", older_than_s=0,
                                                storage_options=s3_server.options())
        assert aborted == [f"{s3_url}/a/x.ckpt"]
        listed = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
        keys = [u["Key"] for u in listed.get("Uploads", [])]
        assert keys == [f"{prefix}-other/x.ckpt"]
    finally:
        client.abort_multipart_upload(Bucket=bucket, Key=f"{prefix}-other/x.ckpt",
                                      UploadId=other["UploadId"])


def test_checkpointer_dispatches_s3_urls_to_the_fast_path(s3_url, s3_options):
    with stagesave.Checkpointer(storage_options=s3_options) as ckpt:
        ckpt.save(small_state(3), f"{s3_url}/a.ckpt").result()
        store, name = ckpt.targets.split(f"{s3_url}/a.ckpt")
        assert isinstance(store, S3Store) and name == "a.ckpt"
        assert ckpt.load(f"{s3_url}/a.ckpt")["step"] == 3
        assert stagesave.latest(s3_url, storage_options=s3_options).path == f"{s3_url}/a.ckpt"


def test_part_size_is_respected_by_a_server_that_enforces_the_minimum(
    s3_server, make_store, s3_url
):
    # SeaweedFS refuses parts under 5 MiB (EntityTooSmall), like S3: the chosen sizes pass it.
    state = big_state(4, mib=11)
    store = make_store(s3_url, part_size=PART)
    with stagesave.Checkpointer(store) as ckpt:
        ckpt.save(state, "p.ckpt").result()
        assert ckpt.verify("p.ckpt").status == "verified"
