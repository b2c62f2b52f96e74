"""Hostile checkpoints: traversal in manifests, symlinks out of the root, fuzzed safetensors
headers.

What is read is proven with an audit hook (``sys.addaudithook``): every ``open`` made through
Python (``open``, ``io.open``, ``os.open``, in any thread; stagesave reads every file that way, and
torch.load opens its file that way too) is recorded while a hostile checkpoint is listed,
verified and loaded, and none may touch a path outside the checkpoint root. (Opens made inside
native code, e.g. by the safetensors library, are not audited; those tests do not rely on them.)
Malicious pickles and fuzzed manifests are tested in
``tests/core/test_integrity.py``; gc and symlinks in ``tests/cli/test_cli_gc.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import faultstats
import psutil
import pytest
import torch
from faulthelp import dir_state, file_state, tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proofkit import carrier_of, format1_checkpoint, rewrite_proof
from stfuzz import fuzzed

import stagesave
from stagesave.errors import CheckpointError

# ---------------------------------------------------------------------------- the audit hook
_opened: list[str] = []
_auditing = threading.Event()


def _audit(event: str, args: tuple) -> None:  # type: ignore[type-arg]
    if (
        _auditing.is_set()
        and event == "open"
        and args
        and isinstance(args[0], (str, bytes, os.PathLike))
    ):
        _opened.append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # cannot be removed; it records only inside ``audited()``


@contextlib.contextmanager
def audited() -> Iterator[list[str]]:
    """The paths opened (by any thread) while the block runs."""
    _opened.clear()
    _auditing.set()
    try:
        yield _opened
    finally:
        _auditing.clear()


def _outside(paths: list[str], root: str, base: str) -> list[str]:
    """Opened paths under ``base`` (the test's tree) that are not inside ``root``."""
    root = os.path.realpath(root)
    out = []
    for p in paths:
        real = os.path.realpath(p)
        under_base = (
            os.path.commonpath([real, base]) == base or os.path.commonpath([p, base]) == base
        )
        if under_base and os.path.commonpath([real, root]) != root:
            out.append(p)
    return out


def test_the_audit_hook_sees_opens_by_torch_and_by_threads(tmp_path):
    """The proof method itself: an open in another thread and torch's own reader are seen."""
    torch.save({"w": torch.ones(2)}, tmp_path / "t.pt")
    with audited() as opened:
        t = threading.Thread(target=lambda: open(tmp_path / "t.pt", "rb").close())
        t.start()
        t.join()
        torch.load(tmp_path / "t.pt", weights_only=True)
    assert opened.count(str(tmp_path / "t.pt")) >= 2


# ---------------------------------------------------------------------------- traversal in
# manifests
HOSTILE_NAMES = [
    "../outside/secret.bin",
    "a/../../outside/secret.bin",
    "..",
    "{abs}",
    "s3://bucket/secret.bin",
    "file://{abs}",
    "..\\outside\\secret.bin",
    "optimizer.bin\x00../../outside/secret.bin",
    "./optimizer.bin",
]


@pytest.fixture
def world(tmp_path):
    """``root`` with a committed folder and file; ``outside`` with a secret next to it."""
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"do not read me" * 100)
    torch.save({"secret": torch.ones(3)}, outside / "secret.ckpt")
    with stagesave.Checkpointer(root, chunk_bytes=8192) as ck:
        ck.save_dir(dir_state(1), "checkpoint").result()
        ck.save(file_state(1), "model.ckpt").result()
    return tmp_path, root, outside


def _rename_entry(manifest_path, old: str, new: str) -> None:
    doc = json.loads(manifest_path.read_bytes())
    for f in doc["files"]:
        if f["name"] == old:
            f["name"] = new
    manifest_path.write_text(json.dumps(doc))


def _rename_member(folder, old: str, new: str) -> None:
    """Rename a file of the folder in its carrier's proof, every CRC made consistent again."""
    def mutate(doc):
        for m in doc["folder"]["members"]:
            if m[0] == old:
                m[0] = new

    rewrite_proof(carrier_of(folder), mutate)


@pytest.mark.fault_class("path traversal in a manifest (audited)")
@pytest.mark.parametrize("hostile", HOSTILE_NAMES)
def test_traversal_in_a_folder_proof_is_refused_before_any_io(world, hostile):
    base, root, outside = world
    name = hostile.format(abs=str(outside / "secret.bin"))
    _rename_member(root / "checkpoint", "model.safetensors", name)
    with audited() as opened, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with stagesave.Checkpointer(root) as ck:
            info = ck.verify("checkpoint")
            listed = {c.name: c.status for c in ck.list()}
            best = ck.latest(verify=True)
            with pytest.raises(CheckpointError):
                ck.load("checkpoint/optimizer.bin")  # the carrier: its proof is the hostile one
    assert info.status == "corrupt" and "escapes the checkpoint" in info.problems[0], info.problems
    assert listed["checkpoint"] == "corrupt"
    assert best is not None and best.name == "model.ckpt"  # the good one is still found
    assert _outside(opened, str(root), str(base)) == []
    assert not any("secret" in p for p in opened)


@pytest.mark.fault_class("path traversal in a manifest (audited)")
@pytest.mark.parametrize("hostile", HOSTILE_NAMES)
def test_traversal_in_a_format1_file_manifest_is_refused_before_any_io(world, hostile):
    base, root, outside = world
    name = hostile.format(abs=str(outside / "secret.bin"))
    (root / "model.ckpt").unlink()
    manifest = format1_checkpoint(root / "model.ckpt", file_state(1))
    _rename_entry(Path(manifest), "model.ckpt", name)
    with audited() as opened, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with stagesave.Checkpointer(root) as ck:
            info = ck.verify("model.ckpt")
            best = ck.latest(verify=True)
            with pytest.raises(CheckpointError, match="escapes the checkpoint|corrupt"):
                ck.load("model.ckpt")
    assert info.status == "corrupt" and any("escapes the checkpoint" in p for p in info.problems)
    assert best is None or best.name != "model.ckpt"
    assert _outside(opened, str(root), str(base)) == []


# ---------------------------------------------------------------------------- symlinks
@pytest.fixture
def linked(world):
    """Links in ``root`` to checkpoints outside it: a file (with its manifest), a folder."""
    base, root, outside = world
    with stagesave.Checkpointer(outside, chunk_bytes=8192) as ck:
        ck.save(file_state(9), "real.ckpt").result()
        ck.save_dir(dir_state(9), "folder").result()
    os.symlink(outside / "real.ckpt", root / "linked.ckpt")
    os.symlink(outside / "folder", root / "linked_folder")
    os.symlink(outside / "secret.bin", root / "secret.ckpt")
    return base, root, outside


@pytest.mark.fault_class("symlinks out of the root")
def test_listing_and_latest_do_not_follow_links_out_of_the_root(linked):
    base, root, _outside_dir = linked
    with audited() as opened, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with stagesave.Checkpointer(root) as ck:
            names = sorted(c.name for c in ck.list())
            best = ck.latest(verify=True)
    assert names == ["checkpoint", "model.ckpt"]
    assert best is not None and best.name in ("checkpoint", "model.ckpt")
    assert _outside(opened, str(root), str(base)) == []


def _files(d) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    return {p: (d / p).read_bytes() for p in tree(d) if (d / p).is_file()}


@pytest.mark.fault_class("symlinks out of the root")
def test_retention_and_removing_a_linked_file_never_delete_through_links(linked):
    _base, root, outside = linked
    before = _files(outside)
    with stagesave.Checkpointer(root, keep_last=1, chunk_bytes=8192) as ck:
        for step in (2, 3, 4):
            ck.save(file_state(step), f"s{step}.ckpt").result()
        ck.remove("linked.ckpt").result()  # removes the link itself, never its target
    assert _files(outside) == before
    assert not os.path.lexists(root / "linked.ckpt")
    assert [c.name for c in stagesave.list_checkpoints(root)] == ["s4.ckpt"]


@pytest.mark.fault_class("symlinks out of the root")
def test_removing_a_linked_folder_never_deletes_inside_its_target(linked):
    """remove() of a link to a folder outside must not delete anything inside that folder."""
    _base, root, outside = linked
    before = _files(outside)
    with stagesave.Checkpointer(root) as ck:
        ck.remove("linked_folder").result()
    assert _files(outside) == before


@pytest.mark.fault_class("symlinks out of the root")
@pytest.mark.parametrize("linked_file", ["optimizer.bin", "model.safetensors"])
def test_links_inside_a_checkpoint_folder_are_not_followed(world, linked_file):
    """A real checkpoint folder whose carrier (optimizer.bin) or another file links out of the
    root: refused as corrupt, and nothing outside is opened."""
    base, root, outside = world
    target = outside / "stolen"
    shutil.copy(root / "checkpoint" / linked_file, target)  # the attacker's copy, outside
    (root / "checkpoint" / linked_file).unlink()
    os.symlink(target, root / "checkpoint" / linked_file)
    with audited() as opened, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with stagesave.Checkpointer(root) as ck:
            info = ck.verify("checkpoint")
            ck.latest(verify=True)
    assert _outside(opened, str(root), str(base)) == [], "opened through a link out of the root"
    assert info.status == "corrupt"


# ---------------------------------------------------------------------------- fuzzed safetensors
@pytest.fixture(scope="module")
def committed_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("st")
    with stagesave.Checkpointer(root, chunk_bytes=4096) as ck:
        ck.save_dir(dir_state(1), "checkpoint").result()
    return root / "checkpoint"


def _resign(folder, data: bytes) -> None:
    """Rewrite the folder's proof so that it vouches for ``data`` as its model.safetensors (an
    attacker controls both): the file becomes a listed file with its checksums in the carrier."""
    from stagesave.ondisk.checksum import digest

    def mutate(doc):
        step, algorithm = doc["chunk_bytes"], doc["algorithm"]
        f = doc["folder"]
        f["members"] = [m for m in f["members"] if m[0] != "model.safetensors"]
        f["listed"] = [e for e in f["listed"] if e["name"] != "model.safetensors"] + [
            {
                "name": "model.safetensors",
                "size": len(data),
                "algorithm": algorithm,
                "chunk_bytes": step,
                "chunks": [
                    digest(algorithm, data[i : i + step]) for i in range(0, len(data), step)
                ],
                "kind": "raw",
                "serialization_id": None,
                "id_offset": None,
                "storages": [],
            }
        ]

    rewrite_proof(carrier_of(folder), mutate)


_fuzz_runs = {"examples": 0, "refused": 0, "loaded": 0, "peak": 0}


@settings(
    max_examples=150,
    deadline=None,  # bounded in CPU time below: a stall of a loaded machine is not the file's
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_safetensors_header_fails_cleanly_in_bounded_time_and_memory(
    committed_folder, tmp_path_factory, data
):
    from safetensors.torch import load_file

    original = (committed_folder / "model.safetensors").read_bytes()
    blob = data.draw(fuzzed(original))
    folder = tmp_path_factory.mktemp("fz") / "checkpoint"
    shutil.copytree(committed_folder, folder)
    (folder / "model.safetensors").write_bytes(blob)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t0 = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # 1. As committed: verification refuses any changed byte before a parser sees it.
        info = stagesave.verify(folder)
        assert info.status == ("verified" if blob == original else "corrupt"), info.problems
        # 2. Re-signed by the attacker: verification passes, the safetensors parser gets it.
        _resign(folder, blob)
        try:
            assert stagesave.verify(folder).status == "verified"
        except CheckpointError:
            pass  # a manifest stagesave itself refuses is fine too
        try:
            tensors = load_file(str(folder / "model.safetensors"))
            _fuzz_runs["loaded"] += 1
            assert all(isinstance(t, torch.Tensor) for t in tensors.values())
        except Exception:  # noqa: BLE001 - a clean refusal (SafetensorError, ValueError, ...)
            _fuzz_runs["refused"] += 1
    _fuzz_runs["examples"] += 1
    _fuzz_runs["peak"] = max(_fuzz_runs["peak"], proc.memory_info().rss - rss0)
    assert time.process_time() - t0 < 2.0  # CPU seconds of this process (a few ms normally)
    assert proc.memory_info().rss - rss0 < 256 << 20
    shutil.rmtree(folder.parent)


def test_fuzz_summary():
    """Runs after the fuzz test (file order): record what it did."""
    runs = _fuzz_runs["examples"]
    if runs == 0:
        pytest.skip("the fuzz test did not run in this session")
    faultstats.record("fuzzed safetensors header in a committed folder", runs)
    print(f"fuzzed safetensors: {runs} examples, {_fuzz_runs['refused']} refused by the parser, "
          f"{_fuzz_runs['loaded']} loaded, peak RSS growth {_fuzz_runs['peak'] >> 20} MiB")
    assert _fuzz_runs["refused"] > 0
