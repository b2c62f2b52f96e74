"""Fixtures of the S3 tests: the loopback SeaweedFS (tests/s3server.py), a fault-injecting proxy
in front of it (tests/faultproxy.py), and stores with small parts and a fast retry policy."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(__file__))

from faultproxy import FaultProxy
from s3help import FAST_RETRY, PART

from stagesave.stores.s3 import S3Store


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint) as p:
        yield p


@pytest.fixture
def make_store(s3_options):
    """``make_store(url, endpoint=None, **kw)``: an S3Store with 5 MiB parts and fast retries."""
    made: list[S3Store] = []

    def make(url: str, endpoint: str | None = None, options: dict | None = None, **kw) -> S3Store:
        opts = dict(options or s3_options)
        if endpoint is not None:
            opts["endpoint_url"] = endpoint
        kw.setdefault("part_size", PART)
        kw.setdefault("multipart_threshold", PART)
        kw.setdefault("retry", FAST_RETRY)
        store = S3Store(url, opts, **kw)
        made.append(store)
        return store

    yield make
    for s in made:
        s.close()
