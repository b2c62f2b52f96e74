"""A read of an S3 object whose version nobody pinned (``read_range``/``read_into`` without an
``open``) reads one version whole even when the object is replaced between its ranged GETs, and
no GET of a failed attempt goes on writing into the caller's buffer. The interleaving (a span's
response begun on the old version, another span refused with ``PreconditionFailed``, a retry)
cannot be caused on demand against a real server, so a client standing in for it serves the
ranged GETs; the real server's side is ``test_put_atomic_is_never_read_partly_written`` in
``tests/test_store_conformance.py``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from botocore.exceptions import ClientError

from stagesave.errors import StorageError
from stagesave.stores.s3 import S3Store

MiB = 1 << 20
PART = 5 * MiB
SIZE = 3 * PART


class _Body:
    def __init__(self, data: bytes, delay: float, log: list[str], tag: str) -> None:
        self.data, self.pos, self.delay, self.log, self.tag = data, 0, delay, log, tag

    async def read(self, n: int) -> bytes:
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.log.append(f"cancelled {self.tag}")
            raise
        chunk = self.data[self.pos : self.pos + n]
        self.pos += len(chunk)
        return chunk

    def close(self) -> None:
        pass


class _Replacing:
    """Version A until the second GET has begun its answer; version B from then on. The second
    GET's body arrives slowly (3 s: longer than any stall before the next GET fails); the
    retry's last span a little slowly (0.3 s)."""

    def __init__(self, replace_each_time: bool = False) -> None:
        self.etag, self.data, self.gets, self.log = '"A"', b"A" * SIZE, 0, []
        self.replace_each_time = replace_each_time

    async def get_object(self, Bucket: str, Key: str, Range: str,
                         IfMatch: str | None = None) -> dict[str, Any]:
        self.gets += 1
        lo, hi = map(int, Range.split("=")[1].split("-"))
        if IfMatch is not None and IfMatch != self.etag:
            raise ClientError({"Error": {"Code": "PreconditionFailed", "Message": "changed"},
                               "ResponseMetadata": {"HTTPStatusCode": 412}}, "GetObject")
        data, etag, delay = self.data[lo : hi + 1], self.etag, 0.0
        if self.gets == 2 or (self.replace_each_time and IfMatch is not None):
            delay = 3.0
            new = "B" if self.etag == '"A"' else "A"
            self.etag, self.data = f'"{new}"', new.encode() * SIZE
        elif self.gets >= 4 and lo >= 2 * PART:
            delay = 0.3
        return {"ETag": etag, "ContentLength": len(data),
                "Body": _Body(data, delay, self.log, f"GET {self.gets}")}


@pytest.fixture
def store_with(monkeypatch: pytest.MonkeyPatch):
    made: list[S3Store] = []

    def make(client: _Replacing) -> S3Store:
        store = S3Store("s3://bucket", {"key": "k", "secret": "s",
                                        "endpoint_url": "http://127.0.0.1:9"},
                        part_size=PART, multipart_threshold=PART)

        async def fake() -> _Replacing:
            return client

        monkeypatch.setattr(store.requests, "client", fake)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def _versions(buf: bytes | bytearray) -> list[set[int]]:
    return [set(buf[lo : lo + PART : 4096]) | {buf[lo + PART - 1]} for lo in range(0, SIZE, PART)]


def test_an_object_replaced_between_its_gets_is_read_again_whole(store_with) -> None:
    client = _Replacing()
    store = store_with(client)
    out = bytearray(SIZE)
    assert store.read_into("x", 0, memoryview(out)) == SIZE
    assert _versions(out) == [{ord("B")}] * 3  # the new version, whole
    time.sleep(3.2)  # the first attempt's slow GET would have landed its old bytes by now
    assert _versions(out) == [{ord("B")}] * 3
    assert "cancelled GET 2" in client.log  # cancelled, not left running
    assert store.read_range("x", 0, SIZE) == b"B" * SIZE


def test_an_object_replaced_at_every_try_raises_and_writes_nothing_after(store_with) -> None:
    client = _Replacing(replace_each_time=True)
    store = store_with(client)
    out = bytearray(SIZE)
    with pytest.raises(StorageError, match="replaced"):
        store.read_into("x", 0, memoryview(out))
    before = bytes(out)
    time.sleep(3.2)
    assert bytes(out) == before  # no GET of a failed attempt wrote after the error
    assert sum(1 for line in client.log if line.startswith("cancelled")) == 3
