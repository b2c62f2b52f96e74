"""Accelerate's FSDP save_state/load_state through stagesave.dcp: FSDP2 on 2 CPU processes (gloo).

The processes run in ``dist_worker.py`` (phases ``fsdp_save`` and ``fsdp_resume``, forked from
one interpreter); each test asserts on what the ranks reported. What needs a GPU is at the end.
"""

from __future__ import annotations

import pytest

PARTS = ["pytorch_model_fsdp_0", "optimizer_0"]
SAVE, RESUME = "fsdp_save", "fsdp_resume"


def test_staged_through_stagesave_without_a_fallback_warning(worker_runs):
    for r in (0, 1):
        rep = worker_runs.rank(SAVE, r)
        assert rep.get("asynchronous") is True, rep.get("error") or worker_runs.logs(SAVE)
        assert rep["fallback_warnings"] == []
        assert rep["returned"].endswith("/staged")


def test_same_layout_and_contents_as_accelerate_fsdp_save(worker_runs):
    worker_runs.ok(SAVE, "same_contents", ranks=(0,))  # rank 0 compared the two folders
    rep = worker_runs.rank(SAVE, 0)
    # exactly Accelerate's files, DCP parts included: every proof is inside a file
    assert rep["staged_tree"] == rep["plain_tree"]
    assert rep["bad_zips"] == []
    assert rep["plain_tree"] == sorted([
        "custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin",
        *[f"{p}/{f}" for p in PARTS for f in (".metadata", "__0_0.distcp", "__1_0.distcp")],
    ])
    assert rep["verify"] == "verified" and rep["parts_verify"] == ["verified", "verified"]
    assert rep["metadata"]["fsdp"] == {
        "parts": PARTS,
        "state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_version": 2,
    }
    assert rep["metadata"]["num_processes"] == 2


def test_bitwise_restore_and_interoperability_with_accelerate_both_ways(worker_runs):
    worker_runs.ok(SAVE, "stagesave_restore", "plain_reads_stagesave", "stagesave_reads_plain")


def test_existing_explicit_folder_is_refused_on_every_rank(worker_runs):
    for r in (0, 1):
        assert "already exists: stagesave publishes an FSDP checkpoint by renaming it into place" \
            in worker_runs.rank(SAVE, r)["overwrite"]


def test_automatic_naming_total_limit_and_corrupt_part(worker_runs):
    worker_runs.ok(SAVE, "auto_restore", "corrupt_skipped", "replaced_plain_restore")
    for r in (0, 1):
        rep = worker_runs.rank(SAVE, r)
        # nothing but committed folders where Accelerate lists (work folders, beside them, are
        # gone once published), and nothing of stagesave's in the project folder
        assert rep["auto_listing"] == ["checkpoint_1", "checkpoint_2"]
        assert rep["auto_project_listing"] == ["checkpoints"]
        assert rep["auto_iteration"] == 3
        assert rep["corrupt_iteration"] == 2  # checkpoint_1 loaded
        assert rep["replaced_listing"] == ["checkpoint_1", "checkpoint_2"]
    r0 = worker_runs.rank(SAVE, 0)
    assert any(
        "skipping checkpoint" in w
        and "checkpoint_2" in w
        and "__1_0.distcp: checksum mismatch" in w
        for w in r0["corrupt_warnings"]
    ), r0["corrupt_warnings"]
    assert any("replacing the invalid checkpoint" in w for w in r0["replace_warnings"]), r0[
        "replace_warnings"
    ]


def test_save_failing_on_the_main_process_publishes_nothing_and_leaves_nothing(worker_runs):
    r0, r1 = worker_runs.rank(SAVE, 0), worker_runs.rank(SAVE, 1)
    assert "failed_save" in r0, r0.get("error") or worker_runs.logs(SAVE)
    # raised where it failed
    assert "lambda" in r0["failed_save"] and r0["failed_save"] != "no error"
    assert r1["failed_save"] == "no error"  # the other rank's part of the save went through
    for rep in (r0, r1):
        # the work folder and its parts were removed
        assert rep["failed_listing"] == ["checkpoint_0"]
        assert rep["failed_project_listing"] == ["checkpoints"]


def test_rank_killed_mid_save_leaves_the_previous_checkpoint_for_plain_accelerate_and_stagesave(
    worker_runs,
):
    # the crash point fired on rank 0
    assert worker_runs.exit[SAVE][0] == -9, worker_runs.logs(SAVE)
    assert worker_runs.rank(SAVE, 0).get("crash_armed") and not worker_runs.rank(SAVE, 1).get(
        "crash_missed"
    )
    assert worker_runs.exit[RESUME] == [0, 0], worker_runs.logs(RESUME)
    worker_runs.ok(RESUME, "plain_resume", "stagesave_resume")
    gc = worker_runs.rank(RESUME, 0)["gc"]
    assert gc[0] == 0, gc
    for r in (0, 1):
        rep = worker_runs.rank(RESUME, r)
        # the killed save's work folder is beside its target, a dot-name stagesave never loads
        # (debris for `stagesave gc`, which removed it before plain Accelerate resumed)
        [debris] = [n for n in rep["listing"] if n != "checkpoint_0"]
        assert debris.startswith(".checkpoint_1.") and debris.endswith(".stagesave-tmp"), rep[
            "listing"
        ]
        assert rep["project_listing"] == ["checkpoints"]
        assert rep["listing_after_gc"] == ["checkpoint_0"]
        assert rep["iteration"] == 1
        assert rep["listing_after"] == ["checkpoint_0", "checkpoint_1"]


@pytest.mark.gpu
@pytest.mark.parametrize("fsdp_version", ["1", "2"])
def test_real_fsdp_accelerator_on_gpu_saves_through_stagesave(tmp_path, monkeypatch, fsdp_version):
    """One CUDA process with Accelerate's own FSDP selection (FSDP1 cannot be built on CPU)."""
    import stagesave.accelerate as sa
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    import stagesave

    for var, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29533",
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": fsdp_version,
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    }.items():
        monkeypatch.setenv(var, value)
    acc = Accelerator()
    assert acc.distributed_type == DistributedType.FSDP
    ckpt = sa.enable(acc)
    assert ckpt.asynchronous
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 64, device=acc.device)).sum())
    opt.step()
    before = {k: v.cpu().clone() for k, v in acc.get_state_dict(model).items()}
    acc.save_state(str(tmp_path / "ck"))
    ckpt.wait()
    for folder in ("", "pytorch_model_fsdp_0", "optimizer_0"):
        assert stagesave.verify(str(tmp_path / "ck" / folder)).status == "verified"
    acc.backward(model(torch.randn(4, 64, device=acc.device)).sum())
    opt.step()
    acc.load_state(str(tmp_path / "ck"))
    after = acc.get_state_dict(model)
    assert sorted(after) == sorted(before)
    assert all(torch.equal(before[k], after[k].cpu()) for k in before)
    sa.disable(acc)
