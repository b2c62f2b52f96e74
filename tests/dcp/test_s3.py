"""Sharded checkpoints on a real S3 server on loopback (tests/s3server.py): the object-store
commit (no rename: ``.metadata`` written last, carrying the folder's proof, is the commit),
verified loads, corruption."""

from __future__ import annotations

import pytest
import torch

import stagesave
import stagesave.dcp as sdcp
from stagesave.errors import IntegrityError

pytestmark = [
    pytest.mark.s3,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


def test_save_replace_load_and_corruption_on_s3(s3_url, s3_options, s3_server):
    writer = sdcp.StagedStorageWriter(
        root=s3_url, storage_options=s3_options, chunk_bytes=64 * 1024
    )
    g = torch.Generator().manual_seed(1)
    states = [{"w": torch.randn(300, 100, generator=g), "step": s} for s in (1, 2, 3)]
    sdcp.save(states[0], "step-1", writer=writer).result(60)
    sdcp.save(states[1], "last", writer=writer).result(60)
    sdcp.save(states[2], "last", writer=writer).result(60)  # replaced in place
    latest = stagesave.latest(s3_url, storage_options=s3_options)
    assert latest is not None and latest.name == "last" and latest.is_dir and latest.format == 2
    assert latest.manifest is not None and latest.manifest.folder is not None
    assert (
        latest.manifest.files[0].name == ".metadata"
        and latest.manifest.files[0].kind == "dcp-metadata"
    )
    assert [m.name for m in latest.manifest.folder.members] == ["__0_0.distcp"]
    assert [c.name for c in stagesave.list_checkpoints(s3_url, storage_options=s3_options)] == [
        "last",
        "step-1",
    ]
    assert stagesave.verify(f"{s3_url}/last", storage_options=s3_options).status == "verified"
    got = {"w": torch.zeros(300, 100), "step": 0}
    sdcp.load(got, f"{s3_url}/last", reader=sdcp.StagedStorageReader(storage_options=s3_options))
    assert torch.equal(got["w"], states[2]["w"]) and got["step"] == 3
    prefix = "/".join(s3_url.split("/")[3:]) + "/"
    keys = [o["Key"][len(prefix):] for o in s3_server.client().list_objects_v2(
        Bucket=s3_url.split("/")[2], Prefix=prefix)["Contents"]]
    # Exactly DCP's files: the markers (in a hidden prefix beside the folder) went with the commit.
    assert sorted(keys) == [
        "last/.metadata",
        "last/__0_0.distcp",
        "step-1/.metadata",
        "step-1/__0_0.distcp",
    ]
    # A flipped byte in the rank object is caught before DCP sees it: in the data (a chunk's
    # checksum) as in the proof after it (the proof's own CRC).
    client = s3_server.client()
    bucket, key = s3_url.split("/")[2], "/".join(s3_url.split("/")[3:]) + "/last/__0_0.distcp"
    good = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    for at, problem in (
        (len(good) // 2, "checksum mismatch"),
        (len(good) - 500, r"proof record is damaged"),
    ):
        data = bytearray(good)
        data[at] ^= 0xFF
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
        with pytest.raises(IntegrityError, match=problem):
            sdcp.load({"w": torch.zeros(300, 100), "step": 0}, f"{s3_url}/last",
                      reader=sdcp.StagedStorageReader(storage_options=s3_options))
    writer.close()


def test_a_user_object_beside_a_sharded_checkpoint_survives_its_replacement(
    s3_url, s3_options, s3_server
):
    """Saved again in place over a prefix that also holds an object of the user's: the older
    save's rank files go (a rank fewer), the user's object stays, never read."""
    client = s3_server.client()
    bucket, prefix = s3_url.split("/")[2], "/".join(s3_url.split("/")[3:])
    writer = sdcp.StagedStorageWriter(root=s3_url, storage_options=s3_options)
    with writer:  # closed: its threads end with the test
        sdcp.save({"w": torch.zeros(8), "step": 1}, "last", writer=writer).result(60)
        client.put_object(Bucket=bucket, Key=f"{prefix}/last/notes.txt", Body=b"mine")
        client.put_object(Bucket=bucket, Key=f"{prefix}/last/__1_0.distcp",
                          Body=b"an older rank's")
        assert stagesave.verify(f"{s3_url}/last", storage_options=s3_options).beside == [
            "__1_0.distcp", "notes.txt"]
        sdcp.save({"w": torch.ones(8), "step": 2}, "last", writer=writer).result(60)
    keys = sorted(o["Key"][len(prefix) + 1:] for o in client.list_objects_v2(
        Bucket=bucket, Prefix=prefix + "/")["Contents"])
    assert keys == ["last/.metadata", "last/__0_0.distcp", "last/notes.txt"]
    got = {"w": torch.zeros(8), "step": 0}
    sdcp.load(got, f"{s3_url}/last", reader=sdcp.StagedStorageReader(storage_options=s3_options))
    assert torch.equal(got["w"], torch.ones(8)) and got["step"] == 2
