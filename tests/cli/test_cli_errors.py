"""The error policy: one clear line and a non-zero exit, a traceback only with --debug; the real
entry points (`python -m stagesave`, the `stagesave` console script)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
from clitools import write_checkpoints, write_format1

from stagesave.errors import IntegrityError


def _run(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "stagesave", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        **kw,
    )


def test_python_m_stagesave_and_console_script(tmp_path):
    r = _run("--help")
    assert r.returncode == 0
    for cmd in (
        "plan",
        "ls",
        "inspect",
        "verify",
        "export",
        "adopt",
        "migrate",
        "gc",
        "bench",
        "report",
    ):
        assert cmd in r.stdout
    script = os.path.join(os.path.dirname(sys.executable), "stagesave")
    r = subprocess.run([script, "verify", tmp_path / "nope.ckpt"], capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == f"stagesave: error: no such file or folder: {tmp_path / 'nope.ckpt'}\n"


def test_one_line_error_and_debug_traceback(cli, tmp_path):
    path = write_checkpoints(tmp_path, steps=(1,))[0]
    with open(path, "r+b") as f:
        f.truncate(1000)
    r = cli("export", path, tmp_path / "out.ckpt")
    assert r.code == 1
    assert r.err.startswith(f"stagesave: error: {path} is corrupt:") and r.err.count("\n") == 1
    assert r.out == ""
    with pytest.raises(
        IntegrityError, match="is corrupt"
    ):  # --debug: the exception itself, with its traceback
        cli("--debug", "export", path, tmp_path / "out.ckpt")


def test_usage_errors_exit_2(cli, capsys):
    with pytest.raises(SystemExit) as e:
        cli("--version")
    assert e.value.code == 0 and capsys.readouterr().out == "stagesave 0.1.0\n"
    with pytest.raises(SystemExit) as e:
        cli("no-such-command")
    assert e.value.code == 2
    r = cli("-o", "novalue", "plan", "70B")
    assert r.code == 2 and "expected KEY=VALUE" in r.err


def test_unreachable_endpoint(cli):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = cli(
        "--retries",
        "1",
        "--endpoint-url",
        f"http://127.0.0.1:{port}",
        "-o",
        "key=k",
        "-o",
        "secret=s",
        "ls",
        "s3://bucket/ckpt",
    )
    assert r.code == 1
    assert r.err.startswith("stagesave: error: ") and r.err.count("\n") == 1
    assert "Could not connect" in r.err and f"127.0.0.1:{port}" in r.err
    assert "secret=s" not in r.err


def test_corrupt_manifest_is_named(cli, tmp_path):
    path, sidecar = write_format1(tmp_path, "old.ckpt", {"w": torch.ones(3)})
    with open(sidecar, "w") as f:
        f.write('{"format": "stagesave", "schema": 1, "files": "nope"')
    rows = cli("ls", tmp_path, "--json").json()
    assert rows[0]["status"] == "corrupt" and "not valid JSON" in rows[0]["problems"][0]
    r = cli("verify", path)
    assert r.code == 1 and f"invalid manifest {sidecar}: not valid JSON" in r.err


def test_corrupt_proof_is_named(cli, tmp_path):
    path = write_checkpoints(tmp_path, steps=(1,))[0]
    with open(path, "r+b") as f:  # the summary at the very end: its footer's CRC no longer matches
        f.seek(-40, os.SEEK_END)
        b = f.read(1)
        f.seek(-40, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    rows = cli("ls", tmp_path, "--json").json()
    assert rows[0]["status"] == "corrupt" and "footer is damaged" in rows[0]["problems"][0]
    r = cli("verify", path)
    assert r.code == 1 and r.err.startswith(
        f"stagesave: error: {path}: its stagesave footer is damaged"
    )
    r = cli("inspect", path, "--json")  # the summary is printed, and the exit says corrupt
    assert r.code == 1 and r.json()["status"] == "corrupt" and r.json()["tensors"] == []
    assert r.err.startswith(f"stagesave: error: {path} is corrupt: ") and r.err.count("\n") == 1


def test_error_line_prints_names_literally(cli, tmp_path):
    r = cli("verify", tmp_path / "no\x1b[2Jsuch.ckpt")
    assert r.code == 1 and "\x1b" not in r.err and "no\\x1b[2Jsuch.ckpt" in r.err


def test_a_file_that_is_not_a_checkpoint(cli, tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"\x80\x02 this is not really a pickle" * 4)
    r = cli("verify", tmp_path / "model.ckpt")
    assert r.code == 1 and "cannot be read as a torch file" in r.err
