"""Every command on checkpoints in a real S3 server on loopback (SeaweedFS, tests/s3server.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from clitools import crash_saves, small_state

import stagesave

pytestmark = pytest.mark.s3


def _bucket_key(url):
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


@pytest.fixture
def s3_ckpts(cli_s3):
    """Two committed files and one committed folder under a fresh prefix."""
    from stagesave.formats import Safetensors

    url, opts, storage = cli_s3
    with stagesave.Checkpointer(url, storage_options=storage) as ck:
        for step in (1, 2):
            ck.save(small_state(step), f"step={step}.ckpt", metadata={"step": step}).result()
        ck.save_dir(
            {
                "model.safetensors": Safetensors({"w": torch.ones(64, 64)}),
                "optimizer.bin": {"step": 3},
            },
            "checkpoint_3",
            metadata={"step": 3},
        ).result()
    return url, opts, storage


def test_ls_inspect_verify_on_s3(cli, s3_ckpts):
    url, opts, _ = s3_ckpts
    rows = cli(*opts, "ls", url, "--json").json()
    assert [(r["name"], r["status"], r["tier"], r["step"]) for r in rows] == [
        ("checkpoint_3", "committed", "s3", 3),
        ("step=2.ckpt", "committed", "s3", 2),
        ("step=1.ckpt", "committed", "s3", 1),
    ]
    doc = cli(*opts, "inspect", f"{url}/step=2.ckpt", "--json").json()
    assert doc["status"] == "committed" and doc["metadata"] == {"step": 2}
    assert {"model.0.weight", "optimizer.state.0.exp_avg"} <= {t["name"] for t in doc["tensors"]}
    doc = cli(*opts, "inspect", f"{url}/checkpoint_3", "--json").json()
    assert doc["folder"] and {f["name"] for f in doc["files"]} == {
        "model.safetensors",
        "optimizer.bin",
    }
    r = cli(*opts, "verify", url)
    assert r.code == 0, r.err
    assert r.out.count("OK ") == 3
    assert [(r["name"], r["seq"], r["format"]) for r in rows] == [
        ("checkpoint_3", 3, 2), ("step=2.ckpt", 2, 2), ("step=1.ckpt", 1, 2)]


def test_verify_finds_corruption_on_s3(cli, s3_ckpts, s3_server):
    url, opts, _ = s3_ckpts
    bucket, prefix = _bucket_key(url)
    client = s3_server.client()
    key = f"{prefix}/step=1.ckpt"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    r = cli(*opts, "verify", url)
    assert r.code == 1
    assert f"{url}/step=1.ckpt: checksum mismatch" in r.err


def test_export_and_adopt_on_s3(cli, s3_ckpts, s3_server, tmp_path):
    url, opts, storage = s3_ckpts
    out = tmp_path / "out.ckpt"
    assert cli(*opts, "export", f"{url}/step=2.ckpt", out).code == 0
    bucket, prefix = _bucket_key(url)
    client = s3_server.client()
    remote = client.get_object(Bucket=bucket, Key=f"{prefix}/step=2.ckpt")["Body"].read()
    assert out.read_bytes() == remote
    # a folder on S3 into a file on S3
    r = cli(*opts, "export", f"{url}/checkpoint_3", f"{url}/exported/merged.ckpt")
    assert r.code == 0, r.err
    merged = stagesave.load(f"{url}/exported/merged.ckpt", storage_options=storage, trusted=True)
    assert torch.equal(merged["model"]["w"], torch.ones(64, 64)) and merged["optimizer"] == {
        "step": 3
    }
    assert stagesave.verify(f"{url}/exported/merged.ckpt", storage_options=storage).format == 2
    # a file on S3 into a file on S3: byte for byte, and it proves itself
    assert cli(*opts, "export", f"{url}/step=1.ckpt", f"{url}/exported/one.ckpt").code == 0
    copied = client.get_object(Bucket=bucket, Key=f"{prefix}/exported/one.ckpt")["Body"].read()
    assert copied == client.get_object(Bucket=bucket, Key=f"{prefix}/step=1.ckpt")["Body"].read()
    # adopt a plain torch file uploaded by someone else
    plain = tmp_path / "plain.ckpt"
    torch.save(small_state(5), plain)
    client.put_object(Bucket=bucket, Key=f"{prefix}/plain.ckpt", Body=plain.read_bytes())
    assert cli(*opts, "adopt", f"{url}/plain.ckpt").code == 0
    info = stagesave.verify(f"{url}/plain.ckpt", storage_options=storage)
    assert info.status == "verified" and info.format == 1
    r = cli(*opts, "adopt", f"{url}/step=2.ckpt")
    assert r.code == 1 and "already carries its own stagesave proof" in r.err


@pytest.mark.usefixtures("thread_writer")  # the crash point is in the trainer's own writer
def test_gc_on_s3_aborts_uploads_of_crashed_saves(cli, cli_s3, s3_server):
    url, opts, storage = cli_s3
    # killed with the whole file uploaded and sealed, before completing the upload (its publish)
    assert crash_saves([(url, "big", "crashed.ckpt", "after_proof", storage)]) == [9]
    bucket, prefix = _bucket_key(url)
    client = s3_server.client()
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert [u["Key"] for u in uploads] == [f"{prefix}/crashed.ckpt"]
    rows = cli(*opts, "gc", url, "--dry-run", "--json").json()
    assert rows["found"] == []  # too recent to prove abandoned on an object store
    assert (
        client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []) == []
    )  # nothing published
    doc = cli(*opts, "gc", url, "--dry-run", "--older-than", "1ms", "--json").json()
    assert [d["kind"] for d in doc["found"]] == ["multipart-upload"]
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) != []
    doc = cli(*opts, "gc", url, "--older-than", "1ms", "--json").json()
    assert [d["kind"] for d in doc["done"]] == ["multipart-upload"]
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []
    left = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    assert left == []


def test_bench_on_s3(cli, cli_s3):
    url, opts, _ = cli_s3
    r = cli(*opts, "bench", url, "--size", "1MB", "--repeat", "1", "--warmup", "0", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert {x["method"] for x in doc["results"]} == {"torch.save", "stagesave"}  # no fsync on a URL
    assert doc["floors"]["disk_s"] is None and doc["floors"]["copy_s"] > 0
    r = cli(*opts, "bench", url, "--size", "1MB", "--repeat", "1", "--warmup", "0", "--json",
            "--alternatives", "stagesave,dcp.async_save thread")
    assert r.code == 0, r.err
    doc = r.json()
    assert [x["method"] for x in doc["results"]] == ["stagesave"]
    assert doc["skipped"] == [
        {"method": "dcp.async_save thread", "reason": "writes local paths only"}
    ]


def test_missing_object_and_bucket_on_s3(cli, cli_s3):
    url, opts, _ = cli_s3
    r = cli(*opts, "inspect", f"{url}/nope.ckpt")
    assert r.code == 1 and r.err == f"stagesave: error: no such file or folder: {url}/nope.ckpt\n"
    r = cli(*opts, "ls", "s3://no-such-bucket-for-stagesave/x")
    assert (
        r.code == 1
        and r.err.startswith("stagesave: error:")
        and "no-such-bucket-for-stagesave" in r.err
    )
    assert "Traceback" not in r.err


def test_migrate_on_s3(cli, cli_s3, s3_server, tmp_path):
    """A format-1 file and its sidecar on S3 become one object that carries its own proof (the
    upload is completed in one step: the publish); a format-1 folder there is refused."""
    from clitools import write_format1, write_format1_dir

    url, opts, storage = cli_s3
    bucket, prefix = _bucket_key(url)
    client = s3_server.client()
    path, sidecar = write_format1(tmp_path, "old.ckpt", small_state(2), metadata={"step": 2})
    d = write_format1_dir(tmp_path, "checkpoint_3", step=3)
    for p in (path, sidecar):
        client.put_object(
            Bucket=bucket, Key=f"{prefix}/{os.path.basename(p)}", Body=Path(p).read_bytes()
        )
    for n in os.listdir(d):
        client.put_object(
            Bucket=bucket, Key=f"{prefix}/checkpoint_3/{n}", Body=Path(d, n).read_bytes()
        )
    r = cli(*opts, "migrate", url, "--json")
    assert r.code == 1  # the folder is refused
    by = {os.path.basename(c["path"]): c for c in r.json()["checkpoints"]}
    assert by["old.ckpt"]["action"] == "migrated" and by["old.ckpt"]["seq"] == 0
    assert (
        by["checkpoint_3"]["action"] == "refused"
        and "local disk only" in by["checkpoint_3"]["detail"]
    )
    keys = sorted(
        o["Key"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
    )
    assert [k for k in keys if "/checkpoint_3/" not in k] == [
        f"{prefix}/old.ckpt"
    ]  # the sidecar is gone
    info = stagesave.verify(f"{url}/old.ckpt", storage_options=storage)
    assert info.status == "verified" and info.format == 2 and info.manifest.metadata == {"step": 2}
    assert cli(*opts, "verify", f"{url}/checkpoint_3").code == 0  # still format 1, still verifies
