"""Fixtures of the CLI tests: the command line run in-process, and real checkpoints to run it on."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from clitools import CliRun


@pytest.fixture
def cli(capsys):
    """``cli("ls", root)`` runs ``stagesave -q ls root`` in this process; returns code/out/err."""
    from stagesave.cli import main

    def run(*argv: object) -> CliRun:
        capsys.readouterr()
        code = main(["-q", *map(str, argv)])
        out, err = capsys.readouterr()
        return CliRun(code, out, err)

    return run


@pytest.fixture
def cli_s3(s3_url, s3_options):
    """A fresh ``s3://`` prefix on the loopback server (tests/s3server.py), the CLI options
    that reach it, and its storage_options."""
    cli_options = ["--endpoint-url", s3_options["endpoint_url"], "--retries", "3"]
    for k, v in s3_options.items():
        if k != "endpoint_url":
            cli_options += ["-o", f"{k}={v}"]
    return s3_url, cli_options, s3_options


#: Debris templates: (folder, checkpoint name, crash point, mode of the crashing child).
#: "data": killed with its data written, no proof yet; "proof": killed with the file complete and
#: sealed with its proof, just before the rename that publishes it.
CRASHES = {
    "data": ("crashed.ckpt", "after_data", "file"),
    "proof": ("crashed.ckpt", "after_proof", "file"),
    "replace": ("last.ckpt", "after_proof:2", "replace"),
    "dir_data": ("checkpoint_5", "after_data:3", "dir"),
    "dir_aside": ("checkpoint_5", "after_aside", "dir_noexchange"),
}


@pytest.fixture(scope="session")
def crashed(tmp_path_factory):
    """Folders holding what real SIGKILLed saves left behind (children run in parallel, once).

    ``crashed(kind, dest)`` copies template ``kind`` (a key of ``CRASHES``) into ``dest``,
    keeping modification times.
    """
    import shutil

    from clitools import crash_saves

    base = tmp_path_factory.mktemp("crashed")
    scenarios = []
    for kind, (name, point, mode) in CRASHES.items():
        (base / kind).mkdir()
        scenarios.append((str(base / kind), mode, name, point))
    signals = crash_saves(scenarios)
    assert signals == [9] * len(scenarios), (
        f"not every child was killed at its crash point: {signals}"
    )

    def copy(kind: str, dest) -> None:
        shutil.copytree(base / kind, dest, symlinks=True, dirs_exist_ok=True)

    return copy
