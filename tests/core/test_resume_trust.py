"""A resume picks a checkpoint it can load; reads never write; links either work or are refused.

Real files throughout: bytes flipped on disk, garbage files, a read-only filesystem (a tmpfs
remounted read-only, as in test_bad_input.py) and an unprivileged user, real symbolic links.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile

import pytest
import torch

import stagesave
import stagesave.restore.proof as proof_mod
import stagesave.restore.resolve_folder as folders_mod
import stagesave.restore.verified_memo as memo_mod
import stagesave.restore.verify as verify_mod
from stagesave.errors import CheckpointError, CheckpointPermissionError, IntegrityError
from stagesave.ondisk.names import aside_name


def _flip_tensor_byte(path) -> None:
    """Flip one byte inside the first tensor's bytes of a stagesave file (its proof intact)."""
    info = stagesave.verify(path)
    offset = info.manifest.files[0].storages[0].offset + 5
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _dead_pid() -> int:
    """The pid of a process that has exited (what a crash leaves in an aside folder's name)."""
    r = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(r.stdout)


def _crash_between_renames(root, folder: str) -> str:
    """The state a crash between the two renames of a folder replacement leaves: the committed
    folder under its aside name, nothing under its final name. Returns the aside name."""
    aside = aside_name(folder, f"{_dead_pid()}-0123abcd")
    os.rename(os.path.join(root, folder), os.path.join(root, aside))
    return aside


def _mount_tmpfs(path, options):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({r.stderr.strip()}); needs root in a sandbox that allows "
            "mounts"
        )


# ---------------------------------------------------------------------------- resume selection
def test_latest_skips_a_newest_checkpoint_with_flipped_bytes_and_resume_loads_the_previous(
    ckpt_dir,
):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"step": 1, "w": torch.full((1000,), 1.0)}, "step-1.ckpt").result()
        ck.save({"step": 2, "w": torch.full((1000,), 2.0)}, "step-2.ckpt").result()
    _flip_tensor_byte(ckpt_dir / "step-2.ckpt")
    for latest in (
        lambda: stagesave.latest(ckpt_dir),
        lambda: stagesave.Checkpointer(ckpt_dir).latest(),
    ):
        with pytest.warns(
            UserWarning, match=r"skipping checkpoint .*step-2\.ckpt: .*checksum mismatch"
        ):
            info = latest()
        assert info is not None and info.name == "step-1.ckpt" and info.status == "verified"
        assert stagesave.load(info.path)["step"] == 1  # the README's resume: load(latest(dir))
    # The explicit cheap choice reads proofs only: it still offers the damaged one, and its load
    # is what refuses it.
    info = stagesave.latest(ckpt_dir, verify=False)
    assert info is not None and info.name == "step-2.ckpt"
    with pytest.raises(IntegrityError):
        stagesave.load(info.path)


@pytest.mark.parametrize("verify", [True, False])
def test_a_file_without_a_proof_that_is_not_a_torch_file_is_never_chosen(ckpt_dir, verify):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"step": 1}, "step-1.ckpt").result()
    # plain files order below format 2
    (ckpt_dir / "zz-garbage.ckpt").write_bytes(b"garbage " * 100)
    with zipfile.ZipFile(ckpt_dir / "notes.pt", "w") as z:  # a zip, but no torch archive
        z.writestr("readme.txt", "not a checkpoint")
    (ckpt_dir / "trunc.pth").write_bytes(b"PK\x03\x04" + b"\0" * 200)  # a torn zip
    os.remove(ckpt_dir / "step-1.ckpt")  # nothing with a proof left: only the plain files
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert stagesave.latest(ckpt_dir, verify=verify) is None
    said = " ".join(str(w.message) for w in caught)
    for name in ("zz-garbage.ckpt", "notes.pt", "trunc.pth"):
        assert f"skipping checkpoint {ckpt_dir / name}" in said, said


def test_a_plain_torch_file_is_offered_unverified_below_any_proven_one_and_a_damaged_one_is_skipped(
    ckpt_dir,
):
    torch.save({"step": 7, "w": torch.arange(4000.0)}, ckpt_dir / "plain-a.pt")
    torch.save({"step": 8, "w": torch.arange(4000.0)}, ckpt_dir / "plain-b.pt")
    os.utime(ckpt_dir / "plain-a.pt", (1, 1))  # plain files order by mtime: b is the newer
    data = bytearray((ckpt_dir / "plain-b.pt").read_bytes())
    at = data.index(b"data/0") + 200  # inside the tensor record's bytes
    data[at] ^= 0xFF
    (ckpt_dir / "plain-b.pt").write_bytes(data)
    # Verifying (the default): its records' CRC-32s are the only proof such a file has: checked.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = stagesave.latest(ckpt_dir)
    assert info is not None and info.status == "unverified"
    assert info.name == "plain-a.pt", [str(w.message) for w in caught]
    assert any("plain-b.pt" in str(w.message) and "CRC-32" in str(w.message) for w in caught)
    assert stagesave.load(info.path)["step"] == 7
    # The cheap choice looks at the structure only.
    info = stagesave.latest(ckpt_dir, verify=False)
    assert info is not None and info.name == "plain-b.pt" and info.status == "unverified"
    # A proven checkpoint, whatever the clock says, is newer than any plain file.
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"step": 1}, "proven.ckpt").result()
    os.utime(ckpt_dir / "proven.ckpt", (1, 1))
    for verify in (True, False):
        assert stagesave.latest(ckpt_dir, verify=verify).name == "proven.ckpt"


def test_the_load_after_a_verifying_latest_hashes_nothing_again_unless_the_file_changed(
    ckpt_dir, monkeypatch
):
    calls = []
    real = proof_mod.chunk_problems  # counts the chunk hashing of the one verifier

    def counted(reader, manifest, pool, read=None):
        calls.append(reader.where)
        return real(reader, manifest, pool, read=read)

    monkeypatch.setattr(proof_mod, "chunk_problems", counted)
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"step": 1, "w": torch.ones(1000)}, "a.ckpt").result()
        ck.save({"step": 2, "w": torch.ones(1000)}, "b.ckpt").result()
        memo_mod.forget_verified()
        info = ck.latest()
        assert info.name == "b.ckpt" and calls == [info.path]
        assert ck.load(info.path)["step"] == 2
        assert calls == [info.path], "the load hashed the file latest() had just verified"
        # Changed in place after the choice: the load checks again and refuses it.
        _flip_tensor_byte(info.path)
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            ck.load(info.path)
        # Replaced by a rename after the choice (a damaged copy with a valid proof): refused too.
        ck.save({"step": 3, "w": torch.ones(1000)}, "c.ckpt").result()
        info = ck.latest()
        assert info.name == "c.ckpt"
        shutil.copy(ckpt_dir / "c.ckpt", ckpt_dir / "copy")
        _flip_tensor_byte(ckpt_dir / "copy")
        os.replace(ckpt_dir / "copy", ckpt_dir / "c.ckpt")
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            ck.load(info.path)
        # An explicit verify() always reads every byte.
        n = len(calls)
        ck.save({"step": 4}, "d.ckpt").result()
        assert ck.latest().name == "d.ckpt"
        assert ck.verify(ckpt_dir / "d.ckpt").status == "verified"
        assert len(calls) == n + 2


# ---------------------------------------------------------------------------- reads never write
def test_reads_never_move_an_aside_folder_back_and_offer_it_the_next_save_does(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save_dir({"model.bin": {"step": 5}}, "checkpoint").result()
    aside = _crash_between_renames(ckpt_dir, "checkpoint")
    before = sorted(os.listdir(ckpt_dir))
    with stagesave.Checkpointer(ckpt_dir) as ck:
        with pytest.warns(UserWarning, match="left aside by a crash"):
            info = ck.latest()
        assert info is not None and info.is_dir and info.status == "verified"
        assert info.path == str(ckpt_dir / aside)
        assert ck.load(os.path.join(info.path, "model.bin"))["step"] == 5
        assert [c.name for c in ck.list()] == [aside]
        assert ck.verify(info.path).status == "verified"
        assert sorted(os.listdir(ckpt_dir)) == before, "a read changed the directory"
        ck.save({"step": 6}, "other.ckpt").result()  # the next write repairs
    assert sorted(os.listdir(ckpt_dir)) == ["checkpoint", "other.ckpt"]
    assert stagesave.load(ckpt_dir / "checkpoint" / "model.bin")["step"] == 5


def test_read_only_root_whose_only_copy_is_an_aside_folder(tmp_path):
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "size=8m")
    try:
        with stagesave.Checkpointer(mnt) as ck:
            ck.save_dir({"model.bin": {"step": 5, "w": torch.ones(100)}}, "checkpoint").result()
        aside = _crash_between_renames(mnt, "checkpoint")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for verify in (True, False):
                info = stagesave.latest(mnt, verify=verify)
                assert info is not None and info.path == str(mnt / aside), info
            assert [c.name for c in stagesave.list_checkpoints(mnt)] == [aside]
            assert stagesave.load(mnt / aside / "model.bin")["step"] == 5
        assert not [
            w for w in caught if "repair" in str(w.message) or "read-only" in str(w.message)
        ]
        # A save there fails at save() time with the family's error, the aside folder untouched.
        with stagesave.Checkpointer(mnt) as ck, pytest.raises(CheckpointPermissionError):
            ck.save({"step": 6}, "new.ckpt")
        assert os.listdir(mnt) == [aside]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_permission_denied_root_whose_only_copy_is_an_aside_folder():
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user (chmod does not stop root)")
    base = tempfile.mkdtemp(prefix="stagesave-eacces-")  # /tmp: traversable by an unprivileged user
    try:
        os.chmod(base, 0o755)
        root = os.path.join(base, "ckpt")
        with stagesave.Checkpointer(root) as ck:
            ck.save_dir({"model.bin": {"step": 5}}, "checkpoint").result()
        aside = _crash_between_renames(root, "checkpoint")
        subprocess.run(["chmod", "-R", "a-w,a+rX", root], check=True)
        code = (
            "import os, sys, warnings, torch, stagesave\n"
            "os.setgid(65534); os.setuid(65534)  # everything imported first: ~root is not "
            "readable\nwarnings.simplefilter('ignore')\n"
            f"info = stagesave.latest({root!r})\n"
            "print(info.name, info.status, stagesave.load(os.path.join(info.path, "
            "'model.bin'))['step'])\n"
            f"print(len(stagesave.list_checkpoints({root!r})))\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HOME": "/tmp"},
            check=False,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [aside, "verified", "5", "1"]
        assert os.listdir(root) == [aside]
    finally:
        subprocess.run(["chmod", "-R", "u+w", base], check=False)
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------- links
def test_links_inside_the_root_work_end_to_end_and_links_out_of_it_are_refused_at_save(tmp_path):
    root = tmp_path / "ckpt"
    (root / "real").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink("real", root / "sub")  # a symlinked sub-directory inside the root
    os.symlink(elsewhere, root / "out")  # a symlinked sub-directory out of it
    with stagesave.Checkpointer(root) as ck:
        ck.save({"step": 1}, "sub/a.ckpt").result()
        ck.save_dir({"model.bin": {"step": 2}}, "sub/folder").result()
        assert ck.load("sub/a.ckpt")["step"] == 1
        assert ck.verify("sub/a.ckpt").status == "verified"
        assert ck.verify("sub/folder").status == "verified"
        assert ck.load("sub/folder/model.bin")["step"] == 2
        assert ck.latest("sub").name == "folder"
        # Out of the root: refused before anything is written, with the family's error.
        for save in (lambda: ck.save({"step": 3}, "out/b.ckpt"),
                     lambda: ck.save_dir({"model.bin": {"step": 3}}, "out/folder")):
            with pytest.raises(CheckpointPermissionError, match="outside the checkpoint root"):
                save()
        assert os.listdir(elsewhere) == []
    # The link's target as the root works end to end.
    with stagesave.Checkpointer(root / "out") as ck:
        ck.save({"step": 4}, "b.ckpt").result()
        assert ck.load("b.ckpt")["step"] == 4
        assert ck.latest().name == "b.ckpt"


def test_reading_through_a_link_out_of_the_root_raises_the_family_error(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    stagesave.save({"step": 1}, tmp_path / "outside.ckpt")
    os.symlink(tmp_path / "outside.ckpt", root / "link.ckpt")
    os.symlink(tmp_path, root / "up")
    with stagesave.Checkpointer(root) as ck:
        for read in (lambda: ck.load("link.ckpt"), lambda: ck.verify("link.ckpt"),
                     lambda: ck.load("up/outside.ckpt"), lambda: ck.verify("up/outside.ckpt")):
            with pytest.raises(CheckpointError, match="out of the checkpoint root"):
                read()
        assert ck.latest() is None  # never followed, never offered


def test_a_folder_replaced_while_latest_verifies_it_is_verified_again_not_skipped(
    ckpt_dir, monkeypatch
):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save_dir(
            {"model.bin": {"step": 1, "w": torch.ones(1000)}, "extra.bin": {"n": 1}}, "checkpoint"
        ).result()
    real = verify_mod.check_file  # fault injection: a replacement between the proof and the bytes
    replaced = []

    def replace_once(reader, manifest, io, reuse):
        if not replaced:  # another writer replaces the folder between its proof and its bytes
            with stagesave.Checkpointer(ckpt_dir) as other:
                other.save_dir(
                    {
                        "model.bin": {"step": 2, "w": torch.full((1000,), 2.0)},
                        "extra.bin": {"n": 2},
                    },
                    "checkpoint",
                ).result()
            replaced.append(True)
        return real(reader, manifest, io, reuse)

    monkeypatch.setattr(verify_mod, "check_file", replace_once)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a replacement is never reported as damage
        info = stagesave.latest(ckpt_dir)
    assert replaced and info is not None and info.name == "checkpoint" and info.status == "verified"
    assert stagesave.load(ckpt_dir / "checkpoint" / "model.bin")["step"] == 2


_REPLACE_FOLDER = """
import sys, warnings
warnings.simplefilter("ignore")
import torch, stagesave
step = int(sys.argv[2])
with stagesave.Checkpointer(sys.argv[1]) as ck:
    ck.save_dir({"model.bin": {"step": step, "w": torch.full((3000,), float(step))},
                 "extra.bin": {"n": step}},
                "checkpoint").result()
"""


def test_a_folder_listed_just_before_a_replacement_and_proved_just_after_is_verified_again(
    ckpt_dir, monkeypatch
):
    """The listing of a folder's files and the proof they are judged against come from two
    saves when another process replaces the folder between the two reads (sizes then disagree
    with the proof): the folder is judged again, never reported as damaged or skipped."""
    def state(step: int) -> dict:
        return {
            "model.bin": {"step": step, "w": torch.full((1000,), float(step))},
            "extra.bin": {"n": step},
        }

    # (the other process saves 3000 floats: every file of the folder changes size)

    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save_dir(state(1), "checkpoint").result()
    real_list_tree = folders_mod.list_tree
    armed: list[int] = []

    def list_then_replace(store, directory, *args, **kwargs):
        listing = real_list_tree(store, directory, *args, **kwargs)
        if armed and armed[-1] > 0 and directory.endswith("checkpoint"):
            armed[-1] -= 1  # another process replaces the folder right after this listing
            step = 10 ** 12 + len(armed)  # other sizes than step 1
            subprocess.run(
                [sys.executable, "-c", _REPLACE_FOLDER, str(ckpt_dir), str(step)], check=True
            )
        return listing

    monkeypatch.setattr(folders_mod, "list_tree", list_then_replace)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a replacement is never reported as damage
        armed.append(1)
        checked = stagesave.verify(ckpt_dir / "checkpoint")
        assert armed == [0] and checked.status == "verified", checked.problems
        assert (
            checked.manifest.metadata == stagesave.verify(ckpt_dir / "checkpoint").manifest.metadata
        )
        armed.append(1)
        info = stagesave.latest(ckpt_dir)
    assert (
        armed == [0, 0]
        and info is not None
        and info.name == "checkpoint"
        and info.status == "verified"
    )
    assert stagesave.load(ckpt_dir / "checkpoint" / "model.bin")["step"] == 10 ** 12 + 2


# ---------------------------------------------------------------------------- resume_from (a
# caller's "newest")
def test_resume_from_keeps_an_intact_choice_and_replaces_a_damaged_one_by_the_newest_intact(
    ckpt_dir,
):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        for step in range(3):
            ck.save({"w": torch.full((64,), float(step))}, f"step={step}.ckpt")
        ck.save({"w": torch.full((64,), 9.0)}, "last.ckpt")
    last = os.path.join(ckpt_dir, "last.ckpt")
    with stagesave.Checkpointer(ckpt_dir) as ck:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ck.resume_from(last) == last
        _flip_tensor_byte(last)
        with pytest.warns(UserWarning) as record:
            chosen = ck.resume_from(last)
        assert chosen == os.path.join(ckpt_dir, "step=2.ckpt")
        messages = [str(w.message) for w in record]
        assert any(
            m.startswith(f"skipping checkpoint {last}: ") and "checksum mismatch" in m
            for m in messages
        )
        assert any(m.startswith(f"resuming from {chosen} instead of {last}") for m in messages)
        assert torch.equal(ck.load(chosen)["w"], torch.full((64,), 2.0))
        # Without verification the flipped byte goes unseen (only the proof is read), as in
        # latest().
        assert ck.resume_from(last, verify=False) == last


def test_resume_from_with_nothing_loadable_is_none_and_a_missing_choice_falls_back(ckpt_dir):
    with stagesave.Checkpointer(ckpt_dir) as ck:
        ck.save({"w": torch.ones(64)}, "last.ckpt")
        last = os.path.join(ckpt_dir, "last.ckpt")
        _flip_tensor_byte(last)
        with pytest.warns(UserWarning, match="skipping checkpoint"):
            assert ck.resume_from(last) is None
        ck.save({"w": torch.zeros(64)}, "a.ckpt")
        with pytest.warns(UserWarning, match=r"gone\.ckpt: it does not exist"):
            assert ck.resume_from(os.path.join(ckpt_dir, "gone.ckpt")) == os.path.join(
                ckpt_dir, "a.ckpt"
            )
