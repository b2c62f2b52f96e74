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
from stagesave.errors import CheckpointError
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
        with pytest.warns(UserWarning, match=r"replaced files of the same names that were not "
                                             r"part of a checkpoint \(files of yours, or links\): "
                                             r"model\.safetensors$"):
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


def test_a_link_of_the_users_where_the_checkpoint_has_a_subfolder_is_never_followed(tmp_path):
    """The checkpoint writes ``tokenizer/vocab.txt``; the user's folder holds ``tokenizer`` as a
    link to a shared folder: the link is replaced (with a warning), the shared folder untouched,
    by this save and by the next, which no longer writes it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "vocab.txt").write_text("the user's shared vocabulary")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "tokenizer").symlink_to(shared)
    (folder / "notes.txt").write_text("mine")
    files = {"optimizer.bin": {"step": 1}, "tokenizer/vocab.txt": Raw(b"the checkpoint's")}
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        with pytest.warns(UserWarning, match=r"replaced files of the same names .*: tokenizer$"):
            ck.save_dir(files, folder).result()
        assert _tree(shared) == {"vocab.txt": b"the user's shared vocabulary"}
        assert not (folder / "tokenizer").is_symlink()
        assert (folder / "tokenizer" / "vocab.txt").read_bytes() == b"the checkpoint's"
        assert ck.verify(folder).status == "verified"
        ck.save_dir({"optimizer.bin": {"step": 2}}, folder).result()
        assert _tree(shared) == {"vocab.txt": b"the user's shared vocabulary"}
        assert sorted(os.listdir(folder)) == ["notes.txt", "optimizer.bin"]


def test_a_file_the_user_wrote_over_one_of_the_checkpoint_is_the_users(tmp_path):
    folder = tmp_path / "ck"
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.save_dir(_files(1), folder).result()
        (folder / "model.safetensors").write_bytes(b"the user's own model")  # save_model, say
        (folder / "config.json").write_bytes(b"{}")  # another size than the proof lists
        files = _files(2)
        del files["model.safetensors"], files["config.json"]
        ck.save_dir(files, folder).result()  # removes only what is still the checkpoint's
        assert (folder / "model.safetensors").read_bytes() == b"the user's own model"
        assert (folder / "config.json").read_bytes() == b"{}"
        info = ck.verify(folder)
        assert (info.status, info.beside) == ("verified", ["config.json", "model.safetensors"])


@pytest.mark.parametrize("where", ["folder", "working-directory"])
def test_retention_removes_only_the_checkpoints_files_from_a_folder_of_the_users(
    tmp_path, monkeypatch, where
):
    first = tmp_path / "first"
    first.mkdir()
    (first / "train.py").write_text("print('hello')")
    if where == "working-directory":
        monkeypatch.chdir(first)
    with stagesave.Checkpointer(tmp_path, keep_last=1, writer="thread") as ck:
        ck.save_dir(_files(1), first).result()
        ck.save_dir(_files(2), tmp_path / "second").result()  # first's checkpoint retired
        assert [c.name for c in ck.list()] == ["second"]
    assert _tree(first) == {"train.py": b"print('hello')"}
    assert os.path.samefile(os.getcwd(), first if where == "working-directory" else os.getcwd())


def test_a_folder_made_and_written_into_just_before_the_publishing_rename(tmp_path, monkeypatch):
    """The user makes the folder and writes into it between the save's look (nothing there) and
    its rename (which then cannot replace a folder that is not empty): published into it."""
    from stagesave.stores import posix

    folder = tmp_path / "ck"
    real_rename = posix.rename

    def rename(src: str, dst: str) -> None:
        if dst == str(folder) and not folder.exists():
            folder.mkdir()
            (folder / "tokenizer.json").write_text("{}")
        real_rename(src, dst)

    monkeypatch.setattr(posix, "rename", rename)  # the race, made certain
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.save_dir(_files(1), folder).result()
        info = ck.verify(folder)
        assert (info.status, info.beside) == ("verified", ["tokenizer.json"])
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_link_at_the_folders_name_is_replaced_and_leaves_nothing_behind(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "notes.txt").write_text("behind the link")
    (tmp_path / "out").symlink_to(real)
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.save_dir(_files(1), "out").result()
        assert ck.verify(tmp_path / "out").status == "verified"
    assert not (tmp_path / "out").is_symlink()
    assert _tree(real) == {"notes.txt": b"behind the link"}
    assert sorted(os.listdir(tmp_path)) == ["out", "real"]  # (the swapped-out link stayed)


def test_removing_a_folder_without_a_checkpoint_removes_it_whole(tmp_path):
    """Only a stagesave checkpoint's folder is told apart from the user's files in it: a plain
    folder (Lightning's own sharded checkpoint, say) is removed as asked, whole."""
    plain = tmp_path / "plain"
    (plain / "sub").mkdir(parents=True)
    (plain / "meta.pt").write_bytes(b"x")
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.remove(plain).result()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_folder_with_a_nested_checkpoint_saved_again_among_the_users_files(tmp_path):
    """``nested`` parts are moved in by the caller after the commit (not in the staged folder):
    the old part goes, as with a swap, and the new one makes the folder whole again."""
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.save_dir({"a.bin": {"v": 1}}, "outer", nested=["part"]).result()
        ck.save_dir({"p.bin": {"v": 1}}, "outer/part").result()
        (tmp_path / "outer" / "notes.txt").write_text("mine")
        ck.save_dir({"a.bin": {"v": 2}}, "outer", nested=["part"]).result()
        assert sorted(os.listdir(tmp_path / "outer")) == ["a.bin", "notes.txt"]
        ck.save_dir({"p.bin": {"v": 2}}, "outer/part").result()
        info = ck.verify(tmp_path / "outer")
        assert (info.status, info.beside) == ("verified", ["notes.txt"])
        assert ck.load(tmp_path / "outer" / "part" / "p.bin")["v"] == 2
    assert sorted(os.listdir(tmp_path)) == ["outer"]


def test_an_assembled_folder_is_published_into_a_folder_the_user_made_meanwhile(tmp_path):
    """Accelerate's FSDP save (a folder assembled from parts, :mod:`stagesave.saving.assemble`):
    the user writes a tokenizer into the target while it is in flight: published into it. A
    stagesave checkpoint that appeared there meanwhile is still not replaced."""
    from stagesave.errors import StorageError
    from stagesave.saving.assemble import Assembly, create_work_folder, folder_in, publish

    def assembled(target, files) -> Assembly:
        work = create_work_folder(str(target))
        handle = ck.save_dir(files, folder_in(work, target.name))
        handle.result()
        return Assembly(work, folder_in(work, target.name), [], [handle], str(target), False,
                        1, 5.0, what="FSDP checkpoint")

    target = tmp_path / "step_2"
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        a = assembled(target, {"scheduler.bin": {"s": 1}})
        target.mkdir()
        (target / "tokenizer.json").write_text("{}")
        publish(a, lambda: None)
        info = ck.verify(target)
        assert (info.status, info.beside) == ("verified", ["tokenizer.json"])
        other = tmp_path / "step_3"
        a = assembled(other, {"scheduler.bin": {"s": 2}})
        ck.save_dir({"scheduler.bin": {"s": 3}}, other).result()  # another save got there first
        with pytest.raises(StorageError, match=r"step_3 appeared while its FSDP checkpoint"):
            publish(a, lambda: None)
        assert ck.load(other / "scheduler.bin")["s"] == 3
    assert sorted(os.listdir(tmp_path)) == ["step_2", "step_3"]


def test_a_folder_checkpoint_never_replaces_a_file_of_that_name(tmp_path):
    """Refused at ``save_dir`` (as Accelerate's own ``save_state`` cannot make the folder); the
    user's file is untouched and nothing is left beside it."""
    (tmp_path / "ck").write_bytes(b"the user's file")
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck, pytest.raises(
        CheckpointError, match=r"cannot write folder checkpoint .*/ck: a file of that name "
        r"exists \(a folder checkpoint never replaces a file"
    ):
        ck.save_dir(_files(1), "ck")
    assert (tmp_path / "ck").read_bytes() == b"the user's file"
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_file_made_at_the_folders_name_before_its_commit_is_kept(tmp_path):
    """The file appears after ``save_dir`` checked: the commit fails and says why; the file is
    the user's, untouched, and the save leaves nothing behind (it was never said to be saved)."""
    gate = threading.Event()
    with stagesave.Checkpointer(tmp_path, writer="thread") as ck:
        ck.run_after(lambda: gate.wait(60), description="gate")  # the save cannot commit yet
        handle = ck.save_dir(_files(1), "ck")
        (tmp_path / "ck").write_bytes(b"the user's file")
        gate.set()
        with pytest.raises(CheckpointError, match=r"cannot commit folder checkpoint .*/ck: a "
                           r"file of that name exists"):
            handle.result()
        assert ck.latest() is None
    assert (tmp_path / "ck").read_bytes() == b"the user's file"
    assert sorted(os.listdir(tmp_path)) == ["ck"]
