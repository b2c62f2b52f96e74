"""`report` on the telemetry of a real run (PNG checked to be a real image), and `bench`."""

from __future__ import annotations

import json
import os

import pytest
import torch
from clitools import small_state

import stagesave
from stagesave.ondisk.names import TELEMETRY_FILE


@pytest.fixture
def run_with_telemetry(tmp_path):
    """A real run: 4 saves of a real state with telemetry JSON lines, one of them a folder."""
    from stagesave.formats import Safetensors

    root = tmp_path / "run"
    with stagesave.Checkpointer(root, telemetry_jsonl=True, keep_last=2) as ck:
        for step in (1, 2, 3):
            ck.save(small_state(step), f"step={step}.ckpt").result()
        ck.save_dir(
            {"model.safetensors": Safetensors({"w": torch.ones(1000)})}, "checkpoint_4"
        ).result()
    return root


def test_report_summary_and_png(cli, run_with_telemetry, tmp_path):
    png = tmp_path / "timeline.png"
    r = cli("report", run_with_telemetry, "--png", png, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    lines = [json.loads(x) for x in (run_with_telemetry / TELEMETRY_FILE).read_text().splitlines()]
    assert doc["saves"] == len(lines) == 4 and doc["failed"] == 0
    assert doc["bytes_total"] == sum(x["bytes"] for x in lines)
    stalls = sorted(x["blocking_s"] for x in lines)
    assert doc["stall_max_s"] == stalls[-1]
    assert doc["stall_median_s"] == pytest.approx((stalls[1] + stalls[2]) / 2)
    assert doc["commit_max_s"] == max(x["time_to_commit_s"] for x in lines)
    # a real PNG that decodes to an image of the size drawn
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    img = imread(str(png))
    assert img.ndim == 3 and 800 <= img.shape[1] <= 1100 and img.shape[0] >= 200
    assert img[..., :3].std() > 0.01  # not a blank canvas
    text = cli("report", run_with_telemetry, "--png", png).out
    assert "training stall per save" in text and "4 saves" in text and str(png) in text


def test_report_skips_torn_lines_and_accepts_the_file(
    cli, run_with_telemetry, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    f = run_with_telemetry / TELEMETRY_FILE
    with open(f, "a") as fh:
        fh.write('{"path": "/x", "started_at": 1')  # torn by a crash while appending
    r = cli("report", f, "--no-png", "--json")
    assert r.code == 0 and r.json()["unreadable_lines"] == 1 and r.json()["saves"] == 4
    assert not (tmp_path / "stagesave-timeline.png").exists()
    assert (
        cli("report", f).code == 0 and (tmp_path / "stagesave-timeline.png").exists()
    )  # the default


def test_report_errors(cli, tmp_path):
    r = cli("report", tmp_path, "--no-png")
    assert (
        r.code == 1
        and f"no {TELEMETRY_FILE} in {tmp_path}" in r.err
        and "telemetry_jsonl=True" in r.err
    )
    (tmp_path / TELEMETRY_FILE).write_text("garbage\n")
    r = cli("report", tmp_path, "--no-png")
    assert r.code == 1 and "records no saves (1 unreadable lines)" in r.err


def test_bench_quick(cli, tmp_path):
    r = cli("bench", tmp_path, "--size", "2MB", "--repeat", "2", "--warmup", "0", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert 1.9e6 <= doc["state_bytes"] <= 2.6e6
    methods = {x["method"]: x for x in doc["results"]}
    assert set(methods) == {"torch.save+fsync", "stagesave"}
    floors = doc["floors"]
    assert floors["copy_s"] > 0 and floors["disk_s"] > 0 and isinstance(floors["disk_direct"], bool)
    for x in methods.values():
        assert x["runs"] == 2 and 0 < x["blocking_s"] <= x["durable_s"] and x["durable"] is True
        assert "lost_s" not in x  # only with --loop
        assert x["blocking_x_copy_floor"] == pytest.approx(x["blocking_s"] / floors["copy_s"])
        assert x["durable_x_disk_floor"] == pytest.approx(x["durable_s"] / floors["disk_s"])
    assert doc["skipped"] == []
    assert os.listdir(tmp_path) == []  # cleaned up after itself
    text = cli("bench", tmp_path, "--size", "1MB", "--repeat", "1", "--warmup", "1").out
    assert "training blocked" in text and "stagesave" in text and "training lost" not in text
    assert "copy floor" in text and "disk floor" in text


def test_bench_loop_reports_training_time_lost(cli, tmp_path, capsys):
    r = cli(
        "bench", tmp_path, "--size", "8MB", "--repeat", "2", "--warmup", "1", "--loop", "--json"
    )
    assert r.code == 0, r.err
    methods = {x["method"]: x for x in r.json()["results"]}
    assert set(methods) == {"torch.save+fsync", "stagesave"}
    for x in methods.values():
        assert x["runs"] == 2
        # lost is the blocking time plus what the loop lost meanwhile: never less, and not past
        # durable by more than the step that was running when the save completed
        assert (
            0 < x["blocking_s"] <= x["lost_s"] <= x["durable_s"] + 5 * x["loop_ms_per_step"] / 1e3
        )
        assert x["step_mean_x"] > 0 and x["step_p99_x"] > 0 and 0 < x["loop_ms_per_step"] < 5000
    plain = methods["torch.save+fsync"]
    assert plain["lost_s"] == plain["blocking_s"]  # synchronous: training waits for all of it
    assert plain["step_mean_x"] == plain["step_p99_x"] == 1.0
    assert os.listdir(tmp_path) == []
    text = cli("bench", tmp_path, "--size", "1MB", "--repeat", "1", "--warmup", "0", "--loop").out
    assert "training lost" in text and "ms per step at baseline" in text
    with pytest.raises(SystemExit):
        cli("bench", "--help")
    assert "bench_sweep.py" in capsys.readouterr().out  # the help points to the full harness


def test_bench_synthetic_state_is_transformer_like():
    # the workload itself, not a command: its module is the one place that builds it
    from stagesave.cli._bench_state import state_bytes, synthetic_state

    s = synthetic_state(40e6)
    assert 30e6 <= state_bytes(s) <= 50e6
    assert any(k.endswith("attn.qkv.weight") for k in s["model"])
    assert set(next(iter(s["optimizer"]["state"].values()))) == {"step", "exp_avg", "exp_avg_sq"}


def test_bench_errors(cli, tmp_path):
    r = cli("bench", tmp_path / "missing")
    assert r.code == 1 and "is not a folder" in r.err
    r = cli("bench", tmp_path, "--size", "10")
    assert r.code == 2 and "at least 100 kB" in r.err
    r = cli("bench", tmp_path, "--size", "100TB")  # refused before anything is allocated
    assert (
        r.code == 2 and "does not fit in memory here" in r.err and "pick a smaller --size" in r.err
    )
    r = cli("bench", tmp_path, "--alternatives", "stagesave,torch.load")
    assert (
        r.code == 2
        and "unknown alternatives ['torch.load']" in r.err
        and "dcp.async_save thread" in r.err
    )
    r = cli("bench")
    assert r.code == 2 and "needs a target folder or URL" in r.err
    r = cli("bench", tmp_path, "--alternatives", "dcp.async_save process (pinned+shm stager)")
    if (
        not torch.cuda.is_available()
    ):  # the only chosen alternative cannot run: say why, measure nothing
        assert (
            r.code == 1
            and "none of the chosen alternatives can run here" in r.err
            and "needs CUDA" in r.err
        )
    assert os.listdir(tmp_path) == []


def test_report_counts_remote_uploads_apart(cli, run_with_telemetry):
    f = run_with_telemetry / TELEMETRY_FILE
    with open(f, "a") as fh:  # what a TieredStore upload records: it never blocks training
        fh.write(
            json.dumps(
                {
                    "path": "s3://b/step=3.ckpt",
                    "started_at": 2e9,
                    "blocking_s": 99.0,
                    "tier": "remote",
                    "time_to_commit_s": 4.0,
                    "committed_at": 2e9 + 4,
                }
            )
            + "\n"
        )
    doc = cli("report", f, "--no-png", "--json").json()
    assert doc["saves"] == 4 and doc["remote_uploads"] == 1 and doc["stall_max_s"] < 99.0
    assert "uploads to the remote tier" in cli("report", f, "--no-png").out


def test_every_alternative_really_saves_the_state(tmp_path):
    """Each alternative of `stagesave bench` writes a checkpoint its own loader reads back equal."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "benchalts_child.py"), tmp_path],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    saved = json.loads(r.stdout.strip().splitlines()[-1])
    expected = {
        "torch.save+fsync",
        "dcp.async_save thread",
        "dcp.async_save thread (reused stager)",
        "dcp.async_save process",
        "dcp.async_save process (shm stager)",
        "stagesave",
        "stagesave checksum_in=staging",
        "stagesave checksum_in=background",
        "stagesave writer=process",
        "stagesave writer=thread",
        "lightning AsyncCheckpointIO",
        "accelerate save_state",
    }  # contributed by the integrations
    if torch.cuda.is_available():
        expected.add("dcp.async_save process (pinned+shm stager)")
    assert set(saved) == expected
    assert all(saved.values()), saved


def test_bench_all_alternatives(tmp_path):
    """`stagesave bench --alternatives all`, as a user runs it (the installed entry points)."""
    import shutil
    import subprocess

    exe = shutil.which("stagesave") or os.path.join(
        os.path.dirname(__import__("sys").executable), "stagesave"
    )
    r = subprocess.run(
        [
            exe,
            "-q",
            "bench",
            tmp_path,
            "--size",
            "2MB",
            "--repeat",
            "2",
            "--alternatives",
            "all",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    listed = json.loads(
        subprocess.run(
            [exe, "bench", "--list", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )["alternatives"]
    runnable = {a["name"] for a in listed if a["unavailable"] is None}
    assert {"lightning AsyncCheckpointIO", "accelerate save_state"} <= runnable
    assert {x["method"] for x in doc["results"]} == runnable
    assert {s["method"] for s in doc["skipped"]} == {a["name"] for a in listed} - runnable
    for x in doc["results"]:
        assert x["runs"] == 2 and 0 < x["blocking_s"] <= x["durable_s"], x
    durable = {x["method"]: x["durable"] for x in doc["results"]}
    assert durable["lightning AsyncCheckpointIO"] is False and durable["stagesave"] is True
    assert os.listdir(tmp_path) == []
    # without a warm-up save DCP's process mode must still start its daemon on the measured save
    r = subprocess.run(
        [
            exe,
            "-q",
            "bench",
            tmp_path,
            "--size",
            "2MB",
            "--repeat",
            "1",
            "--warmup",
            "0",
            "--json",
            "--alternatives",
            "dcp.async_save process,dcp.async_save process (shm stager)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert {x["method"] for x in json.loads(r.stdout)["results"]} == {
        "dcp.async_save process", "dcp.async_save process (shm stager)"}
    assert os.listdir(tmp_path) == []


class _Broken:
    """An alternative that fails the way a broken plugin would: its save raises, then its
    teardown."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        with open(os.path.join(folder, "half-written"), "wb") as f:
            f.write(b"x" * 100)

    def start(self, state, path):
        raise RuntimeError("boom in save")

    def check(self) -> None:
        pass

    def close(self) -> None:
        raise OSError("boom in teardown")


def test_a_failing_alternative_is_named_and_leaves_nothing(tmp_path, capsys):
    import argparse

    from stagesave.cli._bench_round import BenchTarget, Timing, measure_round
    from stagesave.cli._common import CliError, Env

    # one bench round with a broken alternative (the command cannot be made to run one)
    from stagesave.cli.alternatives import Alternative

    env = Env()
    target = BenchTarget(env, str(tmp_path))
    args = argparse.Namespace(warmup=1)
    broken = Alternative("broken", lambda folder, options: _Broken(folder), 1.0, True, True, "")
    with pytest.raises(CliError, match=r"^broken failed: RuntimeError: boom in save$") as info:
        measure_round(env, target, broken, {}, args, None, Timing("broken"), lambda n: None, 1)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "tearing down broken also failed: boom in teardown" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # its folder and what it wrote are gone

    def cannot_start(folder, options):
        raise ValueError("no such backend")

    unbuildable = Alternative("unbuildable", cannot_start, 1.0, False, True, "")
    with pytest.raises(CliError, match="unbuildable failed: ValueError: no such backend"):
        measure_round(
            env, target, unbuildable, {}, args, None, Timing("unbuildable"), lambda n: None, 1
        )
    assert os.listdir(tmp_path) == []
