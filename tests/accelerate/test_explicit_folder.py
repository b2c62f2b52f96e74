"""``save_state(output_dir)`` into a folder that already holds the user's files: stagesave commits
a checkpoint folder whole (one rename replacing what was there), so such a folder is refused
before anything is written, with the files named; nothing of the user's is deleted. A folder
holding only an earlier stagesave checkpoint, or nothing, is saved into as before."""

from __future__ import annotations

import os

import pytest
import stagesave.accelerate as sa
from accel_helpers import assert_same, build, snapshot, train
from accelerate import Accelerator

import stagesave


def _tree(root) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


def _enabled():
    acc = Accelerator(cpu=True)
    run = build(acc)
    sa.enable(acc)
    train(acc, run, 2)
    return acc, run


def test_a_folder_holding_the_users_files_is_refused_and_left_as_it_was(tmp_path):
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "config.yaml").write_text("lr: 0.1\n")
    (out / "logs" / "events.out").write_bytes(b"\x00\x01tensorboard")
    before = _tree(out)
    acc, _ = _enabled()
    with pytest.raises(ValueError, match=r"already holds files that are not part of a stagesave "
                       r"checkpoint \(config\.yaml, logs/events\.out\).*Nothing was written"):
        acc.save_state(str(out))
    acc._stagesave.wait()
    assert _tree(out) == before  # (stagesave used to replace the folder: both files gone)
    # a link to a folder elsewhere, and an empty folder, are the user's too
    (out / "config.yaml").unlink()
    (out / "logs" / "events.out").unlink()
    (tmp_path / "data").mkdir()
    (out / "data").symlink_to(tmp_path / "data")
    with pytest.raises(ValueError, match=r"\(data/, logs/\)"):
        acc.save_state(str(out))
    assert sorted(os.listdir(out)) == ["data", "logs"] and os.path.islink(out / "data")
    assert sorted(os.listdir(tmp_path)) == ["data", "run"]  # no temporary beside it
    acc.end_training()


def test_a_file_added_to_an_earlier_stagesave_checkpoint_is_refused(tmp_path):
    out = tmp_path / "ck"
    acc, _ = _enabled()
    acc.save_state(str(out))
    acc._stagesave.wait()
    (out / "README.md").write_text("notes")
    before = _tree(out)
    with pytest.raises(ValueError, match=r"\(README\.md\)"):
        acc.save_state(str(out))
    assert _tree(out) == before
    acc.end_training()


def test_a_folder_holding_only_an_earlier_checkpoint_or_nothing_is_saved_into(tmp_path):
    out = tmp_path / "ck"
    empty = tmp_path / "empty"
    empty.mkdir()
    acc, run = _enabled()
    acc.save_state(str(out))
    train(acc, run, 2)
    state = snapshot(acc, run)
    acc.save_state(str(out))  # the earlier checkpoint is replaced whole
    acc.save_state(str(empty))
    acc._stagesave.wait()
    for folder in (out, empty):
        assert stagesave.verify(folder).status == "verified"
    train(acc, run, 2)
    acc.load_state(str(out))
    assert_same(state, snapshot(acc, run))
    acc.end_training()


def test_a_folder_holding_a_checkpoint_of_the_previous_format_is_saved_into(tmp_path):
    from test_resume import _format1_folder

    acc, run = _enabled()
    old = tmp_path / "old"
    sa.disable(acc)
    acc.save_state(str(old))  # Accelerate's own files, then stagesave 0.1's manifest beside them
    _format1_folder(old, {"accelerate": {"iteration": 0, "step": 0, "num_processes": 1}})
    assert stagesave.verify(old).format == 1
    sa.enable(acc)
    state = snapshot(acc, run)
    acc.save_state(str(old))  # replaced whole by a format-2 checkpoint
    acc._stagesave.wait()
    info = stagesave.verify(old)
    assert (info.status, info.format) == ("verified", 2)
    assert "checkpoint.stagesave.json" not in os.listdir(old)
    train(acc, run, 1)
    acc.load_state(str(old))
    assert_same(state, snapshot(acc, run))
    acc.end_training()
