"""Signed checkpoints: a key makes every proof keyed; without the key a changed proof is refused."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator

import pytest
import torch
from proofkit import carrier_of, format1_checkpoint, rewrite_proof

import stagesave
from stagesave import signing
from stagesave.errors import CheckpointError, IntegrityError

KEY = bytes(range(32))
OLD_KEY = bytes(range(100, 132))
OTHER_KEY = b"\xee" * 32


@pytest.fixture(autouse=True)
def _no_keys(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (signing.ENV_KEY, signing.ENV_KEY_FILE, signing.ENV_REQUIRE):
        monkeypatch.delenv(name, raising=False)
    signing.configure(None)
    yield
    signing.configure(None)


def state(step: int) -> dict[str, object]:
    return {"step": step, "w": torch.arange(4096, dtype=torch.float32) + step}


def proof_of(path: object) -> dict[str, object]:
    seen: dict[str, object] = {}

    def grab(doc: dict[str, object]) -> bytes:
        seen.update(doc)
        return json.dumps(doc, separators=(",", ":")).encode()

    with open(path, "rb") as f:  # type: ignore[call-overload]
        data = f.read()
    rewrite_proof(path, grab)  # rewrites the same bytes: nothing changes
    with open(path, "rb") as f:  # type: ignore[call-overload]
        assert f.read() == data
    return seen


def test_signed_round_trip_file_and_folder(tmp_path):
    signing.configure([KEY], require=True)
    with stagesave.Checkpointer(tmp_path) as ck:
        ck.save(state(1), "a.ckpt").result()
        ck.save_dir({"model.bin": state(2), "opt.bin": {"lr": torch.tensor(0.1)}},
                    "folder").result()
    doc = proof_of(tmp_path / "a.ckpt")
    # crc32 (the default) is not cryptographic: blake3 while signing
    assert doc["algorithm"] == "blake3"
    assert doc["signature"] == {
        "algorithm": "hmac-sha256", "key": signing.key_id(KEY),
        "mac": doc["signature"]["mac"],  # type: ignore[index]
    }
    assert stagesave.verify(tmp_path / "a.ckpt").status == "verified"
    assert torch.equal(stagesave.load(tmp_path / "a.ckpt")["w"], state(1)["w"])
    assert "signature" in proof_of(carrier_of(tmp_path / "folder"))
    assert stagesave.verify(tmp_path / "folder").status == "verified"
    assert stagesave.load(tmp_path / "folder" / "model.bin")["step"] == 2
    assert stagesave.latest(tmp_path, verify=True) is not None


def _resign_without_key(path: object, change: str) -> None:
    def mutate(doc: dict[str, object]) -> None:
        if change == "metadata":
            doc["metadata"] = {"evil": True}
        elif change == "strip":
            doc.pop("signature")
        elif change == "foreign":
            doc["signature"] = {"algorithm": "hmac-sha256", "key": signing.key_id(OTHER_KEY),
                                "mac": "0" * 64}

    rewrite_proof(path, mutate)


@pytest.mark.parametrize("change", ["metadata", "foreign"])
def test_a_proof_changed_without_the_key_is_refused_and_latest_skips_it(tmp_path, change):
    signing.configure([KEY])
    with stagesave.Checkpointer(tmp_path) as ck:
        ck.save(state(1), "step-1.ckpt").result()
        ck.save(state(2), "step-2.ckpt").result()
    _resign_without_key(tmp_path / "step-2.ckpt", change)
    info = stagesave.verify(tmp_path / "step-2.ckpt")
    assert info.status == "corrupt"
    expected = ("signature does not match" if change == "metadata"
                else "a key this process does not hold")
    assert any(expected in p for p in info.problems), info.problems
    with pytest.raises(IntegrityError, match=expected):
        stagesave.load(tmp_path / "step-2.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        best = stagesave.latest(tmp_path)
    assert best is not None and best.name == "step-1.ckpt"
    assert any("step-2.ckpt" in str(w.message) for w in caught)


def test_bytes_changed_and_reproved_keep_no_valid_signature(tmp_path):
    """An attacker changes a tensor and recomputes every digest (blake3) in the proof: the old
    signature no longer matches the proof."""
    from stagesave.ondisk.checksum import digest

    signing.configure([KEY])
    stagesave.save(state(1), tmp_path / "a.ckpt")
    doc = proof_of(tmp_path / "a.ckpt")
    data = bytearray((tmp_path / "a.ckpt").read_bytes())
    _key, offset, _nbytes = doc["storages"][0]  # type: ignore[index]
    data[offset] ^= 0xFF
    chunk = doc["chunk_bytes"]
    covered = doc["covered"]
    chunks = [digest("blake3", bytes(data[i : min(i + chunk, covered)]))
              for i in range(0, covered, chunk)]  # type: ignore[call-overload, operator]
    with open(tmp_path / "a.ckpt", "wb") as f:
        f.write(data)
    rewrite_proof(tmp_path / "a.ckpt", lambda d: d.update(chunks=chunks))
    with pytest.raises(IntegrityError, match="signature does not match"):
        stagesave.load(tmp_path / "a.ckpt")


def test_unsigned_checkpoints_load_unless_signatures_are_required(tmp_path, monkeypatch):
    stagesave.save(state(1), tmp_path / "unsigned.ckpt")  # no key: crc32, no signature
    format1_checkpoint(tmp_path / "old.ckpt", state(0))
    signing.configure([KEY])
    stagesave.save(state(2), tmp_path / "signed.ckpt")
    _resign_without_key(tmp_path / "signed.ckpt", "strip")  # anyone can strip a signature
    assert stagesave.load(tmp_path / "unsigned.ckpt")["step"] == 1
    assert stagesave.load(tmp_path / "signed.ckpt")["step"] == 2
    signing.configure([KEY], require=True)
    for name in ("unsigned.ckpt", "signed.ckpt"):
        with pytest.raises(IntegrityError, match="not signed, and signatures are required"):
            stagesave.load(tmp_path / name)
    with pytest.raises(IntegrityError, match="format 1 cannot be signed"):
        stagesave.load(tmp_path / "old.ckpt")
    assert stagesave.latest(tmp_path) is None


def test_keys_from_the_environment_and_rotation(tmp_path, monkeypatch):
    monkeypatch.setenv(signing.ENV_KEY, OLD_KEY.hex())
    stagesave.save(state(1), tmp_path / "old.ckpt")
    assert proof_of(tmp_path / "old.ckpt")["signature"]["key"] == signing.key_id(OLD_KEY)  # type: ignore[index]
    # Rotation: the new key first (it signs), the old one below (it still verifies).
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"# signing keys\n{KEY.hex()}\n{OLD_KEY.hex()}\n")
    monkeypatch.delenv(signing.ENV_KEY)
    monkeypatch.setenv(signing.ENV_KEY_FILE, str(keyfile))
    monkeypatch.setenv(signing.ENV_REQUIRE, "1")
    stagesave.save(state(2), tmp_path / "new.ckpt")
    assert proof_of(tmp_path / "new.ckpt")["signature"]["key"] == signing.key_id(KEY)  # type: ignore[index]
    assert stagesave.load(tmp_path / "old.ckpt")["step"] == 1
    assert stagesave.load(tmp_path / "new.ckpt")["step"] == 2
    # The old key retired: its checkpoints are refused (the file is read again when it changes).
    keyfile.write_text(f"{KEY.hex()}\n")
    os.utime(keyfile, ns=(1, 1))
    with pytest.raises(IntegrityError, match="a key this process does not hold"):
        stagesave.load(tmp_path / "old.ckpt")
    assert stagesave.latest(tmp_path).name == "new.ckpt"  # type: ignore[union-attr]


@pytest.mark.parametrize(("value", "message"), [
    ("not hex", "written in hex"),
    ("ab" * 16 + "c", "written in hex"),
    ("ab" * 8, "at least 32 bytes"),
])
def test_a_bad_key_is_a_clear_error_before_anything_is_written(
    tmp_path, monkeypatch, value, message,
):
    monkeypatch.setenv(signing.ENV_KEY, value)
    with pytest.raises(ValueError, match=message):
        stagesave.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match=message):
        stagesave.save(state(1), tmp_path / "a.ckpt")
    assert os.listdir(tmp_path) == []


def test_require_without_a_key_and_a_missing_key_file(tmp_path, monkeypatch):
    monkeypatch.setenv(signing.ENV_REQUIRE, "1")
    with pytest.raises(ValueError, match="no key is"):
        stagesave.Checkpointer(tmp_path)
    monkeypatch.setenv(signing.ENV_KEY_FILE, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read the key file"):
        stagesave.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="at least 32 bytes"):
        signing.configure([b"short"])


def test_an_explicit_cryptographic_checksum_is_kept(tmp_path):
    signing.configure([KEY])
    with stagesave.Checkpointer(tmp_path, checksum="sha256") as ck:
        ck.save(state(1), "a.ckpt").result()
    assert proof_of(tmp_path / "a.ckpt")["algorithm"] == "sha256"
    assert stagesave.verify(tmp_path / "a.ckpt").status == "verified"


def test_errors_are_of_the_family(tmp_path):
    signing.configure([KEY])
    stagesave.save(state(1), tmp_path / "a.ckpt")
    _resign_without_key(tmp_path / "a.ckpt", "metadata")
    with pytest.raises(CheckpointError):
        stagesave.load(tmp_path / "a.ckpt")


def test_the_lightning_plugin_signs_and_refuses_a_changed_proof(tmp_path):
    pytest.importorskip("lightning")
    from stagesave.lightning import StagedCheckpointIO

    signing.configure([KEY], require=True)
    io = StagedCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(8)}, "epoch": 3}, tmp_path / "last.ckpt")
    io.teardown()
    assert proof_of(tmp_path / "last.ckpt")["algorithm"] == "blake3"
    assert io.load_checkpoint(tmp_path / "last.ckpt")["epoch"] == 3
    _resign_without_key(tmp_path / "last.ckpt", "metadata")
    with pytest.raises(IntegrityError, match="signature does not match"):
        io.load_checkpoint(tmp_path / "last.ckpt")
    io.teardown()
