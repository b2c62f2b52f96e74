"""``accelerate launch --num_processes 2`` on CPU (gloo), with stagesave enabled without a code
change by ``-m stagesave.accelerate`` and configured through the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")


def launch_args(n: int) -> list[str]:
    """``accelerate launch`` for ``n`` CPU processes.

    ``--multi_gpu`` makes it start torchrun; on a machine without GPUs the script's
    ``Accelerator(cpu=True)`` then runs MULTI_CPU over gloo (``--cpu`` would start one process).
    """
    multi = ["--multi_gpu"] if n > 1 else ["--cpu"]
    return [ACCELERATE, "launch", *multi, "--num_processes", str(n), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]


def test_two_processes_bitwise_restore_and_plain_interop(tmp_path):
    env = {**os.environ, "STAGESAVE_ACCELERATE_MAX_PENDING": "1", "OMP_NUM_THREADS": "1"}
    cmd = [*launch_args(2), "-m", "stagesave.accelerate", os.path.join(HERE, "mp_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["distributed_type"] == "DistributedType.MULTI_CPU" and r["num_processes"] == 2
        assert r["enabled_by_runner"] is True
        assert r["max_pending_from_env"] == 1
        assert r["stagesave_restore"] == "ok", r["stagesave_restore"]
        assert r["plain_restore"] == "ok", r["plain_restore"]
        assert r["iteration"] == 3
        assert r["folders"] == ["checkpoint_1", "checkpoint_2"]
        assert r["each_node_restore"] == "ok", r["each_node_restore"]
        assert r["each_node_files"] == results[0]["files"]
    assert results[0]["files"] == sorted([
        "checkpoint.stagesave.json", "model.safetensors", "optimizer.bin", "scheduler.bin",
        "random_states_0.pkl", "random_states_1.pkl", "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl",
    ])
