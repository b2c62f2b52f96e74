"""One process of ``accelerate launch --num_processes 2 -m stagesave.accelerate mp_worker.py OUT``.

The script never mentions stagesave's enable(): the ``-m stagesave.accelerate`` runner turns it
on. Each process writes what it observed to ``OUT/rank<N>.json``; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import traceback

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accel_helpers import assert_same, build, snapshot, train


def check(result: dict, key: str, fn) -> None:
    try:
        fn()
        result[key] = "ok"
    except Exception:  # noqa: BLE001 - reported to the test
        result[key] = traceback.format_exc()


def main(out: str) -> None:
    root = os.path.join(out, "run")
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=root, automatic_checkpoint_naming=True, total_limit=2))
    rank = acc.process_index
    run = build(acc)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(1000 + rank)  # every process has its own RNG streams
    import stagesave.accelerate as sa

    ckpt = sa.enabled(acc)
    result: dict = {
        "rank": rank,
        "distributed_type": str(acc.distributed_type),
        "num_processes": acc.num_processes,
        "enabled_by_runner": ckpt is not None and ckpt.asynchronous,
        "max_pending_from_env": ckpt.options.max_pending if ckpt else None,
    }
    before = None
    for i in range(3):
        train(acc, run, 1)
        if i == 2:
            before = snapshot(acc, run)
        acc.save_state()
    train(acc, run, 3)
    acc.load_state()
    result["iteration"] = acc.project_configuration.iteration
    check(result, "stagesave_restore", lambda: assert_same(before, snapshot(acc, run)))
    folder = os.path.join(root, "checkpoints", "checkpoint_2")
    result["folders"] = sorted(n for n in os.listdir(os.path.join(root, "checkpoints")) if not n.startswith("."))
    result["files"] = sorted(os.listdir(folder))
    train(acc, run, 2)
    Accelerator.load_state(acc, folder)  # Accelerate's own load_state, in every process
    check(result, "plain_restore", lambda: assert_same(before, snapshot(acc, run)))
    # save_on_each_node: every node's local main writes the folder, with every rank's RNG states
    config = acc.project_configuration
    config.automatic_checkpoint_naming, config.save_on_each_node = False, True
    each = os.path.join(out, "each_node")
    before_each = snapshot(acc, run)
    acc.save_state(each)
    ckpt.wait()
    acc.wait_for_everyone()
    result["each_node_files"] = sorted(os.listdir(each))
    train(acc, run, 1)
    acc.load_state(each)
    check(result, "each_node_restore", lambda: assert_same(before_each, snapshot(acc, run)))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
