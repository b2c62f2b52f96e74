"""Helpers of the S3 tests (a module of its own: every test folder has a ``conftest``)."""

from __future__ import annotations

import torch

from stagesave.stores.s3 import RetryPolicy

MiB = 1 << 20
#: Parts of 5 MiB (S3's minimum) so that a 12 MiB checkpoint is a three-part upload.
PART = 5 * MiB
FAST_RETRY = RetryPolicy(max_attempts=5, base_delay_s=0.01, max_delay_s=0.05)


def big_state(seed: int = 0, mib: int = 12) -> dict:
    """A state whose torch file is a little over ``mib`` MiB (three parts at 12)."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "step": seed}


def small_state(seed: int = 0) -> dict:
    return {"w": torch.arange(100.0) + seed, "step": seed}


def split_url(url: str) -> tuple[str, str]:
    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    return bucket, prefix


def open_uploads(s3_server, url: str) -> list[dict]:
    bucket, prefix = split_url(url)
    listed = s3_server.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/")
    return listed.get("Uploads", [])


def object_names(s3_server, url: str) -> list[str]:
    bucket, prefix = split_url(url)
    listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1 :] for o in listed.get("Contents", []))
