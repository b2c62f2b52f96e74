"""Two CPU processes over gloo (DDP-style state), forked by ``dist_worker.py`` (phase ``ddp``),
with stagesave turned on by ``enable_globally()`` (what ``python -m stagesave.accelerate`` does)
and configured through the environment. ``test_example.py`` runs the same under
``accelerate launch -m stagesave.accelerate``."""

from __future__ import annotations


def test_two_processes_bitwise_restore_and_plain_interop(worker_runs):
    assert worker_runs.exit["ddp"] == [0, 0], worker_runs.logs("ddp")
    worker_runs.ok("ddp", "stagesave_restore", "plain_restore", "each_node_restore")
    results = [worker_runs.rank("ddp", r) for r in (0, 1)]
    for r in results:
        assert r["distributed_type"] == "DistributedType.MULTI_CPU" and r["num_processes"] == 2
        assert r["enabled_by_runner"] is True
        assert r["max_pending_from_env"] == 1
        assert r["iteration"] == 3
        assert r["folders"] == ["checkpoint_1", "checkpoint_2"]  # hidden entries included: none
        assert r["each_node_files"] == results[0]["files"]
    assert results[0]["bad_zips"] == []  # every torch file is a real zip (testzip passes)
    assert results[0]["files"] == sorted(
        [  # exactly Accelerate's files: each carries its own proof
            "model.safetensors",
            "optimizer.bin",
            "scheduler.bin",
            "random_states_0.pkl",
            "random_states_1.pkl",
            "custom_checkpoint_0.pkl",
            "custom_checkpoint_1.pkl",
        ]
    )
