"""The fused copy-and-CRC staging path gives the same bytes and CRCs as copy-then-CRC.

The CRCs are the format-2 chunk checksums (of the image as staged) and each slot's zip record CRC.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagesave.saving.crc_pass as stage_mod
from stagesave.saving.buffers import HostBuffer
from stagesave.saving.plan import StorageSlot, plan_torch_file
from stagesave.saving.plan_safetensors import plan_safetensors_file
from stagesave.saving.stage import crc_image, on_host, stage_and_crc, stage_image


def _reference_crcs(view: memoryview, image, chunk: int) -> tuple[list[int], list[int]]:
    """CRC-32s computed the slow, obvious way (zlib over each range)."""
    data = bytes(view[: image.size])
    chunks = [
        zlib.crc32(data[lo : min(image.covered, lo + chunk)])
        for lo in range(0, image.covered, chunk)
    ]
    slots = [zlib.crc32(data[s.offset : s.offset + s.nbytes]) for s in image.slots]
    return chunks, slots

_DTYPES = [torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool]


def _garbage_buffer(nbytes: int, fill: int) -> HostBuffer:
    buf = HostBuffer.allocate(max(nbytes, 4096), pinned=False)
    buf.tensor.fill_(fill)  # a reused buffer holds an older save's bytes
    return buf


@st.composite
def states(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(0, 12))
    state: dict[str, object] = {
        "step": draw(st.integers(0, 10**6)),
        "name": draw(st.text(max_size=20)),
    }
    for i in range(n):
        numel = draw(st.sampled_from([0, 1, 3, 1000, 4097, 70_000, 300_001]))
        dtype = draw(st.sampled_from(_DTYPES))
        t = (torch.arange(numel) % 251).to(dtype)
        kind = draw(st.sampled_from(["plain", "view", "transposed", "meta"]))
        if kind == "view" and numel > 2:
            t = t[1:]  # shares a storage with an offset: the whole storage is saved
        elif kind == "transposed" and numel >= 1000:
            t = t[:1000].reshape(10, 100).t()
        elif kind == "meta":
            t = torch.empty(numel, dtype=dtype, device="meta")
        state[f"t{i}"] = t
    return state


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=states(), chunk_pages=st.integers(1, 40), sub_pages=st.integers(1, 70),
       base_pages=st.integers(0, 3))
def test_fused_staging_matches_copy_then_crc(state, chunk_pages, sub_pages, base_pages):
    image = plan_torch_file(state)
    assert on_host(image)
    chunk, base = chunk_pages * 4096, base_pages * 4096
    reference = _garbage_buffer(base + image.size, 0xAB)
    assert stage_image(image, reference, base) is None
    chunks, slots = _reference_crcs(reference.view[base:], image, chunk)
    fused = _garbage_buffer(base + image.size, 0x5C)
    old = stage_mod.SUB_CHUNK
    stage_mod.SUB_CHUNK = sub_pages * 1024  # sub-chunks that cut through tensors and pieces
    try:
        with cf.ThreadPoolExecutor(3) as pool:
            crcs = stage_and_crc(image, fused, base, chunk_bytes=chunk, pool=pool)
            again = crc_image(
                image, fused.view[base : base + image.size], chunk_bytes=chunk, pool=pool
            )
    finally:
        stage_mod.SUB_CHUNK = old
    assert bytes(fused.view[base : base + image.size]) == bytes(
        reference.view[base : base + image.size]
    )
    assert bytes(fused.view[:base]) == bytes([0x5C]) * base  # nothing before base touched
    assert crcs.chunks == chunks and crcs.slots == slots
    assert again.chunks == chunks and again.slots == slots
    assert crcs.seconds >= 0.0
    # the background's CRCs of an image of many small slots (slot by slot) or of few (one pass)
    real = stage_mod.many_small_slots
    for many in (True, False):
        stage_mod.many_small_slots = lambda _, many=many: many
        try:
            with cf.ThreadPoolExecutor(3) as pool:
                alone = crc_image(image, fused.view[base : base + image.size], chunk_bytes=chunk,
                                  pool=pool)
        finally:
            stage_mod.many_small_slots = real
        assert alone.chunks == chunks and alone.slots == slots, many


def test_fused_staging_of_a_safetensors_image_loads_back_equal():
    from safetensors.torch import load as st_load

    tensors = {"a": torch.randn(513, 7), "b": torch.arange(10_000, dtype=torch.int16),
               "c": torch.randn(64, 64).t(), "empty": torch.zeros(0)}
    image = plan_safetensors_file(tensors)
    buf = _garbage_buffer(image.size, 0xFF)
    with cf.ThreadPoolExecutor(2) as pool:
        crcs = stage_and_crc(image, buf, chunk_bytes=8192, pool=pool)
    loaded = st_load(bytes(buf.view[: image.size]))
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v)
    assert (crcs.chunks, crcs.slots) == _reference_crcs(buf.view, image, 8192)


def test_fused_staging_refuses_device_state():
    image = plan_torch_file({"t": torch.ones(3)})
    s = image.slots[0]
    image.slots[0] = StorageSlot(
        s.key, s.offset, s.nbytes, torch.empty(12, dtype=torch.uint8, device="meta")
    )
    assert on_host(image)  # meta has no bytes: still host-only
    fake = type("FakeDevice", (), {"device": torch.device("cuda", 0), "is_cpu": False})()
    image.slots[0] = StorageSlot(s.key, s.offset, s.nbytes, fake)
    assert not on_host(image)
    with pytest.raises(ValueError, match="host memory"):
        stage_and_crc(
            image, _garbage_buffer(image.size, 0), chunk_bytes=4096, pool=cf.ThreadPoolExecutor(1)
        )


@pytest.mark.parametrize(("l2", "expected"), [
    (None, 512 << 10),  # unknown cache: 512 KiB
    (0, 512 << 10),
    (256 << 10, 128 << 10),  # never below 128 KiB
    (512 << 10, 256 << 10),
    (1 << 20, 512 << 10),  # half the cache: source and destination both stay in it
    (1280 << 10, 640 << 10),
    (2 << 20, 1 << 20),
    (32 << 20, 1 << 20),  # never above 1 MiB
    ((1 << 20) + 1000, 512 << 10),  # page multiples
])
def test_sub_chunk_is_half_the_l2_cache_within_bounds(l2, expected):
    assert stage_mod.sub_chunk_bytes(l2) == expected


def test_sub_chunk_follows_this_machines_l2_cache():
    l2 = stage_mod._l2_cache_bytes()
    index2 = "/sys/devices/system/cpu/cpu0/cache/index2/size"
    if os.path.exists(index2):  # Linux tells the cache sizes: the real one is read
        with open(index2) as f:
            size = f.read().strip()
        assert l2 == int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]]
    assert stage_mod.SUB_CHUNK == stage_mod.sub_chunk_bytes(l2)
    assert stage_mod.SUB_CHUNK % 4096 == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=states(), chunk_pages=st.integers(1, 12))
def test_filled_zip_crcs_update_the_chunk_crcs_without_rehashing(state, chunk_pages):
    """After staging, each storage record's CRC goes into its data descriptor; the chunk CRCs
    are patched for those bytes (CRC-32 is affine) and equal a CRC of the final bytes."""
    from stagesave.saving.write import fill_crcs

    image = plan_torch_file(state)
    chunk = chunk_pages * 4096
    buf = _garbage_buffer(image.size, 0x11)
    with cf.ThreadPoolExecutor(2) as pool:
        crcs = stage_and_crc(image, buf, chunk_bytes=chunk, pool=pool)
    fill_crcs(image, buf.view, crcs)
    chunks, slots = _reference_crcs(buf.view, image, chunk)
    assert crcs.chunks == chunks
    for i, at in enumerate(image.crc_fields):
        if at >= 0:
            assert int.from_bytes(bytes(buf.view[at : at + 4]), "little") == slots[i]
