"""Accelerate's FSDP save_state/load_state through stagesave.dcp: FSDP2 on 2 CPU processes (gloo).

Everything runs in one ``fsdp_worker.py`` run (one interpreter that forks the ranks of two
phases); each test asserts on what the ranks reported. What needs a GPU is at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PARTS = ["pytorch_model_fsdp_0", "optimizer_0"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "fsdp_worker.py"), str(out)], check=False,
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = {}
    for phase in ("save", "resume"):
        for r in (0, 1):
            path = out / f"{phase}-rank{r}.json"
            ranks[phase, r] = json.loads(path.read_text()) if path.exists() else {}
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(out.glob("*.log")))
    return {"out": out, "ranks": ranks, "exit": json.loads((out / "exit.json").read_text()), "logs": logs}


def _ok(run: dict[str, Any], phase: str, *keys: str) -> None:
    for r in (0, 1):
        rep = run["ranks"][phase, r]
        for key in keys:
            assert rep.get(key) == "ok", f"rank {r} {key}: {rep.get(key)}\n{rep.get('error', '')}\n{run['logs']}"


def test_staged_without_fallback_and_returns_before_the_commit(fsdp_run):
    for r in (0, 1):
        rep = fsdp_run["ranks"]["save", r]
        assert rep.get("asynchronous") is True, rep.get("error") or fsdp_run["logs"]
        assert rep["fallback_warnings"] == []
        assert rep["returned"].endswith("/staged")


def test_same_layout_and_contents_as_accelerate_fsdp_save(fsdp_run):
    rep = fsdp_run["ranks"]["save", 0]  # rank 0 compared the two folders
    assert rep.get("same_contents") == "ok", rep.get("same_contents") or rep.get("error")
    manifests = [f for f in rep["staged_tree"] if f.endswith("checkpoint.stagesave.json")]
    # one manifest for the folder, one per DCP part (each committed by stagesave.dcp)
    assert sorted(manifests) == sorted(["checkpoint.stagesave.json", *[f"{p}/checkpoint.stagesave.json" for p in PARTS]])
    assert sorted(f for f in rep["staged_tree"] if f not in manifests) == rep["plain_tree"]
    assert rep["plain_tree"] == sorted([
        "custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin",
        *[f"{p}/{f}" for p in PARTS for f in (".metadata", "__0_0.distcp", "__1_0.distcp")],
    ])
    assert rep["verify"] == "verified" and rep["parts_verify"] == ["verified", "verified"]
    assert rep["metadata"]["fsdp"] == {"parts": PARTS, "state_dict_type": "SHARDED_STATE_DICT", "fsdp_version": 2}
    assert rep["metadata"]["num_processes"] == 2


def test_bitwise_restore_and_interoperability_with_accelerate_both_ways(fsdp_run):
    _ok(fsdp_run, "save", "stagesave_restore", "plain_reads_stagesave", "stagesave_reads_plain")


def test_existing_explicit_folder_is_refused_on_every_rank(fsdp_run):
    for r in (0, 1):
        assert "already exists: stagesave publishes an FSDP checkpoint by renaming it into place" \
            in fsdp_run["ranks"]["save", r]["overwrite"]


def test_automatic_naming_total_limit_and_corrupt_part(fsdp_run):
    _ok(fsdp_run, "save", "auto_restore", "corrupt_skipped", "replaced_plain_restore")
    r0 = fsdp_run["ranks"]["save", 0]
    for r in (0, 1):
        rep = fsdp_run["ranks"]["save", r]
        # nothing but committed folders where Accelerate lists, nothing left in the work area
        assert rep["auto_listing"] == ["checkpoint_1", "checkpoint_2"]
        assert rep["auto_staging_left"] == []
        assert rep["auto_iteration"] == 3
        assert rep["corrupt_iteration"] == 2  # checkpoint_1 loaded
        assert rep["replaced_listing"] == ["checkpoint_1", "checkpoint_2"]
    assert any("skipping checkpoint" in w and "checkpoint_2" in w and "__1_0.distcp: checksum mismatch" in w
               for w in r0["corrupt_warnings"]), r0["corrupt_warnings"]
    assert any("replacing the invalid checkpoint" in w for w in r0["replace_warnings"]), r0["replace_warnings"]


def test_rank_killed_mid_save_leaves_the_previous_checkpoint_for_plain_accelerate_and_stagesave(fsdp_run):
    assert fsdp_run["exit"]["save"][0] == -9, fsdp_run["logs"]  # the crash point fired on rank 0
    assert fsdp_run["ranks"]["save", 0].get("crash_armed") and not fsdp_run["ranks"]["save", 1].get("crash_missed")
    assert fsdp_run["exit"]["resume"] == [0, 0], fsdp_run["logs"]
    _ok(fsdp_run, "resume", "plain_resume", "stagesave_resume")
    for r in (0, 1):
        rep = fsdp_run["ranks"]["resume", r]
        assert rep["listing"] == ["checkpoint_0"]  # nothing of the killed save where Accelerate lists
        assert len(rep["staging"]) == 1 and rep["staging"][0].startswith(".checkpoint_1.")  # debris for gc
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

    for var, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29533", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": fsdp_version,
                       "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}.items():
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
