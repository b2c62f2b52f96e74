"""A folder checkpoint on S3 saved again over a prefix that also holds the user's objects: the
earlier checkpoint's objects that the new one does not write are deleted, the user's stay
(never read as part of the checkpoint); removing the checkpoint removes its objects and keeps
the user's, as on local disk; a prefix without a checkpoint is removed whole."""

from __future__ import annotations

import pytest
import torch
from s3help import object_names, split_url

import stagesave
from stagesave.formats import Raw

pytestmark = pytest.mark.s3


def test_a_prefix_saved_over_keeps_the_users_objects(s3_server, s3_url, s3_options):
    folder = f"{s3_url}/ck"
    bucket, key = split_url(folder)
    with stagesave.Checkpointer(storage_options=s3_options) as ck:
        ck.save_dir({"optimizer.bin": {"step": 1, "m": torch.ones(4)},
                     "config.json": Raw(b'{"step": 1}')}, folder).result()
        s3_server.client().put_object(Bucket=bucket, Key=f"{key}/tokenizer.json", Body=b"{}")
        info = ck.verify(folder)
        assert (info.status, info.beside) == ("verified", ["tokenizer.json"])
        ck.save_dir({"optimizer.bin": {"step": 2, "m": torch.full((4,), 2.0)}}, folder).result()
        assert object_names(s3_server, folder) == ["optimizer.bin", "tokenizer.json"]
        got = s3_server.client().get_object(Bucket=bucket, Key=f"{key}/tokenizer.json")
        assert got["Body"].read() == b"{}"
        assert ck.verify(folder).status == "verified"
        assert ck.load(f"{folder}/optimizer.bin")["step"] == 2
        ck.remove(folder).result()
        assert object_names(s3_server, folder) == ["tokenizer.json"]
        ck.remove(folder).result()  # no checkpoint there any more: removed as asked
        assert object_names(s3_server, folder) == []
