"""Files in a checkpoint folder that are not part of the checkpoint (a tokenizer, logs, a model
saved beside it): kept by every save into the folder, also when written while the save is in
flight, never read as part of the checkpoint, and never a reason to refuse the checkpoint."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import stagesave
from stagesave.formats import Raw, Safetensors
from stagesave.saving import beside


def _tree(root) -> dict[str, bytes | str]:
    """Every file (bytes), link (target) and empty folder ("") under ``root``."""
    out: dict[str, bytes | str] = {}
    for d, dirs, names in os.walk(root):
        for n in names + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            out[rel] = os.readlink(p) if os.path.islink(p) else Path(p).read_bytes()
        if not dirs and not names and d != str(root):
            out[os.path.relpath(d, root)] = ""
    return out


def _users_files(folder, elsewhere):
    (folder / "logs").mkdir(parents=True)
    (folder / "empty").mkdir()
    (folder / "notes.txt").write_text("lr: 0.1\n")
    (folder / "logs" / "events.out").write_bytes(b"\x00\x01tensorboard")
    elsewhere.mkdir()
    (folder / "data").symlink_to(elsewhere)


def _files(step: int) -> dict:
    return {
        "model.safetensors": Safetensors({"w": torch.full((64,), float(step))}),
        "optimizer.bin": {"step": step, "m": torch.arange(10.0) * step},
        "config.json": Raw(b'{"step": %d}' % step),
    }


def test_a_save_into_a_folder_of_the_users_files_keeps_them_all(tmp_path):
    folder = tmp_path / "run"
    _users_files(folder, tmp_path / "elsewhere")
    users = _tree(folder)
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.save_dir(_files(1), folder).result()
        info = ck.verify(folder)
        assert info.status == "verified", info.problems
        assert info.beside == ["logs/events.out", "notes.txt"]  # files (links, folders: kept too)
        assert {k: v for k, v in _tree(folder).items() if k in users} == users
        # saved again, with a file fewer: the earlier checkpoint's files go, the user's stay
        files = _files(2)
        del files["config.json"]
        ck.save_dir(files, folder).result()
        assert _tree(folder) == {
            **users,
            "model.safetensors": (folder / "model.safetensors").read_bytes(),
            "optimizer.bin": (folder / "optimizer.bin").read_bytes(),
        }
        assert ck.verify(folder).status == "verified"
        assert ck.load(folder / "optimizer.bin")["step"] == 2
        best = ck.latest(verify=True)
        assert (best.name, best.beside) == ("run", ["logs/events.out", "notes.txt"])
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "run"]  # no temporary beside it


def test_a_file_written_into_the_folder_while_its_save_is_in_flight_is_kept(tmp_path):
    folder = tmp_path / "ck"
    gate = threading.Event()
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.run_after(lambda: gate.wait(60), description="gate")  # the save cannot commit yet
        handle = ck.save_dir(_files(1), folder)
        folder.mkdir()  # the user saves a tokenizer beside the checkpoint right away
        (folder / "tokenizer.json").write_text('{"vocab": 4}')
        (folder / "model.safetensors").write_bytes(b"the user's model, same name")
        gate.set()
        with pytest.warns(UserWarning, match=r"replaced files of the same names that were "
                                             r"written there while it was being saved: "
                                             r"model\.safetensors"):
            handle.result()
        assert (folder / "tokenizer.json").read_text() == '{"vocab": 4}'
        info = ck.verify(folder)
        assert (info.status, info.beside) == ("verified", ["tokenizer.json"])


def test_saving_into_the_working_directory_leaves_the_process_in_it(tmp_path, monkeypatch):
    folder = tmp_path / "ck"
    folder.mkdir()
    monkeypatch.chdir(folder)
    with stagesave.Checkpointer(writer="thread") as ck:
        ck.save_dir(_files(1), ".").result()
        ck.save_dir(_files(2), ".").result()  # (a swap would move the working directory away)
        assert os.getcwd() == str(folder) and os.path.samefile(".", folder)
        assert ck.load("optimizer.bin")["step"] == 2
        assert sorted(os.listdir(".")) == ["config.json", "model.safetensors", "optimizer.bin"]
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_folder_holding_only_its_checkpoint_is_swapped_and_keeps_late_arrivals(tmp_path):
    """Without the user's files the folder is swapped whole; a file that appears in the old
    folder between the look and the swap is moved into the new one."""
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "sub").mkdir(parents=True)
    (old / "optimizer.bin").write_bytes(b"the old checkpoint's")
    (old / "late.txt").write_text("written during the swap")
    (old / "sub" / "late.log").write_text("also")
    new.mkdir()
    (new / "optimizer.bin").write_bytes(b"the new checkpoint's")
    beside.keep_arrivals(str(old), str(new), beside.Occupant(frozenset({"optimizer.bin"})))
    assert _tree(new) == {"optimizer.bin": b"the new checkpoint's",
                          "late.txt": b"written during the swap", "sub/late.log": b"also"}
    assert _tree(old) == {"optimizer.bin": b"the old checkpoint's", "sub": ""}  # then removed


def test_a_file_added_to_a_committed_folder_is_kept_and_never_read(tmp_path):
    folder = tmp_path / "ck"
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.save_dir(_files(1), folder).result()
        (folder / "README.md").write_text("notes")
        info = ck.verify(folder)
        assert (info.status, info.beside) == ("verified", ["README.md"])
        assert [c.name for c in ck.list()] == ["ck"]
        # a proven file changed is still refused; the extra file never makes it valid
        (folder / "config.json").write_bytes(b'{"step": 9}')
        info = ck.verify(folder)
        assert info.status == "corrupt" and any("config.json" in p for p in info.problems)
