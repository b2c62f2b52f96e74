"""Power loss after every operation of a save, simulated by replaying the recorded operations.

Each scenario runs real saves on a real directory with every mutating call of the local store
recorded (``faultfs.Recorder``). Then, for every operation index k of the log, the tree that a
power loss right after operation k would leave is materialized into a fresh directory under
three views of what survives (``faultfs.MODES``) and invariant I is checked there.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import shutil
from dataclasses import dataclass

import faultstats
import pytest
from faultfs import PowerLossModel, Recorder, fsync_dir_after, rename_to
from faulthelp import dir_state, file_state
from invariant import Version, check_invariant, read_version_files

import stagesave

pytestmark = pytest.mark.usefixtures("thread_writer")  # faults injected in this process

CHUNK = 8192


@dataclass(frozen=True)
class Scenario:
    name: str
    recorded: tuple[str, ...]
    baseline: tuple[str, ...] = ()
    is_dir: bool = False
    keep_last: int | None = None
    subdir: str = ""  # the checkpoint root, relative to the modelled tree
    no_exchange: bool = False  # the filesystem cannot swap two folders: two renames instead


SCENARIOS = [
    Scenario("file-first-save", ("last.ckpt",)),
    Scenario("file-overwrite-last", ("last.ckpt",), baseline=("last.ckpt",)),
    Scenario("file-keep-last", ("step3.ckpt",), baseline=("step1.ckpt", "step2.ckpt"), keep_last=2),
    Scenario("dir-first-save", ("checkpoint_1",), is_dir=True),
    Scenario("dir-overwrite", ("checkpoint",), baseline=("checkpoint",), is_dir=True),
    Scenario(
        "dir-overwrite-by-renames",
        ("checkpoint",),
        baseline=("checkpoint",),
        is_dir=True,
        no_exchange=True,
    ),
    Scenario(
        "dir-keep-last",
        ("checkpoint_3",),
        baseline=("checkpoint_1", "checkpoint_2"),
        is_dir=True,
        keep_last=2,
    ),
]
SLOW_SCENARIOS = [
    Scenario("file-sequence", ("s1.ckpt", "s2.ckpt", "s3.ckpt", "s4.ckpt"), keep_last=2),
    Scenario(
        "file-overwrite-sequence", ("last.ckpt", "last.ckpt", "last.ckpt"), baseline=("last.ckpt",)
    ),
    Scenario("dir-sequence", ("c1", "c2", "c1", "c3"), is_dir=True, keep_last=2),
]
INTO_NEW_DIRECTORY = [
    Scenario("file-into-new-directory", ("last.ckpt",), subdir="runs/exp1"),
    Scenario("dir-into-new-directory", ("checkpoint_1",), is_dir=True, subdir="runs/exp1"),
]


def run_scenario(tmp_path, sc: Scenario) -> tuple[Recorder, PowerLossModel, list[Version], str]:
    """Do the baseline saves, then the recorded ones.

    Returns:
        The recorder (its log), the model of the tree as it was before the log, every version
        saved (with the log indices of its publishing rename and commit fsync), the root.
    """
    base = tmp_path / "world"
    base.mkdir()
    root = os.path.join(base, sc.subdir) if sc.subdir else str(base)
    versions: list[Version] = []
    rec = Recorder(base)  # logs only while installed (``with rec``)
    with stagesave.Checkpointer(
        root, chunk_bytes=CHUNK, keep_last=sc.keep_last, io_threads=3
    ) as ck:

        def one(name: str) -> tuple[int, int]:
            order = len(versions) + 1
            state = dir_state(order) if sc.is_dir else file_state(order)
            start = len(rec.ops)
            if sc.is_dir:
                ck.save_dir(state, name).result()
            else:
                ck.save(state, name).result()
            versions.append(
                Version(name, order, read_version_files(root, name, sc.is_dir), state, sc.is_dir)
            )
            return start, len(rec.ops)

        for name in sc.baseline:
            one(name)
        model = PowerLossModel(base)
        with rec:
            if sc.no_exchange:
                rec.fail("exchange", errno.EINVAL, every=True)
            for name in sc.recorded:
                start, end = one(name)
                v = versions[-1]
                v.publish = rename_to(rec.ops, start, end, os.path.join(root, name))
                v.commit = fsync_dir_after(rec.ops, v.publish, root)
                assert 0 <= v.publish < v.commit < end, (
                    f"{v}: publish at {v.publish}, directory fsync at {v.commit}, reported at {end}"
                )
    return rec, model, versions, root


def replay(tmp_path, sc: Scenario, seeds: int, mutate=None) -> tuple[int, list[str]]:
    """Check invariant I after a power loss at every operation index, in every view.

    ``mutate`` may rewrite the log first (to prove the check fails on a broken protocol).
    """
    rec, model, versions, root = run_scenario(tmp_path, sc)
    if mutate is not None:
        rec.ops[:] = [mutate(op) for op in rec.ops]
    rel_root = os.path.relpath(root, model.base)
    rng = random.Random(f"{sc.name}")
    views = [("durable", None), ("eager", None)] + [("random", s) for s in range(seeds)]
    trials = 0
    violations: list[str] = []
    scratch = tmp_path / "after-power-loss"
    for k in range(-1, len(rec.ops)):
        if k >= 0:
            model.apply(rec.ops[k])
        for mode, seed in views:
            shutil.rmtree(scratch, ignore_errors=True)
            model.materialize(scratch, mode, rng if seed is not None else None)
            problems = check_invariant(os.path.join(scratch, rel_root), versions, k, mode)
            trials += 1
            where = (
                f"after op {k} ({rec.ops[k].kind} {os.path.basename(rec.ops[k].path)})"
                if k >= 0
                else "before any op"
            )
            violations += [
                f"{sc.name} {mode}{'' if seed is None else seed} {where}: {p}" for p in problems
            ]
    shutil.rmtree(scratch, ignore_errors=True)
    return trials, violations


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.name)
def test_power_loss_after_every_operation(tmp_path, sc):
    trials, violations = replay(tmp_path, sc, seeds=2)
    faultstats.record("power loss at every op (recording fs)", trials, len(violations))
    assert not violations, "\n".join(violations[:20])
    assert trials > 30  # the log really has that many operations to cut after


@pytest.mark.slow
@pytest.mark.parametrize(
    "sc", SCENARIOS + INTO_NEW_DIRECTORY + SLOW_SCENARIOS, ids=lambda s: s.name
)
def test_power_loss_exhaustive(tmp_path, sc):
    trials, violations = replay(tmp_path, sc, seeds=24)
    faultstats.record("power loss at every op (recording fs)", trials, len(violations))
    assert not violations, "\n".join(violations[:20])


@pytest.mark.parametrize("sc", INTO_NEW_DIRECTORY, ids=lambda s: s.name)
def test_power_loss_saving_into_a_new_directory(tmp_path, sc):
    """The save creates the run directory and its parent: both must survive the power loss."""
    trials, violations = replay(tmp_path, sc, seeds=2)
    faultstats.record("power loss at every op (recording fs)", trials, len(violations))
    assert not violations, "\n".join(violations[:5])


def _drop_fsync(of_dirs: bool):
    def mutate(op):
        if op.kind == "fsync" and op.is_dir == of_dirs:
            return dataclasses.replace(op, kind="fadvise")  # same index, no effect
        return op

    return mutate


@pytest.mark.parametrize(
    "of_dirs", [False, True], ids=["without-file-fsync", "without-directory-fsync"]
)
def test_the_check_fails_on_a_protocol_that_skips_fsync(tmp_path, of_dirs):
    """The same replay over a log whose file (or directory) fsyncs are taken out finds losses."""
    trials, violations = replay(tmp_path, SCENARIOS[1], seeds=0, mutate=_drop_fsync(of_dirs))
    assert trials > 20
    assert any("newest committed checkpoint is <last.ckpt #2>" in v for v in violations), (
        violations[:5]
    )


def test_model_drops_what_was_not_fsynced(tmp_path):
    """The model itself: unsynced bytes and entries vanish in the durable view, not in eager."""
    base = tmp_path / "m"
    base.mkdir()
    model = PowerLossModel(base)
    with Recorder(base) as rec:
        from stagesave.stores import posix as _fsops

        fd = _fsops.open(str(base / "f"), os.O_WRONLY | os.O_CREAT, 0o644)
        _fsops.pwrite(fd, b"abc", 0)
        _fsops.fsync(fd)
        _fsops.pwrite(fd, b"XY", 1)  # not synced
        _fsops.close(fd)
        _fsops.rename(str(base / "f"), str(base / "g"))
    for op in rec.ops:
        model.apply(op)
    model.materialize(tmp_path / "durable", "durable")
    model.materialize(tmp_path / "eager", "eager")
    assert os.listdir(tmp_path / "durable") == []  # the directory was never fsynced
    assert (tmp_path / "eager" / "g").read_bytes() == b"abc"  # a rename keeps the durable bytes
    assert (base / "g").read_bytes() == b"aXY"  # while the live file has them all


def _replay_four_views(
    tmp_path, model: PowerLossModel, ops, seed: str, check
) -> tuple[int, list[str]]:
    """For every op index k and the views durable, eager and two random ones: materialize the
    tree a power loss after op k leaves and ``check(tree, k, mode)`` it (a problem or None)."""
    rng = random.Random(seed)
    scratch = tmp_path / "after-power-loss"
    trials, violations = 0, []
    for k in range(-1, len(ops)):
        if k >= 0:
            model.apply(ops[k])
        for mode, view in [("durable", None), ("eager", None), ("random", 0), ("random", 1)]:
            shutil.rmtree(scratch, ignore_errors=True)
            model.materialize(scratch, mode, rng if view is not None else None)
            trials += 1
            problem = check(scratch, k, mode)
            if problem:
                violations.append(
                    f"after op {k} ({ops[k].kind if k >= 0 else '-'}) {mode}{view}: {problem}"
                )
    shutil.rmtree(scratch, ignore_errors=True)
    return trials, violations


def test_power_loss_during_a_link_update(tmp_path):
    """Lightning's ``save_last="link"``: a new checkpoint is saved, then ``last.ckpt`` (a relative
    symbolic link) is pointed at it. After a power loss at any operation, ``last.ckpt`` points at
    a whole, verified checkpoint: the old one until the new link is durable, the new one once it
    is (durable view), never at nothing or at an uncommitted file."""
    from faulthelp import file_state as state_of

    from stagesave.saving.commit import commit_link

    base = tmp_path / "world"
    base.mkdir()
    with stagesave.Checkpointer(base, chunk_bytes=CHUNK) as ck:
        ck.save(state_of(1), "s1.ckpt").result()
        commit_link(str(base / "last.ckpt"), str(base / "s1.ckpt"))
        model = PowerLossModel(base)
        with Recorder(base) as rec:
            ck.save(state_of(2), "s2.ckpt").result()
            start = len(rec.ops)
            commit_link(str(base / "last.ckpt"), str(base / "s2.ckpt"))
    saved = fsync_dir_after(rec.ops, rename_to(rec.ops, 0, start, str(base / "s2.ckpt")), str(base))
    publish = rename_to(rec.ops, start, len(rec.ops), str(base / "last.ckpt"))
    commit = fsync_dir_after(rec.ops, publish, str(base))
    assert 0 <= saved < start <= publish < commit

    def check(scratch, k: int, mode: str) -> str | None:
        link = scratch / "last.ckpt"
        try:
            target = os.readlink(link)
            info = stagesave.verify(link)
            step = stagesave.load(link)["step"]
        except Exception as exc:  # noqa: BLE001 - any failure is a violation
            return f"last.ckpt unusable: {type(exc).__name__}: {exc}"
        want = {"durable": 2 if k >= commit else 1, "eager": 2 if k >= publish else 1}.get(mode)
        if info.status != "verified" or target not in ("s1.ckpt", "s2.ckpt"):
            return f"last.ckpt -> {target} is {info.status}"
        if step != int(target[1]):
            return f"last.ckpt -> {target} loads step {step}"
        if want is not None and step != want:
            return f"last.ckpt is step {step}, expected {want} ({mode})"
        return None

    trials, violations = _replay_four_views(tmp_path, model, rec.ops, "link", check)
    faultstats.record("power loss at every op (recording fs)", trials, len(violations))
    assert not violations, "\n".join(violations[:10])


@pytest.mark.parametrize("replace", [False, True], ids=["new", "over-an-old-export"])
def test_power_loss_during_an_export(tmp_path, replace):
    """``stagesave export`` of a committed checkpoint (a byte copy through the commit module).
    After a power loss at any operation, the exported file is absent (or the previous export),
    or a whole copy that verifies on its own; once its directory fsync happened, the new one."""
    from faulthelp import file_state as state_of

    # the export command's body, run in this process so that the recorder sees its operations
    from stagesave.cli._common import Env
    from stagesave.cli._export import export

    base = tmp_path / "world"
    (base / "out").mkdir(parents=True)
    stagesave.save(state_of(1), base / "src.ckpt")
    out = base / "out" / "model.ckpt"
    if replace:
        stagesave.save(state_of(0), out)
    source = (base / "src.ckpt").read_bytes()
    old = out.read_bytes() if replace else None
    model = PowerLossModel(base)
    with Recorder(base) as rec:
        export(Env(quiet=True), str(base / "src.ckpt"), str(out), force=replace)
    publish = rename_to(rec.ops, 0, len(rec.ops), str(out))
    commit = fsync_dir_after(rec.ops, publish, str(base / "out"))
    assert 0 <= publish < commit

    def check(scratch, k: int, mode: str) -> str | None:
        got = scratch / "out" / "model.ckpt"
        data = got.read_bytes() if got.exists() else None
        want_new = {"durable": k >= commit, "eager": k >= publish}.get(mode)
        if data not in (source, old):
            return "the export holds bytes of no version"
        if data is not None and stagesave.verify(got).status != "verified":
            return "the export does not verify on its own"
        if want_new is True and data != source:
            return "the committed export is not there"
        if want_new is False and data == source:
            return "the export appeared before it was published"
        return None

    trials, violations = _replay_four_views(tmp_path, model, rec.ops, "export", check)
    faultstats.record("power loss at every op (recording fs)", trials, len(violations))
    assert not violations, "\n".join(violations[:10])


def test_power_loss_while_publishing_into_a_folder_of_the_users_files(tmp_path):
    """A folder checkpoint saved over another in a folder that also holds a file of the user's
    is published into it, file by file (the old carrier first, the new one last). After a power
    loss at any operation, in every view: the user's file is intact, a folder that listing
    calls committed verifies (a raw file of the old save beside new members is never taken for
    the new one's: every member is durable in place before the carrier names them), and from
    the new carrier's directory fsync on, the new checkpoint is there."""
    from stagesave.formats import Raw
    from stagesave.restore.resolve_folder import resolve_dir
    from stagesave.stores.local import LocalStore

    base = tmp_path / "world"
    (base / "ck").mkdir(parents=True)
    (base / "ck" / "notes.txt").write_bytes(b"the user's")

    def files(step: int) -> dict:
        return {**dir_state(step), "config.json": Raw(b'{"step": %d}' % step)}

    rec = Recorder(base)
    with stagesave.Checkpointer(base, chunk_bytes=CHUNK) as ck:
        ck.save_dir(files(1), "ck").result()
        model = PowerLossModel(base)
        with rec:
            ck.save_dir(files(2), "ck").result()
    carrier = rename_to(rec.ops, 0, len(rec.ops), str(base / "ck" / "optimizer.bin"))
    committed = fsync_dir_after(rec.ops, carrier, str(base / "ck"))
    rng = random.Random(7)
    scratch = tmp_path / "after-power-loss"
    violations = []
    for k in range(len(rec.ops)):
        model.apply(rec.ops[k])
        for mode in ("durable", "eager", "random", "random", "random"):
            shutil.rmtree(scratch, ignore_errors=True)
            model.materialize(scratch, mode, rng if mode == "random" else None)
            folder = scratch / "ck"
            where = f"{mode} after op {k} ({rec.ops[k].kind})"
            if (folder / "notes.txt").read_bytes() != b"the user's":
                violations.append(f"{where}: the user's file changed")
            if resolve_dir(LocalStore(str(scratch)), "ck").status == "committed":
                info = stagesave.verify(folder)
                if info.status != "verified":
                    violations.append(f"{where}: listed as committed, {info.problems[:1]}")
                elif k >= committed and mode == "durable":
                    step = stagesave.Checkpointer().load(folder / "optimizer.bin")["step"]
                    if step != 2:
                        violations.append(f"{where}: step {step} after the commit")
            elif k >= committed:
                violations.append(f"{where}: no checkpoint after the commit")
    assert violations == []
