"""``save_state(output_dir)`` into a folder that holds the user's files, as Accelerate's own
writes its files among them: the user's files are kept (also those written beside a save still
in flight), never read as part of the checkpoint, and never make it invalid. A folder holding
only an earlier stagesave checkpoint, or nothing, is replaced whole as before."""

from __future__ import annotations

import os

import pytest
import stagesave.accelerate as sa
import torch
from accel_helpers import assert_same, build, snapshot, train
from accelerate import Accelerator

import stagesave
from stagesave.errors import IntegrityError


def _tree(root) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


def _enabled():
    acc = Accelerator(cpu=True)
    run = build(acc)
    sa.enable(acc)
    train(acc, run, 2)
    return acc, run


def test_a_folder_holding_the_users_files_is_saved_into_and_keeps_them(tmp_path):
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "config.yaml").write_text("lr: 0.1\n")
    (out / "logs" / "events.out").write_bytes(b"\x00\x01tensorboard")
    (tmp_path / "data").mkdir()
    (out / "data").symlink_to(tmp_path / "data")
    before = _tree(out)
    acc, run = _enabled()
    state = snapshot(acc, run)
    acc.save_state(str(out))  # (stagesave used to replace the folder: both files gone)
    train(acc, run, 1)
    acc._stagesave.wait()
    assert {k: v for k, v in _tree(out).items() if k in before} == before
    assert os.path.islink(out / "data")
    info = stagesave.verify(out)
    assert (info.status, info.beside) == ("verified", ["config.yaml", "logs/events.out"])
    acc.load_state(str(out))
    assert_same(state, snapshot(acc, run))
    assert sorted(os.listdir(tmp_path)) == ["data", "run"]  # no temporary beside it
    acc.end_training()


def test_files_saved_beside_a_checkpoint_in_flight_are_kept(tmp_path):
    """The Hugging Face pattern: save_state(dir) in the loop, then a tokenizer and save_model
    into the same folder at once, while the checkpoint is still being written."""
    from test_lifecycle import _hold_writer

    out = tmp_path / "step_2"
    acc, run = _enabled()
    state = snapshot(acc, run)
    gate = _hold_writer(acc._stagesave, "plain")
    acc.save_state(str(out))
    out.mkdir(exist_ok=True)
    (out / "tokenizer_config.json").write_text('{"vocab_size": 4}')
    acc.save_model(run["models"][0], str(out), safe_serialization=False)  # pytorch_model.bin
    model_file = (out / "pytorch_model.bin").read_bytes()
    gate.set()
    acc._stagesave.wait()
    assert (out / "tokenizer_config.json").read_text() == '{"vocab_size": 4}'
    assert (out / "pytorch_model.bin").read_bytes() == model_file
    info = stagesave.verify(out)
    assert (info.status, info.beside) == ("verified", ["pytorch_model.bin",
                                                       "tokenizer_config.json"])
    train(acc, run, 1)
    acc.load_state(str(out))  # the files beside it are not read
    assert_same(state, snapshot(acc, run))
    acc.end_training()


def test_a_file_added_to_an_earlier_checkpoint_is_kept_by_the_next_save(tmp_path):
    out = tmp_path / "ck"
    acc, run = _enabled()
    acc.save_state(str(out))
    acc._stagesave.wait()
    (out / "README.md").write_text("notes")
    acc.load_state(str(out))  # a committed folder with a file beside it still loads
    train(acc, run, 1)
    state = snapshot(acc, run)
    acc.save_state(str(out))
    acc._stagesave.wait()
    assert (out / "README.md").read_text() == "notes"
    assert stagesave.verify(out).beside == ["README.md"]
    train(acc, run, 1)
    acc.load_state(str(out))
    assert_same(state, snapshot(acc, run))
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


def test_a_file_beside_that_accelerate_would_read_is_refused_before_anything_loads(tmp_path):
    """Accelerate counts every custom_checkpoint_<n>.pkl in the folder (and raises after
    restoring the rest when they outnumber the registered objects): one beside the checkpoint
    is refused up front. A scaler.pt beside it, with no GradScaler to restore, is not read."""
    out = tmp_path / "run"
    acc, run = _enabled()
    saved = snapshot(acc, run)
    acc.save_state(str(out))
    acc._stagesave.wait()
    torch.save({}, out / "scaler.pt")  # the user's; this Accelerator has no scaler
    train(acc, run, 1)
    acc.load_state(str(out))
    assert_same(saved, snapshot(acc, run))
    train(acc, run, 1)
    state = snapshot(acc, run)
    torch.save({"n": 1}, out / "custom_checkpoint_7.pkl")
    with pytest.raises(IntegrityError, match=r"run cannot be loaded by Accelerate's load_state: "
                                             r"it would read custom_checkpoint_7\.pkl"):
        acc.load_state(str(out))
    assert_same(state, snapshot(acc, run))  # nothing was restored
    acc.end_training()
