"""Sharded checkpoints with real processes (gloo on CPU): FSDP2 saved on 4 ranks and loaded on 2
and on 1 bit for bit, replicated state written once, ranks SIGKILLed mid-save, the object-store
protocol."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_helpers import (
    assert_same,
    build_model,
    folder_proof,
    proof,
    rank_file_sizes,
    replicated_state,
    train,
)
from dcp_run import Run

import stagesave
import stagesave.dcp as sdcp
from stagesave import LocalStore
from stagesave._crash import CRASH_POINTS  # fault injection: each crash point must be covered
from stagesave.dcp._metadata import load_metadata  # reads .metadata to inspect what was stored
from stagesave.restore.gc import collect_garbage, find_debris

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _ref(run: Run) -> dict:
    return torch.load(run.out / "ref.pt", weights_only=True)


def test_fsdp2_save_on_four_ranks_commits_one_folder(fsdp_saved):
    root = fsdp_saved.out / "ckpt"
    folder = root / "step-2"
    reports = fsdp_saved.ranks
    assert all(r["dtensor"] == "DTensor" and r["local_rows"] == 12 for r in reports)  # 48 rows / 4
    carrier = folder_proof(folder)  # .metadata, written last by the coordinator, proves the folder
    assert carrier.folder is not None and carrier.seq == 1
    names = sorted([carrier.folder.carrier, *(m.name for m in carrier.folder.members)])
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    # Exactly what FileSystemWriter writes: no rank marker, no manifest beside the files.
    assert sorted(os.listdir(folder)) == names
    save_id = carrier.metadata["dcp_save_id"]
    assert carrier.folder.token == save_id
    assert (
        carrier.metadata["dcp_world_size"] == 4
        and carrier.metadata["format"] == "torch.distributed.checkpoint"
    )
    for member in carrier.folder.members:  # every rank file proves itself, pinned by the carrier
        own = proof(folder / member.name)
        assert own.manifest is not None and own.summary is not None, own.problems
        assert (
            own.summary.folder == save_id
            and own.summary.carrier == ".metadata"
            and own.summary.seq is None
        )
        assert (
            own.proof_crc == member.proof_crc
            and (folder / member.name).stat().st_size == member.size
        )
    md = load_metadata((folder / ".metadata").read_bytes(), "test")
    assert set(md.state_dict_metadata) >= {"model.0.weight", "optim.state.4.bias.exp_avg_sq"}
    assert md.storage_meta is not None and md.storage_meta.save_id == save_id
    latest = stagesave.latest(root)  # verifies by default: every rank file matched its proof
    assert (
        latest is not None
        and latest.name == "step-2"
        and latest.is_dir
        and latest.status == "verified"
    )
    cheap = stagesave.latest(root, verify=False)
    assert cheap is not None and cheap.name == "step-2" and cheap.status == "committed"
    assert stagesave.verify(folder).status == "verified"
    assert sorted(os.listdir(root)) == ["step-2"]  # no staging folder left behind
    for r in reports:  # every rank saw the global commit, after its own write
        tel = r["save"]
        assert tel["error"] is None and tel["committed_at"] is not None
        assert 0 < tel["blocking_s"] < tel["time_to_commit_s"]


def test_fsdp2_four_ranks_load_on_two_bitwise(fsdp_saved, launcher):
    run = launcher("fsdp_load", 2, fsdp_saved.out)
    run.ok()
    assert [r["local_rows"] for r in run.ranks] == [24, 24]  # resharded: 48 rows / 2
    ref = _ref(fsdp_saved)
    loaded = torch.load(fsdp_saved.out / "loaded.pt", weights_only=True)
    assert_same(loaded["model"], ref["model"], "model")
    assert_same(loaded["optim"], ref["optim"], "optim")
    assert loaded["step"] == 2
    assert_same(loaded["rep"], replicated_state(), "replicated")


def test_fsdp2_four_ranks_load_in_one_process_bitwise(fsdp_saved):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = build_model(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 999, 1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    sdcp.load(state, fsdp_saved.out / "ckpt" / "step-2")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full_m, full_o = get_state_dict(model, opt)
    ref = _ref(fsdp_saved)
    assert_same(full_m, ref["model"], "model")
    assert_same(full_o, ref["optim"], "optim")
    assert state["step"] == 2


def test_fsdp2_steady_saves_exchange_names_and_load_bitwise(fsdp_saved):
    # saves 3, 4, 5 of the same FSDP2 structure after 2: names exchanged on every rank
    assert [r["exchanged"] for r in fsdp_saved.ranks] == [3, 3, 3, 3]
    whole = sdcp.to_state_dict(fsdp_saved.out / "steady" / "step-5")
    ref = torch.load(fsdp_saved.out / "ref5.pt", weights_only=True)
    assert_same(whole["model"], ref["model"], "model")
    assert_same(whole["optim"]["state"], ref["optim"]["state"], "optim")
    assert whole["step"] == 5


def test_export_to_one_plain_file(fsdp_saved, tmp_path, capsys):
    from stagesave.cli import main

    folder = fsdp_saved.out / "ckpt" / "step-2"
    ref = _ref(fsdp_saved)
    sdcp.export(folder, tmp_path / "one.pt")
    mine = torch.load(tmp_path / "one.pt", weights_only=True)  # a plain torch file, safe to load
    assert_same(mine["model"], ref["model"], "model")
    assert_same(mine["optim"]["state"], ref["optim"]["state"], "optim.state")
    assert mine["step"] == 2
    # The CLI's own export reads the same folder (through torch's dcp_to_torch_save).
    assert main(["-q", "verify", str(folder)]) == 0
    assert main(["-q", "export", str(folder), str(tmp_path / "cli.pt"), "--trusted"]) == 0
    cli = torch.load(tmp_path / "cli.pt", weights_only=False)
    assert_same(cli["model"], mine["model"], "cli model")
    assert_same(cli["optim"]["state"], mine["optim"]["state"], "cli optim")


def test_replicated_state_is_written_once_and_split_across_ranks(fsdp_saved):
    state = replicated_state()
    tensor_bytes = (
        state["emb"].nbytes + sum(t.nbytes for t in state["blocks"].values()) + state["bias"].nbytes
    )
    default = rank_file_sizes(str(fsdp_saved.out / "rep" / "default"))
    split = rank_file_sizes(str(fsdp_saved.out / "rep" / "split"))
    # Four replicas, one copy on storage: 4x would mean every replica wrote every byte.
    for sizes in (default, split):
        assert len(sizes) == 4 and tensor_bytes < sum(sizes.values()) < 1.1 * tensor_bytes
    # DCP's dedup alone keeps the 1 MiB table whole, on one rank ...
    assert sum(size >= state["emb"].nbytes for size in default.values()) == 1
    # ... the split planner gives each rank a quarter of it, so all four write in parallel.
    assert all(size >= state["emb"].nbytes // 4 for size in split.values()), split
    for name in ("default", "split"):
        assert_same(sdcp.to_state_dict(fsdp_saved.out / "rep" / name), state, name)


@pytest.mark.parametrize(
    ("victim", "point", "gated"),
    [(1, "mid_data", "1"), (0, "dcp_after_metadata", "1"), (1, "mid_data", "0")],
    ids=["rank1-mid-write", "coordinator-before-commit", "rank1-inside-dcp-save"],
)
def test_rank_killed_during_save_leaves_no_commit(launcher, tmp_path, victim, point, gated):
    # the survivor's deadline: long enough for the victim to reach its crash point on a loaded
    # machine (else the survivor gives up first and removes the folder the victim writes into)
    run = launcher("killed_save", 2, tmp_path, KILL_RANK=str(victim), KILL_AT=point,
                       KILL_AFTER_SAVE_RETURNED=gated, COMMIT_TIMEOUT="6")
    survivor = 1 - victim
    assert run.exit_codes[victim] == -9, run.log()
    report = run.ranks[survivor]
    assert report is not None and report["ok"], report
    if gated == "1":  # the victim died after dcp.save returned everywhere: the handle tells
        assert report["outcome"] == "CommitTimeoutError"
        assert "close" not in report  # the failure was delivered once, by the handle
        if victim == 1:
            assert (
                "rank(s) 1 did not finish writing their part before the commit deadline"
                in report["message"]
            )
        else:
            assert "the coordinator did not commit before the deadline" in report["message"]
    else:  # the victim died inside dcp.save's own collectives: dcp.save raised, or the handle
        assert report["outcome"] in ("dcp.save raised", "CommitTimeoutError"), report
    root = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing corrupt is even listed
        listed = stagesave.list_checkpoints(root)
    assert [c.name for c in listed] == ["step-1"] and not (root / "step-2").exists()
    latest = stagesave.latest(root, verify=True)
    assert latest is not None and latest.name == "step-1" and latest.status == "verified"
    assert_same(
        sdcp.to_state_dict(latest.path), torch.load(tmp_path / "ref-a.pt", weights_only=True)
    )
    debris, kept = find_debris(LocalStore(str(root)))
    assert kept == []
    if victim == 1 and gated == "1":
        assert debris == []  # the coordinator removed the staging folder when it gave up
    # anything left is a temporary of a dead writer (staging folder, lease), which gc removes
    for d in debris:
        assert (
            d.kind in ("temporary-dir", "temporary")
            and d.action == "remove"
            and d.name.startswith(".step-2.")
        )


def test_a_rank_that_fails_makes_everyone_give_up_without_waiting(launcher, tmp_path):
    run = launcher("failed_write", 2, tmp_path)
    run.ok()
    coordinator, failed = run.ranks
    # Staging failed on rank 1: dcp.save raised everywhere, and the coordinator's background side
    # gave up on the failure marker, not at its 120 s deadline (that would be CommitTimeoutError).
    assert coordinator["dcp_save_raised"] and failed["dcp_save_raised"]
    staging = coordinator["staging"]
    assert staging["error_type"] == "CheckpointError"
    assert (
        "rank 1 failed to write its part (cannot save bad: it is a tensor on the meta device"
        in staging["message"]
    )
    # The background write failed on rank 1: both handles fail, the coordinator's at once.
    write = coordinator["write"]
    assert write["error_type"] == "CheckpointError"
    assert (
        "rank 1 failed to write its part ([Errno 28] No space left on device)" in write["message"]
    )
    assert failed["write"]["error_type"] == "StorageError"
    assert "no space left on the device" in failed["write"]["message"]
    assert stagesave.latest(tmp_path / "ckpt") is None and os.listdir(tmp_path / "ckpt") == []


def test_a_save_that_raised_is_not_raised_again_by_a_later_call(launcher, tmp_path):
    run = launcher("raised_once", 2, tmp_path)
    run.ok()
    r0, r1 = run.ranks
    for rank in (r0, r1):
        # Each failed dcp.save raised on both ranks (stagesave's error, or DCP's wrapper) ...
        assert rank["1"] == "UnsupportedObjectError" and rank["3"] == "CheckpointException"
        assert rank["2"] == "CheckpointException"
        # ... and its background side, failing in turn, is not raised again afterwards.
        assert rank["1_settled"] is None and rank["2_settled"] is None
    # The handles still have their failures.
    assert r0["1_handle"] == "CheckpointError"
    assert "the coordinator gave up on this save" in r1["2_handle"]
    # A background failure after dcp.save returned is raised by the next save, once (on every
    # rank: DCP hands the coordinator's error to the others; each rank's own first).
    assert r1["6"].startswith("StorageError: ") and "no space left" in r1["6"]
    assert r0["6"].startswith("CheckpointError: ")
    assert "step-5: rank 1 failed to write its part" in r0["6"]
    assert r0["6_settled"] is None and r1["6_settled"] is None
    # Healthy saves after the failed ones commit what they were given.
    assert [c.name for c in stagesave.list_checkpoints(tmp_path / "ckpt")] == ["step-7", "step-4"]
    assert r0["read"] == {"w": [1.0] * 8, "note": "replicated", "own0": [0.0, 1.0, 2.0, 3.0],
                          "own1": [10.0, 11.0, 12.0, 13.0]}


def test_steady_saves_exchange_names_and_write_what_dcp_save_writes(launcher, tmp_path):
    run = launcher("steady_exchange", 2, tmp_path)
    run.ok()
    r0, r1 = run.ranks
    # [saves planned from the state, saves by the exchange of names] per save: the first
    # structure and every change are planned as dcp.save plans them (a shape changed on rank 1
    # alone sends every rank there, and so does a DTensor that now requires grad), the others
    # exchange names; save 6 (by the exchange) failed on rank 1 after its layout, on every rank
    for rank in (r0, r1):
        assert rank["paths"] == [[1, 0], [0, 1], [0, 1], [0, 1], [1, 0], [0, 0], [1, 0]]
        assert rank["by_dcp"] == 0  # planned as dcp.save plans, without its last collective
        assert rank["errors"] == {"6": "CheckpointException"}
        assert rank["same_bytes"] == [True] * 6  # each rank file is a fresh writer's
    assert r0["saved"] == {str(s): True for s in (1, 2, 3, 4, 5, 7)}
    assert r0["same_metadata"] == [True] * 6
    # [local plans reused, global plans reused, saves resolved by place, write results sent
    # as a mark]: save 5 made every local plan again (a DTensor's spec changed, its local shard
    # the same: (16, 4) sharded became (8, 4) replicated), and the global plan (a new items
    # list); save 7 too (a DTensor now requires grad, which DCP records); results by mark at
    # saves 3 and 4 (in full at save 6, the first by the exchange with the new global plan)
    assert r0["counts"] == [3, 4, 2, 2] and r1["counts"] == [3, 0, 2, 2]


def test_a_failed_save_told_to_every_rank_is_not_raised_again_by_the_slower_rank(
        launcher, tmp_path):
    run = launcher("told_once", 2, tmp_path)
    run.ok()
    r0, r1 = run.ranks
    # save c raised b's failure on both ranks (rank 1's, handed to rank 0 by DCP) ...
    assert r0["c"].startswith("StorageError: ") and "no space left" in r0["c"]
    assert r1["c"].startswith("StorageError: ") and "no space left" in r1["c"]
    # ... while rank 0's part of b was still being written; it failed later (its handle has
    # it), and nothing raised it again; save d committed on both ranks
    assert r0["b_done_at_c"] is False
    assert r0["b"].startswith("CheckpointError: ") and "rank 1 failed to write its part" in r0["b"]
    assert r0["wait"] is None and r1["wait"] is None
    assert [c.name for c in stagesave.list_checkpoints(tmp_path / "ckpt")] == ["d", "a"]


def test_object_store_protocol_on_two_ranks(launcher, tmp_path):
    run = launcher("object_store_save", 2, tmp_path)
    run.ok()
    assert all(r["loaded_equal"] for r in run.ranks)
    folder = tmp_path / "objects" / "last"
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # The markers were in a hidden prefix beside the folder, and are gone with the commit.
    leftovers = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "objects") for f in files]
    assert sorted(os.path.relpath(p, folder) for p in leftovers) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    latest = stagesave.latest(tmp_path / "objects", verify=True)
    assert latest is not None and latest.name == "last" and latest.status == "verified"


def test_plans_are_reused_on_every_rank_until_one_rank_changes(launcher, tmp_path):
    run = launcher("steady_plans", 2, tmp_path)
    run.ok()
    r0, r1 = run.ranks
    # [local, global] reuses after each save: the coordinator (rank 0) makes the global plan
    assert r0["reused"] == [[0, 0], [1, 1], [2, 1]]  # its own state unchanged at step 3
    assert r1["reused"] == [[0, 0], [1, 0], [1, 0]]  # its tensor reshaped at step 3
    for step in ("1", "2", "3"):
        read = r0["read"][step]
        assert read["w"] == r0["saved"][step]["w"] == r1["saved"][step]["w"]
        assert read["own0"] == r0["saved"][step]["own"]
        assert read["own1"] == r1["saved"][step]["own"]
        assert read["step"] == int(step)


def test_ranks_given_the_same_global_plan_resolve_their_items_by_place(launcher, tmp_path):
    run = launcher("steady_places", 2, tmp_path)
    run.ok()
    r0, r1 = run.ranks
    # [global plans reused (the coordinator's count), saves resolved by place] after each save
    assert r0["counts"] == [[0, 0], [1, 0], [2, 1], [3, 2], [4, 3]]
    assert [c[1] for c in r1["counts"]] == [0, 0, 1, 2, 3]
    for step in ("1", "2", "3", "4", "5"):
        read = r0["read"][step]
        assert read["shared"] == r0["saved"][step]["shared"] == r1["saved"][step]["shared"]
        for rank in (r0, r1):
            for key, value in rank["saved"][step].items():
                assert read[key] == value, (step, key)


#: Crash points of save B in order, with the checkpoint ``last`` must hold after a SIGKILL there.
#: ``:2`` is the second time the point is reached: the coordinator writing ``.metadata`` after its
#: own rank file. ``no-exchange``: on a filesystem that cannot swap two folders (the old one is
#: moved aside first; ``after_aside`` exists only there: ``latest()`` offers the aside folder
#: where it lies, and the next save or ``stagesave gc`` puts it back).
_REPLACE_POINTS = [
    ("before_data", "A"),
    ("mid_data", "A"),
    ("after_data", "A"),
    ("after_data_fsync", "A"),
    ("before_proof", "A"),
    ("after_proof", "A"),
    ("dcp_before_marker", "A"),
    ("dcp_after_marker", "A"),
    ("dcp_before_metadata", "A"),
    ("before_data:2", "A"),
    ("after_data_fsync:2", "A"),
    ("before_proof:2", "A"),
    ("after_proof:2", "A"),
    ("dcp_after_metadata", "A"),
    ("no-exchange/after_aside", "A"),
    ("after_rename", "B"),
    ("no-exchange/after_rename", "B"),
    ("after_commit", "B"),
    ("during_retention", "B"),
]


def test_every_crash_point_of_the_protocol_is_covered():
    covered = {p.rpartition("/")[2].partition(":")[0] for p, _ in _REPLACE_POINTS}
    obsolete = {"dcp_before_manifest", "dcp_after_manifest"}  # format 1 only; no longer reached
    # uploads: the tiered stores' tests; into_folder: tests/core/test_crash.py (a folder of the
    # user's files)
    assert set(CRASH_POINTS) - covered - obsolete == {"during_upload", "into_folder"}


@pytest.mark.parametrize(("point", "expect"), _REPLACE_POINTS, ids=[p for p, _ in _REPLACE_POINTS])
def test_sigkill_while_replacing_a_folder_leaves_the_old_or_the_new_never_a_mix(
    launcher, tmp_path, point, expect
):
    variant, _, kill_at = point.rpartition("/")
    run = launcher(
        "crash_replace",
        1,
        tmp_path,
        KILL_AT=kill_at,
        NO_EXCHANGE=str(int(variant == "no-exchange")),
    )
    assert run.exit_codes == [-9], f"{point} was not reached: {run.ranks}\n{run.log()}"
    states = torch.load(tmp_path / "states.pt", weights_only=True)
    root = tmp_path / "ckpt"
    before = sorted(os.listdir(root))
    aside = [leaf for leaf in before if leaf.endswith(".stagesave-aside")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = stagesave.latest(root, verify=True)
        listed = stagesave.list_checkpoints(root)
    assert sorted(os.listdir(root)) == before  # reads never write (nor repair)
    retained = point == "during_retention"
    others = [] if retained else ["step-0"]
    if point == "no-exchange/after_aside":
        # Killed between the two renames: the old folder, aside, is the only copy of ``last``.
        # It is offered where it lies (whole and verified), with the one warning that says so.
        assert len(aside) == 1 and not (root / "last").exists(), before
        assert [
            str(w.message) for w in caught if "stagesave-aside: the only copy" in str(w.message)
        ] == [str(w.message) for w in caught] and len(caught) == 1, [str(w.message) for w in caught]
        assert latest is not None and latest.name == aside[0] and latest.status == "verified", (
            latest
        )
        assert_same(
            sdcp.to_state_dict(root / aside[0]),
            states[expect],
            f"the aside folder after a crash at {point}",
        )
        assert [c.name for c in listed] == [aside[0], *others]
    else:
        assert [str(w.message) for w in caught] == []  # nothing corrupt is even listed
        assert latest is not None and latest.name == "last" and latest.status == "verified", latest
        assert [c.name for c in listed] == ["last", *others]
        # After the second rename, the old folder left aside is debris (never listed or offered).
        assert len(aside) == (1 if point == "no-exchange/after_rename" else 0), before
    # What a crash leaves is a temporary of a dead writer, or (without RENAME_EXCHANGE) the old
    # folder aside: gc removes the one and removes or moves back the other (so would the next save).
    debris, kept = find_debris(LocalStore(str(root)))
    assert kept == []
    expected_aside = {
        "no-exchange/after_aside": ["restore"],
        "no-exchange/after_rename": ["remove"],
    }.get(point, [])
    assert [d.action for d in debris if d.kind == "aside-dir"] == expected_aside, debris
    for d in debris:
        assert (
            d.action == "remove" and d.kind in ("temporary", "temporary-dir")
        ) or d.kind == "aside-dir", d
    report = collect_garbage(LocalStore(str(root)))
    assert report.errors == [] and len(report.done) == len(debris), report
    assert find_debris(LocalStore(str(root))) == ([], [])
    assert not [leaf for leaf in os.listdir(root) if leaf.endswith(".stagesave-aside")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        latest = stagesave.latest(root, verify=True)
        listed = stagesave.list_checkpoints(root)
    assert latest is not None and latest.name == "last" and latest.status == "verified", latest
    # DCP's files, nothing else
    assert sorted(os.listdir(root / "last")) == [".metadata", "__0_0.distcp"]
    assert_same(sdcp.to_state_dict(root / "last"), states[expect], f"last after a crash at {point}")
    got = {"w": torch.zeros(512, 256), "step": 0}
    dcp.load(got, checkpoint_id=str(root / "last"))  # torch's own reader agrees
    assert_same(got, states[expect], "torch's FileSystemReader")
    # step-0 is removed by B's retention only: it is whole or gone, never half removed.
    assert [c.name for c in listed] == ["last", *others]
    if not retained:
        assert stagesave.verify(root / "step-0").status == "verified"


@pytest.mark.parametrize("objects", [False, True], ids=["posix", "object-store"])
def test_the_other_ranks_learn_at_once_that_the_coordinator_gave_up(launcher, tmp_path, objects):
    run = launcher("coordinator_fails", 2, tmp_path, OBJECT_STORE=str(int(objects)))
    run.ok()
    coordinator, other = run.ranks
    assert (
        coordinator["error_type"] == "StorageError"
        and "no space left on the device" in coordinator["message"]
    )
    # Not at its 120 s deadline (CommitTimeoutError): the store told it.
    assert other["error_type"] == "CheckpointError", other
    assert (
        "the coordinator gave up on this save (see its error); it was not committed"
        in other["message"]
    )
    assert other["seconds"] < 60
    # Staging failed on the coordinator: its lease went with dcp.save's failure, and rank 1's
    # part (written, or refused by then) does not wait for a commit that cannot come.
    staging = other["staging"]
    assert staging is not None and staging["error_type"] == "CheckpointError", staging
    assert (
        "the coordinator gave up on this save" in staging["message"]
        and other["staging_seconds"] < 60
    )
    root = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing corrupt is even listed
        assert stagesave.latest(root) is None and stagesave.list_checkpoints(root) == []
    # What the failed saves wrote went with them (staging folders, leases; on the object store
    # the files written into the target and the markers beside it).
    assert [os.path.join(d, f) for d, _, files in os.walk(root) for f in files] == []
