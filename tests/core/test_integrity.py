"""Corrupted, truncated and malicious checkpoints are refused, and latest() falls back."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import zipfile

import pytest
import torch
from helpers import format1_checkpoint, rewrite_proof
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagesave
from stagesave.errors import IntegrityError, ManifestError, UnsafeCheckpointError


def _two_checkpoints(root):
    with stagesave.Checkpointer(root, chunk_bytes=4096) as ck:
        ck.save({"step": 1, "w": torch.arange(5000.0)}, "step1.ckpt").result()
        ck.save({"step": 2, "w": torch.arange(5000.0) * 2}, "step2.ckpt").result()
    return root / "step2.ckpt"


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_flipped_byte_is_detected_and_latest_falls_back(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("flip")
    newest = _two_checkpoints(root)
    raw = bytearray(newest.read_bytes())
    # the file's length varies a little from save to save (times in its proof): draw a fraction
    pos = data.draw(st.integers(0, 1 << 30), label="position") % len(raw)
    bit = data.draw(st.integers(0, 7), label="bit")
    raw[pos] ^= 1 << bit
    newest.write_bytes(bytes(raw))
    with stagesave.Checkpointer(root) as ck:
        info = ck.verify("step2.ckpt")
        assert info.status == "corrupt", (pos, bit)
        with pytest.raises(IntegrityError, match=r"step2\.ckpt"):
            ck.load("step2.ckpt")
        with pytest.warns(UserWarning, match="skipping checkpoint"):
            best = ck.latest(verify=True)
        assert best is not None and best.name == "step1.ckpt"
        assert ck.load(best.path)["step"] == 1


@pytest.mark.parametrize("cut", ["truncated", "empty"])
def test_truncated_and_zero_length_files(tmp_path, cut):
    newest = _two_checkpoints(tmp_path)
    size = newest.stat().st_size
    with open(newest, "r+b") as f:
        f.truncate(size // 2 if cut == "truncated" else 0)
    with stagesave.Checkpointer(tmp_path) as ck:
        with pytest.raises(IntegrityError, match="manifest says|truncated"):
            ck.load("step2.ckpt")
        with pytest.warns(UserWarning, match="skipping checkpoint .*step2"):
            assert ck.latest().name == "step1.ckpt"


def test_missing_file_leaves_debris_manifest_ignored(tmp_path):
    newest = _two_checkpoints(tmp_path)
    newest.unlink()
    assert stagesave.latest(tmp_path).name == "step1.ckpt"
    with pytest.raises(FileNotFoundError):
        stagesave.load(newest)


def _manifest_of(path):
    [m] = [
        p
        for p in path.parent.iterdir()
        if p.name.startswith(path.name + ".") and p.name.endswith(".stagesave.json")
    ]
    return m


def _two_format1_checkpoints(root):
    format1_checkpoint(root / "step1.ckpt", {"step": 1, "w": torch.arange(5000.0)})
    format1_checkpoint(root / "step2.ckpt", {"step": 2, "w": torch.arange(5000.0) * 2})
    os.utime(root / "step1.ckpt", (1_000_000, 1_000_000))
    return root / "step2.ckpt"


def test_every_byte_of_the_tail_and_the_first_page_is_covered(tmp_path):
    """Flipping any bit of the bytes that chunks do not cover (the zip tail: index, proof, central
    directory, end records, summary, footer) or of the first page makes the file corrupt."""
    import json as _json

    newest = _two_checkpoints(tmp_path)
    raw = newest.read_bytes()
    from stagesave.ondisk.checksum import crc32
    from stagesave.ondisk.manifest import parse_summary
    from stagesave.ondisk.torchzip import read_footer

    s = parse_summary(read_footer(raw[-4096:], crc32), "x")
    covered = _json.loads(raw[s.proof_offset : s.proof_offset + s.proof_len])["covered"]
    positions = list(range(covered, len(raw))) + list(range(0, 4096, 7))
    from stagesave.restore.discovery import resolve
    from stagesave.stores.local import LocalStore

    store = LocalStore(str(tmp_path))
    for pos in positions:
        bad = bytearray(raw)
        bad[pos] ^= 0x10
        newest.write_bytes(bytes(bad))
        with stagesave.Checkpointer(tmp_path) as ck:
            assert ck.verify("step2.ckpt").status == "corrupt", pos
        assert resolve(store, "step2.ckpt").status in ("corrupt", "committed"), pos
    newest.write_bytes(raw)
    assert stagesave.verify(newest).status == "verified"


def test_a_load_refuses_a_damaged_tensor_index_without_parsing_it(tmp_path):
    """A load does not parse the tensor index (it needs the storages only), but a changed byte
    in it still makes the file corrupt: its digest is checked; ``verify`` parses it."""
    path = tmp_path / "x.ckpt"
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.save({"a": torch.ones(3), "b": {"c": torch.zeros(2)}}, path).result()
        assert [t["name"] for t in ck.verify(path).manifest.tensors] == ["a", "b.c"]
        raw = path.read_bytes()
        at = raw.index(b'{"tensors":[{"name":"a"')
        path.write_bytes(raw[: at + 21] + b"A" + raw[at + 22 :])
        with pytest.raises(IntegrityError, match="its tensor index does not match its proof"):
            ck.load(path)
        path.write_bytes(raw)
        assert torch.equal(ck.load(path)["a"], torch.ones(3))


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "proof length must be an integer"),
        (b"{not json", "not valid JSON"),
        (b"[]", "not a stagesave proof"),
        (None, "schema 99 is not supported"),
        (b"{" + b" " * (65 * 1024 * 1024) + b"}", "proof length must be an integer"),
        (b'{"format":"stagesave","schema":2,"covered":NaN}', "NaN is not JSON"),
    ],
    ids=["empty", "invalid-json", "not-proof", "future-schema", "enormous", "nan"],
)
def test_bad_proofs_are_refused_with_a_reason(tmp_path, content, message):
    """A proof replaced by anything else, with every CRC and the summary made consistent again."""
    newest = _two_checkpoints(tmp_path)

    def mutate(doc):
        if content is None:
            doc["schema"] = 99
            return None
        return content

    rewrite_proof(newest, mutate)
    with stagesave.Checkpointer(tmp_path) as ck:
        info = ck.verify("step2.ckpt")
        assert info.status == "corrupt" and any(message in p for p in info.problems), info.problems
        with pytest.raises(IntegrityError, match=message):
            ck.load("step2.ckpt")
        with pytest.warns(UserWarning):
            assert ck.latest().name == "step1.ckpt"


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"[]", "not a stagesave manifest"),
        (None, "schema 99 is not supported"),
        (b"{" + b" " * (65 * 1024 * 1024) + b"}", "exceeds"),
    ],
    ids=["empty", "invalid-json", "not-manifest", "future-schema", "enormous"],
)
def test_bad_format1_manifests_are_refused_with_a_reason(tmp_path, content, message):
    newest = _two_format1_checkpoints(tmp_path)
    m = _manifest_of(newest)
    if content is None:
        doc = json.loads(m.read_bytes())
        doc["schema"] = 99
        content = json.dumps(doc).encode()
    m.write_bytes(content)
    with stagesave.Checkpointer(tmp_path) as ck:
        info = ck.verify("step2.ckpt")
        assert info.status == "corrupt" and any(message in p for p in info.problems), info.problems
        with pytest.raises(IntegrityError, match=message):
            ck.load("step2.ckpt")
        with pytest.warns(UserWarning):
            assert ck.latest().name == "step1.ckpt"


def test_format1_checkpoints_still_list_verify_and_load(tmp_path):
    newest = _two_format1_checkpoints(tmp_path)
    with stagesave.Checkpointer(tmp_path) as ck:
        assert [c.name for c in ck.list()] == ["step2.ckpt", "step1.ckpt"]
        assert all(c.format == 1 and c.status == "committed" for c in ck.list())
        assert ck.verify("step2.ckpt").status == "verified"
        assert ck.load("step2.ckpt")["step"] == 2
        assert ck.latest().name == "step2.ckpt"
        ck.save({"step": 3}, "step3.ckpt").result()  # a format-2 save is newer than any format 1
        assert ck.latest().name == "step3.ckpt"
    raw = bytearray(newest.read_bytes())
    raw[100] ^= 1
    newest.write_bytes(bytes(raw))
    assert stagesave.verify(newest).status == "corrupt"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("covered", -1, "covered must be an integer"),
        ("covered", 1 << 60, "covered must be an integer"),
        ("chunk_bytes", 0, "chunk_bytes"),
        ("algorithm", "md5", "unknown checksum algorithm"),
        ("chunks", ["zz"], "chunk digest"),
        ("storages", [["0", 10, 1 << 40]], "outside the file"),
        ("storages", [["0", 0, 100], ["1", 50, 10]], "overlap"),
        ("storages", [{"key": "0"}], "not [key, offset, nbytes]"),
        ("seq", -3, "seq must be an integer"),
        ("seq", "1", "seq must be an integer"),
        ("metadata", [], "metadata must be an object"),
        ("folder", {"token": "t", "carrier": "../x"}, "escapes the checkpoint"),
        ("folder", {"token": "t", "carrier": "a", "members": [["b", 1]]}, "folder member"),
        ("blank", [0, 1 << 50], "blank length"),
        ("zip", {"cd": "x"}, "digests of the central directory"),
        ("serialization_id", "../x", "alphanumeric"),
    ],
)
def test_proof_validation_rejects_hostile_fields(tmp_path, field, value, message):
    newest = _two_checkpoints(tmp_path)

    def mutate(doc):
        doc[field] = value

    rewrite_proof(newest, mutate)
    info = stagesave.verify(newest)
    assert info.status == "corrupt" and any(message in p for p in info.problems), info.problems


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("name", "../../etc/passwd", "escapes the checkpoint"),
        ("name", "/abs/path", "escapes the checkpoint"),
        ("name", "s3://bucket/x", "escapes the checkpoint"),
        ("size", -1, "size must be an integer"),
        ("size", 1 << 60, "size must be an integer"),
        ("chunk_bytes", 0, "chunk_bytes"),
        ("algorithm", "md5", "unknown checksum algorithm"),
        ("storages", [{"key": "0", "offset": 10, "nbytes": 1 << 40}], "outside the file"),
        (
            "storages",
            [{"key": "0", "offset": 0, "nbytes": 100}, {"key": "1", "offset": 50, "nbytes": 10}],
            "overlap",
        ),
    ],
)
def test_format1_manifest_validation_rejects_hostile_fields(tmp_path, field, value, message):
    newest = _two_format1_checkpoints(tmp_path)
    m = _manifest_of(newest)
    doc = json.loads(m.read_bytes())
    doc["files"][0][field] = value
    from stagesave.ondisk.manifest import parse_manifest

    with pytest.raises(ManifestError, match=message):
        parse_manifest(json.dumps(doc).encode(), str(m))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
).map(lambda d: json.dumps(d).encode()))
def test_fuzzed_manifests_never_crash_the_parser(blob):
    from stagesave.ondisk.manifest import parse_manifest

    try:
        parse_manifest(blob, "fuzz")
    except ManifestError:
        pass


class _Payload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_malicious_pickle_is_refused_and_creates_nothing(tmp_path):
    target = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    torch.save({"w": torch.ones(1), "x": _Payload(str(target))}, path)  # a plain file, no manifest
    assert not target.exists()
    with pytest.raises(
        UnsafeCheckpointError, match=r"builtins\.open|io\.open|open.*trusted=True"
    ) as ei:
        stagesave.load(path)
    assert isinstance(ei.value, pickle.UnpicklingError)
    assert "stagesave.allow_globals" in str(ei.value) and "trusted=True" in str(ei.value)
    assert not target.exists()


def test_malicious_pickle_inside_a_stagesave_checkpoint(tmp_path):
    target = tmp_path / "pwned2"
    stagesave.save({"x": _Payload(str(target))}, tmp_path / "evil2.ckpt")
    assert not target.exists()
    with pytest.raises(UnsafeCheckpointError):
        stagesave.load(tmp_path / "evil2.ckpt")
    assert not target.exists()
    # The explicit opt-out runs it (and that is the documented risk).
    stagesave.load(tmp_path / "evil2.ckpt", trusted=True)
    assert target.exists()


@dataclasses.dataclass
class Hyper:
    lr: float
    name: str


def test_allow_globals_extends_the_allow_list(tmp_path):
    stagesave.save({"h": Hyper(0.1, "x")}, tmp_path / "c.ckpt")
    with pytest.raises(
        UnsafeCheckpointError, match=r"test_integrity\.Hyper.*allow_globals\(Hyper\)"
    ):
        stagesave.load(tmp_path / "c.ckpt")
    assert stagesave.load(tmp_path / "c.ckpt", safe_globals=[Hyper])["h"] == Hyper(0.1, "x")
    stagesave.allow_globals(Hyper)
    assert stagesave.load(tmp_path / "c.ckpt")["h"] == Hyper(0.1, "x")


def test_plain_file_without_manifest_is_unverified_not_corrupt(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.ckpt")
    info = stagesave.verify(tmp_path / "plain.ckpt")
    assert info.status == "unverified" and info.valid
    assert torch.equal(stagesave.load(tmp_path / "plain.ckpt")["w"], torch.ones(2))
    assert stagesave.latest(tmp_path).name == "plain.ckpt"


def test_torn_plain_file_is_never_latest(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    raw = io.BytesIO()
    torch.save({"w": torch.zeros(1000)}, raw)
    (tmp_path / "b.ckpt").write_bytes(raw.getvalue()[: len(raw.getvalue()) // 2])
    os.utime(tmp_path / "b.ckpt", (2e9, 2e9))
    with pytest.warns(UserWarning, match="truncated zip"):
        assert stagesave.latest(tmp_path).name == "a.ckpt"


def test_stagesave_files_are_valid_torch_zips(tmp_path):
    stagesave.save({"w": torch.randn(10)}, tmp_path / "z.ckpt")
    with zipfile.ZipFile(tmp_path / "z.ckpt") as z:
        names = z.namelist()
    assert any(n.endswith("data.pkl") for n in names) and any("/data/0" in n for n in names)


def test_damaged_pickle_of_a_plain_file_is_an_integrity_error_not_unsafe(tmp_path):
    path = tmp_path / "plain.ckpt"
    torch.save({"a": 1, "w": torch.ones(2)}, path)
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    h = info.header_offset  # the local header's own name/extra lengths (torch pads with an extra)
    start = (
        h
        + 30
        + int.from_bytes(raw[h + 26 : h + 28], "little")
        + int.from_bytes(raw[h + 28 : h + 30], "little")
    )
    raw[start + 2 : start + 12] = b"\xff" * 10  # the pickle's first opcodes become garbage
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="damaged"):
        stagesave.load(path)


def test_small_non_checkpoint_files_are_not_listed(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "hparams.yaml").write_text("a: 1\n")
    stagesave.save({"w": torch.ones(1)}, tmp_path / "a.ckpt")
    assert [c.name for c in stagesave.list_checkpoints(tmp_path)] == ["a.ckpt"]
