"""``writer="process"`` to S3: a trainer SIGKILLed after ``save()`` returned (issue 21).

The child (``_child_s3_agent.py``) saves to the loopback SeaweedFS through a writer agent and
is killed right after its last save returned, or a random moment into the background upload of
a multipart-sized checkpoint. The agent must complete every upload it was handed: each returned
save is an object on S3 that verifies and holds what the child saved, no multipart upload is
left open, ``latest()`` is the newest, and the agent exits leaving only that file's snapshot.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _child_s3_agent import state_of
from agentwatch import assert_only_snapshot_of, exited
from s3help import object_names, open_uploads

import stagesave

pytestmark = pytest.mark.s3

CHILD = Path(__file__).resolve().parent / "_child_s3_agent.py"


@pytest.mark.parametrize(
    ("saves", "mib", "mode", "seed"),
    [(3, 1, "after_return", 0), (2, 24, "after_return", 1), (2, 24, "during_write", 2)],
)
def test_trainer_sigkilled_after_save_to_s3_returned_every_returned_save_is_uploaded(
    s3_server: Any, s3_url: str, s3_options: dict[str, Any], shm: Path,
    saves: int, mib: int, mode: str, seed: int,
) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STAGESAVE_CRASH_AT", "STAGESAVE_AGENT", "STAGESAVE_WRITER"))}
    env.update(STAGESAVE_SHM_DIR=str(shm), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(CHILD), s3_url, json.dumps(s3_options), str(saves), str(mib), mode,
         str(seed)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    saved = [line.split(" ", 3) for line in proc.stdout.splitlines() if line.startswith("SAVED ")]
    assert [int(s[1]) for s in saved] == list(range(saves)), out[-3000:]
    agents = {s[2] for s in saved}
    assert len(agents) == 1 and agents != {"None"}, agents
    agent = int(agents.pop())
    paths = [s[3] for s in saved]
    assert paths == [f"{s3_url}/step-{i:03d}.ckpt" for i in range(saves)]

    assert exited(agent), f"the writer agent {agent} did not exit after its trainer died"
    assert_only_snapshot_of(shm, paths[-1])  # checked before any load, which may consume it

    # every returned save was published, and no upload was left open
    assert object_names(s3_server, s3_url) == [f"step-{i:03d}.ckpt" for i in range(saves)]
    assert open_uploads(s3_server, s3_url) == []
    with stagesave.Checkpointer(storage_options=s3_options) as ck:
        for path in paths:
            info = ck.verify(path)
            assert info.status == "verified", (path, info.status, info.problems)
        best = ck.latest(s3_url)
        assert best is not None and best.path == paths[-1]
        for i, path in enumerate(paths):  # the newest last: its load may use the snapshot
            loaded = ck.load(path, verify=True)
            want = state_of(i, mib)
            assert loaded["step"] == i
            assert torch.equal(loaded["w"], want["w"]) and torch.equal(loaded["b"], want["b"])
