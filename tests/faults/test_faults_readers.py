"""Readers in other processes while checkpoints are replaced in a loop, locally and on S3.

A writer process replaces ``last.ckpt`` and the folder ``folder/`` again and again; a reader
process meanwhile loads ``last.ckpt``, ``latest()`` + ``load()``, and ``folder/optimizer.bin``,
each with verification. Every file carries its own proof and is read through one descriptor (one
ETag on S3), so every load must return one whole version: zero errors. The default run lasts
``STAGESAVE_RW_SECONDS`` (10 s); the slow variant a minute, as the issue asks.

Two processes saving ``last.ckpt`` on S3 at once, round after round: each round ends with a
``last.ckpt`` that verifies and is one of the two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import faultstats
import pytest
import torch

import stagesave

CHILD = os.path.join(os.path.dirname(__file__), "rwchild.py")
SECONDS = float(os.environ.get("STAGESAVE_RW_SECONDS", "10"))


def _start(
    role: str, root: str, seconds: float, options: dict[str, object], *extra: str
) -> subprocess.Popen[str]:
    env = dict(os.environ, STAGESAVE_RW_OPTIONS=json.dumps(options))
    return subprocess.Popen([sys.executable, CHILD, role, root, str(seconds), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen[str]) -> dict[str, object]:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert "crashed" not in result, result["crashed"]
    return result


def _readers_while_replaced(root: str, seconds: float, options: dict[str, object]) -> None:
    writer = _start("writer", root, seconds + 2, options)
    reader = _start("reader", root, seconds, options)
    got = _result(reader)
    wrote = _result(writer)
    counts = got["counts"]
    faultstats.record(
        "readers while another process replaces (loads)", sum(counts.values()), got["n_errors"]
    )
    assert got["n_errors"] == 0, got["errors"]
    assert wrote["saves"] >= 10, wrote  # really replaced, again and again
    assert min(counts.values()) >= 5, counts  # every kind of read really happened


def test_readers_while_another_process_replaces_locally(tmp_path):
    _readers_while_replaced(str(tmp_path), SECONDS, {})


@pytest.mark.s3
def test_readers_while_another_process_replaces_on_s3(s3_url, s3_options):
    _readers_while_replaced(s3_url, SECONDS, s3_options)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_readers_while_another_process_replaces_for_a_minute(tmp_path, request, where):
    if where == "s3":
        url, options = request.getfixturevalue("s3_url"), request.getfixturevalue("s3_options")
    else:
        url, options = str(tmp_path), {}
    _readers_while_replaced(url, 60.0, options)


@pytest.mark.s3
def test_two_processes_saving_the_same_name_on_s3(s3_url, s3_options):
    """Rounds of two processes saving last.ckpt at once: after each round it verifies and holds
    one of the two states, whole."""
    rounds = max(3, int(SECONDS // 3))
    checked = 0
    for r in range(rounds):
        a = _start("saver", s3_url, 2.0, s3_options, f"A{r}")
        b = _start("saver", s3_url, 2.0, s3_options, f"B{r}")
        ra, rb = _result(a), _result(b)
        assert ra["saves"] > 0 and rb["saves"] > 0 and not ra["failures"] and not rb["failures"], (
            ra,
            rb,
        )
        with stagesave.Checkpointer(s3_url, storage_options=s3_options) as ck:
            info = ck.verify("last.ckpt")
            assert info.status == "verified", info.problems
            state = ck.load("last.ckpt")
            assert state["tag"] in (f"A{r}", f"B{r}")
            assert torch.equal(state["w"], torch.full((50_000,), float(state["step"])))
            best = ck.latest()
            assert best is not None and best.name == "last.ckpt"
        checked += 1
    faultstats.record("two writers of one name on S3 (rounds)", checked, 0)
