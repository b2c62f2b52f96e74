"""Sharded checkpoints on a real S3 server on loopback (tests/s3server.py): the object-store
commit (no rename: the manifest written last is the commit), verified loads, corruption."""

from __future__ import annotations

import pytest
import torch

import stagesave
import stagesave.dcp as sdcp
from stagesave.errors import IntegrityError

pytestmark = [pytest.mark.s3, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


def test_save_replace_load_and_corruption_on_s3(s3_url, s3_options, s3_server):
    writer = sdcp.StagedStorageWriter(root=s3_url, storage_options=s3_options, chunk_bytes=64 * 1024)
    g = torch.Generator().manual_seed(1)
    states = [{"w": torch.randn(300, 100, generator=g), "step": s} for s in (1, 2, 3)]
    sdcp.save(states[0], "step-1", writer=writer).result(60)
    sdcp.save(states[1], "last", writer=writer).result(60)
    sdcp.save(states[2], "last", writer=writer).result(60)  # replaced in place
    latest = stagesave.latest(s3_url, storage_options=s3_options)
    assert latest is not None and latest.name == "last" and latest.is_dir
    names = sorted(f.name for f in latest.manifest.files)
    assert names == [".metadata", "__0_0.distcp"]
    got = {"w": torch.zeros(300, 100), "step": 0}
    sdcp.load(got, f"{s3_url}/last", reader=sdcp.StagedStorageReader(storage_options=s3_options))
    assert torch.equal(got["w"], states[2]["w"]) and got["step"] == 3
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(
        Bucket=s3_url.split("/")[2], Prefix="/".join(s3_url.split("/")[3:]) + "/last/")["Contents"]]
    assert not [k for k in keys if "stagesave-tmp" in k]  # markers removed after the commit
    # A flipped byte in the rank object is caught before DCP sees it.
    client = s3_server.client()
    bucket, key = s3_url.split("/")[2], "/".join(s3_url.split("/")[3:]) + "/last/__0_0.distcp"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-500] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        sdcp.load({"w": torch.zeros(300, 100), "step": 0}, f"{s3_url}/last",
                  reader=sdcp.StagedStorageReader(storage_options=s3_options))
    writer.close()
