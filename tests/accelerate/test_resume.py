"""Restoring: bitwise-equal state, plain Accelerate interop, torn and corrupt checkpoints,
automatic naming with total_limit while saves are in flight, iteration restored."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import stagesave.accelerate as sa
import torch
from accel_helpers import ListingWatcher, assert_same, build, snapshot, train, visible
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import stagesave
from stagesave.errors import CheckpointNotFoundError, IntegrityError


def _auto(tmp_path, total_limit=None, **kw):
    return Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=total_limit, **kw))


def _saved(tmp_path, saves, **save_kwargs):
    """An enabled Accelerator under automatic naming after ``saves`` steps, each followed by
    a save_state(**save_kwargs); the state snapshot before each save, all committed."""
    acc = _auto(tmp_path)
    run = build(acc)
    sa.enable(acc)
    states = []
    for _ in range(saves):
        train(acc, run, 1)
        states.append(snapshot(acc, run))
        acc.save_state(**save_kwargs)
    acc._stagesave.wait()
    return acc, run, states


def test_bitwise_restore_after_training_continued(tmp_path):
    acc = Accelerator(cpu=True)
    run = build(acc, n_models=2)
    sa.enable(acc)
    train(acc, run, 5)
    before = snapshot(acc, run)
    path = acc.save_state(str(tmp_path / "ck"))
    assert str(path) == str(tmp_path / "ck")
    train(acc, run, 4)  # changes every parameter, moment, lr, counter and RNG stream
    acc.load_state(str(tmp_path / "ck"))
    assert_same(before, snapshot(acc, run))


def test_plain_accelerate_load_state_restores_a_stagesave_checkpoint(tmp_path):
    acc = Accelerator(cpu=True)
    run = build(acc)
    sa.enable(acc)
    train(acc, run, 3)
    before = snapshot(acc, run)
    acc.save_state(str(tmp_path / "ck"))
    sa.disable(acc)  # waits for the commit and gives Accelerate its methods back
    assert "save_state" not in vars(acc) and "load_state" not in vars(acc)
    train(acc, run, 3)
    acc.load_state(str(tmp_path / "ck"))  # Accelerate's own code, no stagesave involved
    assert_same(before, snapshot(acc, run))


def test_stagesave_loads_a_plain_accelerate_folder(tmp_path):
    acc = Accelerator(cpu=True)
    run = build(acc)
    train(acc, run, 2)
    before = snapshot(acc, run)
    acc.save_state(str(tmp_path / "plain"))
    sa.enable(acc)
    train(acc, run, 2)
    acc.load_state(str(tmp_path / "plain"))
    assert_same(before, snapshot(acc, run))


def test_explicit_missing_or_corrupt_folder_raises(tmp_path):
    acc = Accelerator(cpu=True)
    run = build(acc)
    sa.enable(acc)
    with pytest.raises(ValueError, match=r"Tried to find .*nope but folder does not exist"):
        acc.load_state(str(tmp_path / "nope"))
    train(acc, run, 1)  # the optimizer holds tensors (moments) from now on
    acc.save_state(str(tmp_path / "ck"))
    acc._stagesave.wait()
    _flip_data_byte(tmp_path / "ck" / "optimizer.bin")
    train(acc, run, 1)
    after = snapshot(acc, run)
    with pytest.raises(IntegrityError, match=r"ck is corrupt: .*optimizer.bin: checksum mismatch"):
        acc.load_state(str(tmp_path / "ck"))
    assert_same(after, snapshot(acc, run))  # nothing was half-loaded


def test_a_damaged_proof_makes_the_folder_corrupt(tmp_path):
    acc = Accelerator(cpu=True)
    build(acc)
    sa.enable(acc)
    acc.save_state(str(tmp_path / "ck"))
    acc._stagesave.wait()
    carrier = stagesave.verify(tmp_path / "ck").manifest.folder.carrier
    _flip_byte(tmp_path / "ck" / carrier)  # near the end of a torch file: its proof and footer
    with pytest.raises(IntegrityError, match=rf"ck is corrupt: .*{carrier}"):
        acc.load_state(str(tmp_path / "ck"))
    sa.disable(acc)


def _flip_data_byte(path):
    """Flip one byte of the first tensor record of a torch file (its data, not its proof)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        record = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 0)
    with open(path, "rb") as f:  # the data follows the record's local header
        f.seek(record.header_offset + 26)
        name_len, extra_len = (
            int.from_bytes(f.read(2), "little"),
            int.from_bytes(f.read(2), "little"),
        )
    _flip_byte(path, record.header_offset + 30 + name_len + extra_len, os.SEEK_SET)


def _flip_byte(path, offset=-100, whence=os.SEEK_END):
    with open(path, "r+b") as f:
        f.seek(offset, whence)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_automatic_naming_resumes_newest_valid_and_restores_iteration(tmp_path):
    acc, run, states = _saved(tmp_path, 3)
    root = tmp_path / "checkpoints"
    assert visible(root) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    _flip_byte(root / "checkpoint_2" / "model.safetensors")
    train(acc, run, 2)
    with pytest.warns(
        UserWarning,
        match=r"skipping checkpoint .*checkpoint_2: .*model.safetensors: checksum mismatch",
    ):
        acc.load_state()
    assert_same(states[1], snapshot(acc, run))
    assert acc.project_configuration.iteration == 2
    # The next save replaces the corrupt checkpoint_2 (a valid one would be refused).
    with pytest.warns(UserWarning, match="replacing the invalid checkpoint .*checkpoint_2"):
        acc.save_state()
    acc._stagesave.wait()
    acc.load_state()
    assert_same(states[1], snapshot(acc, run))
    assert acc.project_configuration.iteration == 3


def test_new_process_resumes_with_fresh_accelerator(tmp_path):
    acc = _auto(tmp_path)
    run = build(acc)
    sa.enable(acc)
    train(acc, run, 2)
    acc.save_state()
    train(acc, run, 2)
    before = snapshot(acc, run)
    acc.save_state()
    acc._stagesave.close()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    acc2 = _auto(tmp_path)
    run2 = build(acc2, seed=123)
    sa.enable(acc2)
    assert acc2.project_configuration.iteration == 0
    acc2.load_state()
    assert_same(before, snapshot(acc2, run2))
    assert acc2.project_configuration.iteration == 2


def test_existing_valid_or_plain_folder_is_refused_like_accelerate(tmp_path):
    acc = _auto(tmp_path)
    build(acc)
    sa.enable(acc)
    acc.save_state()
    acc._stagesave.wait()
    acc.project_configuration.iteration = 0
    with pytest.raises(ValueError, match=r"checkpoint_0 \(0\) already exists"):
        acc.save_state()
    os.makedirs(tmp_path / "checkpoints" / "checkpoint_1")
    acc.project_configuration.iteration = 1
    with pytest.raises(ValueError, match="no stagesave proof, so stagesave does not replace it"):
        acc.save_state()


def test_no_checkpoint_at_all(tmp_path):
    acc = _auto(tmp_path)
    build(acc)
    sa.enable(acc)
    with pytest.raises(CheckpointNotFoundError, match="no valid checkpoint under"):
        acc.load_state()


def test_total_limit_with_saves_in_flight(tmp_path):
    acc = _auto(tmp_path, total_limit=2)
    run = build(acc, width=1024)  # ~2 M parameters: each save writes ~25 MB in the background
    ckpt = sa.enable(acc, max_pending=2)
    root = tmp_path / "checkpoints"
    os.makedirs(root)
    overlapped = 0
    with ListingWatcher(root) as watcher:
        for _ in range(6):
            train(acc, run, 1)
            acc.save_state()
            overlapped += ckpt.pending() > 0
            _only_committed_folders(root)
        ckpt.wait()
    # Folders are assembled under stagesave's temporary names beside them (dot-names, which
    # stagesave's listing and load_state never take for checkpoints); the only other names that
    # ever appeared are the checkpoints, each visible only once committed (checked above).
    others = {n for n in watcher.seen if not stagesave.is_temporary(n)}
    assert others <= {f"checkpoint_{i}" for i in range(6)}, sorted(watcher.seen)
    assert all(n.startswith(".checkpoint_") for n in watcher.seen - others), sorted(watcher.seen)
    assert sorted(os.listdir(root)) == ["checkpoint_4", "checkpoint_5"]  # and none is left
    before = snapshot(acc, run)
    assert overlapped > 0, "no save was still in flight when the next began"
    assert visible(root) == ["checkpoint_4", "checkpoint_5"]
    train(acc, run, 1)
    acc.load_state()
    assert_same(before, snapshot(acc, run))


def _only_committed_folders(root) -> None:
    """Accelerate's listing never shows an uncommitted folder: each one it sees proves itself."""
    for name in visible(root):
        try:
            info = stagesave.verify(root / name)
        except CheckpointNotFoundError:
            info = None
        if os.path.exists(root / name):  # (else retention removed it meanwhile)
            assert info is not None and info.status == "verified", (
                f"{name} visible before its commit: {info}"
            )
    assert len(visible(root)) <= 3


@pytest.mark.parametrize("point", ["third-file-of-third-save", "carrier-proof-before-rename"])
@pytest.mark.usefixtures("thread_writer")  # the crash point is in the trainer's own writer
def test_sigkill_mid_save_resumes_from_previous_and_retention_kept_it(worker_runs, point):
    # dist_worker.py trained with total_limit=1 and was SIGKILLed during its third save.
    assert worker_runs.exit[f"crash-{point}"] == -9
    project = worker_runs.out / f"crash-{point}"
    root = project / "checkpoints"
    # The last committed checkpoint and the killed save's temporary beside it; nothing else, and
    # nothing of stagesave's in the project folder.
    assert sorted(os.listdir(project)) == ["checkpoints", "expected.pt", "log"]
    [debris] = [n for n in os.listdir(root) if n != "checkpoint_1"]
    assert debris.startswith(".checkpoint_2.") and debris.endswith(".stagesave-tmp")
    want = torch.load(project / "expected.pt", weights_only=False)

    # stagesave resumes from the previous good folder with the debris there (the choice below is
    # stagesave's; plain Accelerate's is checked after gc).
    from accelerate.state import AcceleratorState

    staged = _auto(project, total_limit=1)
    run = build(staged, seed=7)
    sa.enable(staged)
    staged.load_state()
    assert_same(want, snapshot(staged, run))
    sa.disable(staged)
    AcceleratorState._reset_state(True)

    # Plain Accelerate sorts every entry by its first number and would take the debris (2) for
    # the newest; `stagesave gc` removes it (its writer is dead), then Accelerate's automatic
    # load_state() picks the previous good folder.
    gc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "stagesave"), "gc", str(project)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert sorted(os.listdir(root)) == ["checkpoint_1"]
    plain = _auto(project, total_limit=1)
    run = build(plain, seed=7)
    plain.load_state()
    assert_same(want, snapshot(plain, run))

    AcceleratorState._reset_state(True)
    acc = _auto(project, total_limit=1)
    run = build(acc, seed=7)
    sa.enable(acc)
    acc.load_state()
    assert_same(want, snapshot(acc, run))
    assert acc.project_configuration.iteration == 2
    train(acc, run, 1)
    acc.save_state()
    acc._stagesave.wait()
    assert sorted(os.listdir(root)) == ["checkpoint_2"]


def _format1_folder(folder, metadata) -> None:
    """Turn a plain Accelerate folder into one as stagesave 0.1 wrote it: the same files plus a
    ``checkpoint.stagesave.json`` manifest listing each with its size and chunk digests."""
    import time

    from stagesave.ondisk.checksum import digest
    from stagesave.ondisk.manifest import FileEntry, Manifest

    entries = []
    for name in sorted(os.listdir(folder)):
        data = (folder / name).read_bytes()
        chunks = tuple(digest("xxh3_128", data[lo : lo + 4096]) for lo in range(0, len(data), 4096))
        kind = "safetensors" if name.endswith(".safetensors") else "torch"
        entries.append(FileEntry(name, len(data), "xxh3_128", 4096, chunks, kind, None, None))
    (folder / "checkpoint.stagesave.json").write_bytes(
        Manifest(entries, time.time_ns(), metadata=metadata).to_json()
    )


def test_a_folder_of_the_previous_format_still_verifies_and_loads(tmp_path):
    """Folders with a checkpoint.stagesave.json manifest (format 1): proven by it, the adapter's
    metadata read from it (here the iteration, which the folder's name does not give)."""
    acc = Accelerator(cpu=True)
    run = build(acc)
    train(acc, run, 2)
    before = snapshot(acc, run)
    old = tmp_path / "old"
    acc.save_state(str(old))  # Accelerate's own
    _format1_folder(old, {"accelerate": {"iteration": 7, "step": 0, "num_processes": 1}})
    info = stagesave.verify(old)
    assert (info.status, info.format, info.manifest.metadata["accelerate"]["iteration"]) == (
        "verified",
        1,
        7,
    )
    sa.enable(acc)
    train(acc, run, 2)
    acc.load_state(str(old))
    assert_same(before, snapshot(acc, run))
    assert acc.project_configuration.iteration == 8  # continues after the manifest's iteration
    _flip_byte(old / "optimizer.bin", 200, os.SEEK_SET)
    with pytest.raises(IntegrityError, match=r"old is corrupt: .*optimizer.bin"):
        acc.load_state(str(old))
    sa.disable(acc)


def test_a_file_added_to_a_committed_folder_is_not_a_reason_to_skip_it(tmp_path):
    acc, run, states = _saved(tmp_path, 2)
    newest = tmp_path / "checkpoints" / "checkpoint_1"
    (newest / "notes.txt").write_text("added by hand")
    train(acc, run, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (it used to be skipped as corrupt, with a warning)
        acc.load_state()
    assert_same(states[1], snapshot(acc, run))
    assert acc.project_configuration.iteration == 2
    acc.save_state()  # checkpoint_2: the next one, as Accelerate's own counter says
    acc._stagesave.wait()
    assert (newest / "notes.txt").read_text() == "added by hand"
    assert stagesave.verify(tmp_path / "checkpoints" / "checkpoint_2").status == "verified"

def _storages(tensors):
    return sorted({t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()})


def test_load_state_unpickles_the_optimizer_from_the_bytes_its_choice_verified(tmp_path):
    """Read once: verifying the chosen folder reads optimizer.bin into one buffer (each chunk
    hashed as it lands) and Accelerate's load unpickles it from there, not from the file again:
    the loaded moments' storages lie as far apart as their records in the file. The state is
    equal to what was saved, and nothing stays kept after load_state."""
    from stagesave.restore import kept_images

    acc = _auto(tmp_path)
    run = build(acc, width=256)
    sa.enable(acc)
    train(acc, run, 2)
    before = snapshot(acc, run)
    acc.save_state()
    train(acc, run, 2)
    acc.load_state()
    assert_same(before, snapshot(acc, run))
    optimizer_bin = tmp_path / "checkpoints" / "checkpoint_0" / "optimizer.bin"
    info = stagesave.Checkpointer().verify(str(optimizer_bin))
    assert info.manifest is not None
    offsets = sorted(r.offset for r in info.manifest.files[0].storages if r.nbytes)
    state = run["opts"][0].optimizer.state
    ptrs = _storages(t for s in state.values() for t in s.values() if torch.is_tensor(t))
    assert len(ptrs) == len(offsets) > 2
    assert [p - ptrs[0] for p in ptrs] == [o - offsets[0] for o in offsets]
    assert kept_images._scopes == []


def test_load_state_takes_the_model_weights_from_the_bytes_its_choice_verified(
        tmp_path, monkeypatch):
    """model.safetensors too: verifying the chosen folder reads it into one buffer and
    safetensors' own reader is not asked for it (its load_model runs as it is, its load_file
    answered from those bytes); the models are equal to what was saved. A model file changed
    after the save is refused before anything is loaded; after load_state nothing stays kept,
    and safetensors' load_file outside load_state is its own."""
    import safetensors.torch
    from stagesave.accelerate import _trust

    from stagesave.restore import kept_images

    acc = _auto(tmp_path)
    run = build(acc, n_models=2, width=256)
    sa.enable(acc)
    train(acc, run, 2)
    before = snapshot(acc, run)
    acc.save_state()
    train(acc, run, 2)
    own: list[str] = []
    _trust._install()  # what the first load_state does
    real = _trust._originals["load_file"]

    def spy(filename, *args, **kwargs):
        own.append(os.path.basename(filename))
        return real(filename, *args, **kwargs)

    monkeypatch.setitem(_trust._originals, "load_file", spy)
    acc.load_state()
    assert_same(before, snapshot(acc, run))
    assert own == [], own  # neither model.safetensors nor model_1.safetensors read again
    assert kept_images._scopes == []
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    assert sorted(p.name for p in folder.glob("*.safetensors")) == [
        "model.safetensors", "model_1.safetensors"]
    loaded = safetensors.torch.load_file(folder / "model.safetensors")  # safetensors' own
    assert own == ["model.safetensors"]  # tied weights are saved once: a subset of the keys
    assert set(loaded) <= set(run["models"][0].state_dict()) and loaded
    with open(folder / "model.safetensors", "r+b") as f:  # a flipped byte of the weights
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        acc.load_state(str(folder))


def test_a_folder_where_accelerate_would_read_a_file_of_the_users_is_skipped(tmp_path):
    """save_state(safe_serialization=False), then save_model() beside it: Accelerate's
    load_state prefers the user's model.safetensors to the checkpoint's pytorch_model.bin, so
    the folder cannot restore what was saved: a resume passes over it, a named load refuses it,
    both before anything is restored."""
    acc, run, states = _saved(tmp_path, 2, safe_serialization=False)
    newest = tmp_path / "checkpoints" / "checkpoint_1"
    acc.save_model(run["models"][0], str(newest))  # model.safetensors, beside the checkpoint
    assert stagesave.verify(newest).beside == ["model.safetensors"]
    train(acc, run, 1)
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*checkpoint_1: cannot be loaded "
                                         r"by Accelerate's load_state: it would read "
                                         r"model\.safetensors, which the checkpoint's proof"):
        acc.load_state()
    assert_same(states[0], snapshot(acc, run))
    train(acc, run, 1)
    moved = snapshot(acc, run)
    with pytest.raises(IntegrityError, match=r"checkpoint_1 cannot be loaded by Accelerate's "
                                             r"load_state: it would read model\.safetensors"
                                             r".*It was not loaded"):
        acc.load_state(str(newest))
    assert_same(moved, snapshot(acc, run))
