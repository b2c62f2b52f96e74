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

_SHM_ENV = "STAGESAVE_SHM_DIR"


def pytest_configure(config: pytest.Config) -> None:
    """The writer agents of the whole run (the default writer) keep their shared-memory
    segments in a folder of this run inside /dev/shm (a RAM filesystem, as in production),
    inherited by every child: a trainer a test SIGKILLs leaves its agent's snapshot there, not
    in /dev/shm itself. Removed at the end of the run. Tests that check what an agent leaves
    use the ``shm`` fixture (a folder of their own)."""
    if os.environ.get(_SHM_ENV):
        return  # the caller chose where
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="stagesave-tests-", dir=base)
    os.environ[_SHM_ENV] = d
    config.stash[_shm_key] = d


def pytest_unconfigure(config: pytest.Config) -> None:
    d = config.stash.get(_shm_key, None)
    if d is not None:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
        os.environ.pop(_SHM_ENV, None)


_shm_key = pytest.StashKey[str]()


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
