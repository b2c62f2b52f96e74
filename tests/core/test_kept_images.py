"""Images a verification read, kept for the load that follows (restore/kept_images.py): handed
out once, only for the very file verified and unchanged, never outside their scope."""

from __future__ import annotations

import os

import pytest
import torch

import stagesave
from stagesave.restore import kept_images
from stagesave.restore.image_load import Image
from stagesave.restore.verified_memo import forget_verified
from stagesave.safety import safe_torch_load


def _state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=g), "m": torch.randn(300_000, generator=g),
            "step": seed}


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "a.ckpt")
    with stagesave.Checkpointer(writer="thread") as ck:
        ck.save(_state(), path).result()
    forget_verified()
    return path


def test_an_image_is_kept_for_the_file_verified_and_handed_out_once(saved):
    with kept_images.keeping():
        assert stagesave.Checkpointer().verify(saved).status == "verified"
        image = kept_images.take(saved)
        assert isinstance(image, Image)
        got = safe_torch_load(image, map_location="cpu", where=saved)
        assert kept_images.take(saved) is None  # once
    want = _state()
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["m"], want["m"])
    assert got["step"] == 0


def test_nothing_is_kept_outside_a_scope_or_after_it(saved):
    stagesave.Checkpointer().verify(saved)
    with kept_images.keeping():
        assert kept_images.take(saved) is None  # verified before the scope opened
        forget_verified()
        stagesave.Checkpointer().verify(saved)
    assert kept_images.take(saved) is None  # the scope is closed: dropped
    assert kept_images._scopes == []


def test_a_file_replaced_after_its_verification_is_not_served_from_the_image(saved):
    with kept_images.keeping():
        stagesave.Checkpointer().verify(saved)
        with stagesave.Checkpointer(writer="thread") as ck:
            ck.save(_state(1), saved).result()  # a new save over the same name
        assert kept_images.take(saved) is None
        assert kept_images.take(os.path.dirname(saved) + "/none.ckpt") is None


def test_a_corrupt_file_is_reported_and_nothing_is_kept(saved):
    with open(saved, "r+b") as f:
        f.seek(200_000)
        byte = f.read(1)
        f.seek(200_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with kept_images.keeping():
        info = stagesave.Checkpointer().verify(saved)
        assert info.status == "corrupt"
        assert any("checksum mismatch" in p for p in info.problems)
        assert kept_images.take(saved) is None
