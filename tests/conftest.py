"""Shared fixtures: real files in temporary directories, small real states."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
pytest_plugins = ["s3server"]

torch.manual_seed(0)


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's folder for writer agents' shared-memory segments (``STAGESAVE_SHM_DIR``,
    inherited by its children), with ``STAGESAVE_WRITER`` unset; emptied at the end."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("STAGESAVE_SHM_DIR", str(d))
    monkeypatch.delenv("STAGESAVE_WRITER", raising=False)
    yield d
    for p in d.iterdir():
        p.unlink(missing_ok=True)


@pytest.fixture
def thread_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``STAGESAVE_WRITER=thread`` for this test and its children: for tests that inject a fault
    into the write path of the training process itself (a named crash point, a wrapped POSIX
    call, a writer gate, a patched device copy), which the default writer agent, another
    process, would not reach. The agent's own faults are tested in test_writer_agent.py and
    the framework ``*_writer_agent`` tests."""
    monkeypatch.setenv("STAGESAVE_WRITER", "thread")


@pytest.fixture
def ckpt_dir(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(
            reason="needs a CUDA device; this machine has none (GPU path untested here)"
        )
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
