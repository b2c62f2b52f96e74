"""A kept safetensors image's tensors (:mod:`stagesave.restore.safetensors_image`): views of the
bytes, equal to what safetensors reads; a header this does not read gives ``None`` (the caller
then lets safetensors judge the file)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stfuzz import fuzzed

from stagesave.restore.safetensors_image import SafetensorsImage, tensors_of


def _file(tensors, metadata=None) -> bytearray:
    return bytearray(safetensors.torch.save(tensors, metadata=metadata))


def _image(data: bytes | bytearray) -> SafetensorsImage:
    return SafetensorsImage(memoryview(bytearray(data)), "test.safetensors")


def _with_header(data: bytearray, edit) -> bytearray:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8 : 8 + n]))
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return bytearray(len(text).to_bytes(8, "little")) + text + data[8 + n :]


def test_every_dtype_and_shape_is_a_view_equal_to_what_safetensors_reads():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g), "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "f64": torch.randn(4, generator=g).double(),
        "i64": torch.arange(6).view(2, 3), "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "u8": torch.tensor([1, 255], dtype=torch.uint8), "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
        "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
    }
    data = _file(tensors, {"format": "pt"})
    image = _image(data)
    got = tensors_of(image)
    want = safetensors.torch.load(bytes(data))
    assert got is not None and sorted(got) == sorted(want)
    base = image.view.obj  # the bytearray behind the view
    start = torch.frombuffer(base, dtype=torch.uint8).data_ptr()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
        if t.numel():
            assert start <= got[k].data_ptr() < start + len(base)  # a view, not a copy


@pytest.mark.parametrize("case", [
    "short", "huge header length", "not json", "a list", "entry not a dict", "unknown dtype",
    "negative shape", "float shape", "offsets past the end", "offsets reversed",
    "wrong byte count", "misaligned", "bool in shape", "empty but enormous", "a gap",
    "an overlap", "too many dimensions",
])
def test_a_header_this_does_not_read_gives_none(case):
    data = _file({"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(3)})
    edits = {
        "unknown dtype": lambda h: h["a"].update(dtype="F7"),
        "negative shape": lambda h: h["a"].update(shape=[-4]),
        "float shape": lambda h: h["a"].update(shape=[4.0]),
        "bool in shape": lambda h: h["a"].update(shape=[True, 4]),
        "offsets past the end": lambda h: h["b"].update(data_offsets=[16, 16 + 10**6]),
        "offsets reversed": lambda h: h["a"].update(data_offsets=[16, 0], shape=[0]),
        "wrong byte count": lambda h: h["a"].update(shape=[3]),
        "misaligned": lambda h: h["b"].update(data_offsets=[17, 25], shape=[2]),
        "entry not a dict": lambda h: h.update(a=[1, 2]),
        "empty but enormous": lambda h: h["a"].update(shape=[0, 2**70], data_offsets=[0, 0]),
        "a gap": lambda h: h["a"].update(shape=[3], data_offsets=[0, 12]),
        "an overlap": lambda h: h["b"].update(data_offsets=[12, 24]),
        "too many dimensions": lambda h: h["a"].update(shape=[4] + [1] * 64),
    }
    if case == "short":
        data = data[:7]
    elif case == "huge header length":
        data[:8] = (10**12).to_bytes(8, "little")
    elif case == "not json":
        n = int.from_bytes(data[:8], "little")
        data[8:9] = b"}"
        assert n > 1
    elif case == "a list":
        text = b"[1, 2, 3]    "
        data = bytearray(len(text).to_bytes(8, "little")) + text
    else:
        data = _with_header(data, edits[case])
    assert tensors_of(_image(data)) is None


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_what_this_takes_safetensors_takes_and_reads_the_same(data):
    """Differential, over the fuzzed files of the security suite: never an exception; where
    tensors come out, safetensors reads the same bytes into the same tensors."""
    original = bytes(_file({"a": torch.arange(6, dtype=torch.float32).view(2, 3),
                            "b": torch.ones(3, dtype=torch.float16), "c": torch.zeros(0)}))
    blob = data.draw(st.just(original) | fuzzed(original))
    got = tensors_of(_image(blob))
    assert blob != original or got is not None
    if got is None:
        return
    want = safetensors.torch.load(blob)
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
