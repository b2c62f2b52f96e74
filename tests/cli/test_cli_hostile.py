"""Hostile-but-well-formed proofs through the API and every command that reads one (issue 18).

An attacker with write access to a checkpoint directory can rewrite a format-2 proof (or its
tensor index) and make every CRC consistent again (``proofkit.rewrite_proof``, and
``rewrite_index`` here for the index record the proof pins by digest). Such a file is JSON that
parses, with fields of the wrong type, non-finite numbers (``1e999`` reads as infinity), absurd
shapes or markup. The parsers refuse every one as corrupt with the field named; whatever they
accept is printed literally and written out as valid JSON; every command exits 0 or 1 with at
most one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from clitools import CliRun, write_checkpoints, write_dir_checkpoint, write_format1
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proofkit import rewrite_proof

import stagesave
from stagesave.errors import CheckpointError


# ----------------------------------------------------------------------------- helpers
def rewrite_index(path: Any, mutate: Any) -> None:
    """Rewrite a format-2 torch file's tensor index with ``mutate(index)`` (bytes returned are
    used verbatim), pin it in the proof by its new digest, and rebuild the tail so that every
    CRC and offset is consistent: what an attacker without a key can produce."""
    from stagesave.ondisk.checksum import crc32, digest
    from stagesave.ondisk.manifest import Summary, parse_summary
    from stagesave.ondisk.names import INDEX_RECORD, PROOF_RECORD
    from stagesave.ondisk.torchzip import TorchZip, build_tail, read_footer
    from stagesave.restore.proof import zip_tail_parts

    data = Path(path).read_bytes()
    raw = read_footer(data[-65536:], crc32)
    assert raw is not None, "not a format-2 file"
    s = parse_summary(raw, str(path))
    doc = json.loads(data[s.proof_offset : s.proof_offset + s.proof_len])
    covered = doc["covered"]
    parts = zip_tail_parts(data[covered:], covered, s.proof_offset, s.proof_len, len(raw))
    assert parts is not None
    index = json.loads(parts.index)
    out = mutate(index)
    new_index = out if isinstance(out, bytes) else json.dumps(index).encode()
    doc["zip"]["index"] = digest(doc["algorithm"], new_index)
    proof = json.dumps(doc, separators=(",", ":")).encode()
    zip_ = TorchZip(parts.prefix, (), covered, parts.cd_prefix, parts.zip64)
    records = [(INDEX_RECORD, new_index), (PROOF_RECORD, proof)]
    _, offsets = build_tail(
        zip_, parts.cd_prefix, records, b"{}", crc32=crc32, n_records=parts.n_records
    )
    summary = Summary(
        s.kind, s.seq, s.created_ns, offsets[1], len(proof), crc32(proof), s.folder, s.carrier
    )
    tail, _ = build_tail(
        zip_, parts.cd_prefix, records, summary.to_bytes(), crc32=crc32, n_records=parts.n_records
    )
    Path(path).write_bytes(data[:covered] + tail)


def _strict_json(text: str) -> Any:
    """JSON as the standard defines it: no NaN, no Infinity, no number that overflows a float."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} in the output")

    def finite(s: str) -> float:
        f = float(s)
        assert f not in (float("inf"), float("-inf")), f"{s} in the output"
        return f

    return json.loads(text, parse_constant=refuse, parse_float=finite)


def _clean(r: CliRun, what: str) -> None:
    """Exit 0 or 1, and a failure is one line on stderr (no traceback)."""
    assert r.code in (0, 1), (what, r.code, r.err[-2000:])
    assert "Traceback" not in r.err and "Traceback" not in r.out, (what, r.err[-2000:])
    if r.code == 1:
        assert r.err.startswith("stagesave: error: ") and r.err.count("\n") == 1, (
            what,
            r.err[-2000:],
        )


def _every_command(cli: Any, root: Path, path: Path, tmp: Path) -> dict[str, CliRun]:
    """Every command that reads a proof, on ``path`` (a checkpoint in ``root``); each run clean."""
    runs = {
        "verify": cli("verify", path),
        "verify --json": cli("verify", path, "--json"),
        "verify ROOT": cli("verify", root),
        "inspect": cli("inspect", path),
        "inspect --json": cli("inspect", path, "--json"),
        "ls": cli("ls", root),
        "ls --json": cli("ls", root, "--json"),
        "export": cli("export", path, tmp / "exported.ckpt"),
        "adopt": cli("adopt", path),
        "migrate --dry-run": cli("migrate", root, "--dry-run"),
        "gc --dry-run": cli("gc", root, "--dry-run"),
    }
    for what, r in runs.items():
        _clean(r, what)
        if "--json" in what:
            _strict_json(r.out)
    return runs


def _assert_refused(cli: Any, root: Path, path: Path, tmp: Path, field: str) -> None:
    """The API and every command call ``path`` corrupt, naming ``field``."""
    info = stagesave.verify(path)
    assert info.status == "corrupt", info
    assert any(field in p for p in info.problems), info.problems
    with pytest.raises(CheckpointError, match=r"corrupt|invalid"):
        stagesave.load(path)
    runs = _every_command(cli, root, path, tmp)
    for what in ("verify", "verify --json", "verify ROOT", "inspect", "inspect --json", "export"):
        assert runs[what].code == 1, (what, runs[what])
    assert field in runs["verify"].err
    assert _strict_json(runs["inspect --json"].out)["status"] == "corrupt"
    assert [r["status"] for r in _strict_json(runs["ls --json"].out)] == ["corrupt"]
    assert runs["ls"].code == 0 and "corrupt" in runs["ls"].out
    assert not (tmp / "exported.ckpt").exists()


@pytest.fixture
def one(tmp_path: Path) -> tuple[Path, Path]:
    """``(root, path)``: one committed format-2 checkpoint, ``step=1.ckpt``."""
    root = tmp_path / "root"
    root.mkdir()
    path = Path(write_checkpoints(root, steps=(1,))[0])
    return root, path


# ------------------------------------------------------------------ each reported case
def _infinite_metadata(doc: dict[str, Any]) -> bytes:
    doc["metadata"]["lr"] = 12345.5
    return json.dumps(doc, separators=(",", ":")).replace("12345.5", "1e999").encode()


def test_infinite_metadata_is_corrupt(cli, one, tmp_path):
    """``1e999`` is valid JSON that Python reads as infinity: `inspect --json` wrote `Infinity`."""
    root, path = one
    rewrite_proof(path, _infinite_metadata)
    _assert_refused(cli, root, path, tmp_path, "metadata['lr']")


def _nested(depth: int) -> Any:
    doc: Any = 0
    for _ in range(depth):
        doc = {"a": doc}
    return doc


# (index mutation, the field the error names)
_HOSTILE_INDEX = {
    "tensors entry not an object": (
        lambda ix: ix["tensors"].insert(0, 7),
        "tensors[0] is not an object",
    ),
    "tensors not a list": (lambda ix: ix.update(tensors={"w": 1}), "tensors must be a list"),
    "dimension not an int": (lambda ix: ix["tensors"][0].update(shape=["10"]), "tensors[0].shape"),
    "dimension a float": (lambda ix: ix["tensors"][0].update(shape=[2.5]), "tensors[0].shape"),
    "dimension a bool": (lambda ix: ix["tensors"][0].update(shape=[True]), "tensors[0].shape"),
    "dimension negative": (lambda ix: ix["tensors"][0].update(shape=[-4]), "tensors[0].shape"),
    "400k dimensions": (
        lambda ix: ix["tensors"][0].update(shape=[10**6] * 400_000),
        "tensors[0].shape",
    ),
    "element count overflows": (
        lambda ix: ix["tensors"][0].update(shape=[1 << 40] * 3),
        "tensors[0].shape",
    ),
    "name not a string": (lambda ix: ix["tensors"][0].update(name=["w"]), "tensors[0].name"),
    "dtype not a string": (lambda ix: ix["tensors"][0].update(dtype=None), "tensors[0].dtype"),
    "stride of another rank": (
        lambda ix: ix["tensors"][0].update(stride=[1, 1, 1]),
        "tensors[0].stride",
    ),
    "infinite extra field": (
        lambda ix: (
            json.dumps({**ix, "tensors": [{**ix["tensors"][0], "x": 12345.5}]})
            .replace("12345.5", "1e999")
            .encode()
        ),
        "tensors[0]['x']",
    ),
    "infinite telemetry": (
        lambda ix: (
            json.dumps({**ix, "telemetry": {**ix["telemetry"], "write_s": 12345.5}})
            .replace("12345.5", "1e999")
            .encode()
        ),
        "telemetry['write_s']",
    ),
    "telemetry of the wrong type": (
        lambda ix: ix["telemetry"].update(blocking_s="fast"),
        "telemetry['blocking_s']",
    ),
    "telemetry int past a float": (
        lambda ix: ix["telemetry"].update(blocking_s=10**400),
        "telemetry['blocking_s']",
    ),
    "telemetry nested too deep": (
        lambda ix: ix["telemetry"].update(extra=_nested(150)),
        "nests deeper",
    ),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE_INDEX))
def test_hostile_tensor_index_is_corrupt(cli, one, tmp_path, case):
    """The tensor index is pinned by the proof; a rewritten one that parses is still refused."""
    root, path = one
    mutate, field = _HOSTILE_INDEX[case]
    rewrite_index(path, mutate)
    _assert_refused(cli, root, path, tmp_path, field)


@pytest.mark.parametrize("case", sorted(_HOSTILE_INDEX))
def test_a_load_that_parses_the_index_beside_its_reads_refuses_it_too(one, case, monkeypatch):
    """A load parses a large index while its chunks are read (here: every index, whatever its
    size); a rewritten one is refused before anything is handed out, verified or not."""
    from stagesave.errors import IntegrityError
    from stagesave.restore import proof

    monkeypatch.setattr(proof, "PARSE_LATER_BYTES", 0)
    _, path = one
    mutate, field = _HOSTILE_INDEX[case]
    rewrite_index(path, mutate)
    for verify in (True, False):
        with pytest.raises(IntegrityError, match="is corrupt") as caught:
            stagesave.load(path, verify=verify)
        assert field in str(caught.value), (verify, str(caught.value))


def test_deep_metadata_is_corrupt(cli, one, tmp_path):
    root, path = one
    rewrite_proof(path, lambda doc: doc["metadata"].update(deep=_nested(150)))
    _assert_refused(cli, root, path, tmp_path, "nests deeper than 100 levels")


def test_markup_in_the_kind_is_corrupt(cli, one, tmp_path):
    root, path = one
    rewrite_proof(path, lambda doc: doc.update(kind="[/]"))
    _assert_refused(cli, root, path, tmp_path, "kind")


@pytest.mark.parametrize(
    "case", ["tensors entry not an object", "400k dimensions", "infinite telemetry"]
)
def test_hostile_format1_sidecar_is_corrupt(cli, tmp_path, case):
    """A format-1 sidecar carries its own tensor index and telemetry: checked the same way."""
    root = tmp_path / "root"
    root.mkdir()
    path, sidecar = write_format1(root, "step=1.ckpt", {"w": torch.ones(3)})
    doc = json.loads(Path(sidecar).read_text())
    mutate, field = _HOSTILE_INDEX[case]
    out = mutate(doc)
    Path(sidecar).write_bytes(out if isinstance(out, bytes) else json.dumps(doc).encode())
    _assert_refused(cli, root, Path(path), tmp_path, field)


def test_markup_is_printed_literally(cli, one, tmp_path):
    """Strings from a valid proof are data: a tensor named `[/]` (rich's MarkupError), a dtype
    `[bold]`, metadata with markup and a checkpoint named `ckpt[x].ckpt` print as they are."""
    root, path = one
    rewrite_index(path, lambda ix: ix["tensors"][0].update(name="[/]w[red]x", dtype="[bold]f32"))
    rewrite_proof(path, lambda doc: doc["metadata"].update(note="[link=http://x]y[/link] [/]"))
    os.rename(path, root / "ckpt[x].ckpt")
    path = root / "ckpt[x].ckpt"
    assert stagesave.verify(path).status == "verified"
    runs = _every_command(cli, root, path, tmp_path)
    assert runs["verify"].code == 0 and "ckpt[x].ckpt" in runs["verify"].out
    assert runs["ls"].code == 0 and "ckpt[x].ckpt" in runs["ls"].out
    text = runs["inspect"].out
    assert runs["inspect"].code == 0, runs["inspect"].err
    assert "ckpt[x].ckpt" in text and "[/]w[red]x" in text and "[bold]f32" in text
    assert "[link=http://x]y[/link] [/]" in text
    doc = _strict_json(runs["inspect --json"].out)
    assert doc["tensors"][0]["name"] == "[/]w[red]x" and doc["tensors"][0]["bytes"] is None


def test_verify_a_lightning_link_verifies_its_target(cli, tmp_path):
    """save_last="link": last.ckpt -> epoch=..ckpt (a file, or a folder checkpoint) is judged by
    its target; a link out of the root is refused in one line."""
    root = tmp_path / "root"
    root.mkdir()
    write_checkpoints(root, steps=(1,))
    os.rename(root / "step=1.ckpt", root / "epoch=0-step=1.ckpt")
    os.symlink("epoch=0-step=1.ckpt", root / "last.ckpt")
    write_dir_checkpoint(root, "epoch=1-step=2.ckpt")
    os.symlink("epoch=1-step=2.ckpt", root / "last-v1.ckpt")
    for link in ("last.ckpt", "last-v1.ckpt"):
        assert stagesave.verify(root / link).status == "verified"
        r = cli("verify", root / link)
        assert r.code == 0 and r.out.startswith(f"OK         {root / link}"), r.err
        r = cli("inspect", root / link, "--json")
        assert r.code == 0 and _strict_json(r.out)["status"] == "committed", r.err
    r = cli("verify", root)
    assert r.code == 0 and "last" not in r.out, r.out  # each target once, links not counted twice
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    write_checkpoints(outside, steps=(5,))
    os.symlink(outside / "step=5.ckpt", root / "stolen.ckpt")
    r = cli("verify", root / "stolen.ckpt")
    assert r.code == 1 and r.err.count("\n") == 1
    assert "symbolic link out of the checkpoint root" in r.err


def test_hostile_telemetry_lines_in_report(cli, tmp_path):
    """`report` reads telemetry JSON lines, not proofs: odd lines are skipped, never a crash."""
    good = {
        "path": "a[/].ckpt",
        "started_at": 1.0,
        "blocking_s": 0.5,
        "bytes": 10,
        "committed_at": 2.0,
    }
    lines = [
        json.dumps(good),
        json.dumps({**good, "started_at": 2.0, "blocking_s": "x", "bytes": None}),
        '{"started_at": 1e999, "blocking_s": NaN}',
        "[1, 2]",
        '{"started_at": true}',
        "{not json",
    ]
    (tmp_path / "stagesave-telemetry.jsonl").write_text("\n".join(lines) + "\n")
    for args in ((), ("--json",)):
        r = cli("report", tmp_path, *args, "--no-png")
        _clean(r, "report")
        if args:
            _strict_json(r.out)


# ------------------------------------------------------------------------------ fuzz
_MARKUP = [
    "[/]",
    "[bold]x[/bold]",
    "[link=file:///etc/passwd]y",
    "\x1b[2J",
    "\u202e",
    "ckpt[x].ckpt",
    "",
    "é",
]
_INTS = [0, 1, -1, 2**31, 2**32, 2**62, 2**62 + 1, 2**63, 2**64, -(2**63), 10**4000]
_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(_INTS),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.sampled_from(_MARKUP),
)
_value = st.one_of(
    st.recursive(
        _leaf,
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
        max_leaves=12,
    ),
    st.just([1] * 5000),
    st.just([10**6] * 2000),
    st.builds(_nested, st.sampled_from([99, 101, 400])),
)
#: Where a value goes: (part, path of keys; "*" a fresh key), drawn per example.
_SPOTS = [
    ("proof", ("kind",)),
    ("proof", ("seq",)),
    ("proof", ("created_ns",)),
    ("proof", ("covered",)),
    ("proof", ("algorithm",)),
    ("proof", ("chunk_bytes",)),
    ("proof", ("chunks",)),
    ("proof", ("chunks", 0)),
    ("proof", ("serialization_id",)),
    ("proof", ("id_offset",)),
    ("proof", ("storages",)),
    ("proof", ("storages", 0)),
    ("proof", ("storages", 0, 1)),
    ("proof", ("blank",)),
    ("proof", ("zip",)),
    ("proof", ("metadata",)),
    ("proof", ("metadata", "*")),
    ("proof", ("folder",)),
    ("proof", ("*",)),
    ("index", ("tensors",)),
    ("index", ("tensors", 0)),
    ("index", ("tensors", 0, "name")),
    ("index", ("tensors", 0, "dtype")),
    ("index", ("tensors", 0, "shape")),
    ("index", ("tensors", 0, "shape", 0)),
    ("index", ("tensors", 0, "stride")),
    ("index", ("tensors", 0, "storage_offset")),
    ("index", ("tensors", 0, "storage")),
    ("index", ("tensors", 0, "*")),
    ("index", ("telemetry",)),
    ("index", ("telemetry", "blocking_s")),
    ("index", ("telemetry", "direct_io")),
    ("index", ("telemetry", "*")),
    ("index", ("*",)),
]


def _put(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    last = path[-1]
    if last == "*":
        last = "x_hostile"
    if isinstance(doc, list):
        if last < len(doc):
            doc[last] = value
        else:
            doc.append(value)
    else:
        doc[last] = value


def _encode(doc: Any, spelling: str) -> bytes:
    """``doc`` as JSON whose non-finite floats are spelled ``NaN``/``Infinity`` (Python's
    extension) or ``1e999`` (valid JSON that parses as infinity)."""
    text = json.dumps(doc, separators=(",", ":"))
    if spelling == "1e999":
        text = (
            text.replace("-Infinity", "-1e999").replace("Infinity", "1e999").replace("NaN", "1e999")
        )
    return text.encode()


_fuzz = {"examples": 0, "verified": 0, "corrupt": 0}


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory) -> bytes:
    root = tmp_path_factory.mktemp("fuzzbase")
    return Path(write_checkpoints(root, steps=(1,))[0]).read_bytes()


_FUZZ_HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
_fuzz_given = given(
    spot=st.sampled_from(_SPOTS), value=_value, spelling=st.sampled_from(["1e999", "NaN"])
)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=_FUZZ_HEALTH)
@_fuzz_given
def test_fuzzed_proof_fields(cli, fuzz_base, tmp_path_factory, spot, value, spelling):
    """Any value in any field of a proof or its tensor index, every CRC consistent: `verify`,
    `inspect --json`, `ls`, `stagesave.verify` and `stagesave.latest` never crash or hang, refuse
    it as corrupt or accept it, and what they accept prints as valid JSON."""
    _fuzz_one(cli, fuzz_base, tmp_path_factory, spot, value, spelling)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, database=None, suppress_health_check=_FUZZ_HEALTH)
@_fuzz_given
def test_fuzzed_proof_fields_exhaustive(cli, fuzz_base, tmp_path_factory, spot, value, spelling):
    _fuzz_one(cli, fuzz_base, tmp_path_factory, spot, value, spelling)


def _fuzz_one(cli, fuzz_base, tmp_path_factory, spot, value, spelling):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("fz")
    path = root / "step=1.ckpt"
    path.write_bytes(fuzz_base)
    part, where = spot

    def mutate(doc: Any) -> bytes:
        try:
            _put(doc, where, value)
        except (KeyError, IndexError, TypeError):
            doc["x_hostile"] = value  # the spot does not exist in this doc: a fresh key instead
        return _encode(doc, spelling)

    (rewrite_proof if part == "proof" else rewrite_index)(path, mutate)
    t0 = time.monotonic()
    try:
        info = stagesave.verify(path)
    except CheckpointError:
        status = "corrupt"
    else:
        status = info.status
        assert status in ("verified", "corrupt"), info
        if status == "verified":
            m = info.manifest
            assert m is not None
            json.dumps([m.metadata, m.telemetry, m.tensors], allow_nan=False)
    r = cli("verify", path)
    _clean(r, "verify")
    assert r.code == (0 if status == "verified" else 1), (status, r)
    r = cli("inspect", path, "--json")
    _clean(r, "inspect --json")
    assert _strict_json(r.out)["status"] == ("committed" if status == "verified" else "corrupt")
    assert r.code == (0 if status == "verified" else 1)
    r = cli("inspect", path)
    _clean(r, "inspect")
    r = cli("ls", root, "--json")
    _clean(r, "ls --json")
    assert r.code == 0 and [x["status"] for x in _strict_json(r.out)] == [
        "committed" if status == "verified" else "corrupt"]
    r = cli("ls", root)
    _clean(r, "ls")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a corrupt checkpoint is skipped with a warning
        for verify in (False, True):
            best = stagesave.latest(root, verify=verify)
            assert (best.name if best is not None else None) == (
                path.name if status == "verified" else None
            )
    assert time.monotonic() - t0 < 10
    _fuzz["examples"] += 1
    _fuzz[status] += 1
    shutil.rmtree(root)


def test_fuzz_summary():
    """Runs after the fuzz test (file order): what it did."""
    if _fuzz["examples"] == 0:
        pytest.skip("the fuzz test did not run in this session")
    print(
        f"fuzzed proof fields: {_fuzz['examples']} examples through stagesave.verify, verify, "
        f"inspect, inspect --json, ls, ls --json: {_fuzz['corrupt']} refused as corrupt, "
        f"{_fuzz['verified']} verified"
    )
    assert _fuzz["corrupt"] > 0 and _fuzz["examples"] >= 200
