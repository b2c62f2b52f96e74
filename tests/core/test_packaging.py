"""The integrations install as stagesave.lightning / stagesave.accelerate, editable or not."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_editable_install_maps_integrations():
    import stagesave.accelerate
    import stagesave.lightning

    assert (
        Path(stagesave.lightning.__file__).resolve().parent == ROOT / "integrations" / "lightning"
    )
    assert (
        Path(stagesave.accelerate.__file__).resolve().parent == ROOT / "integrations" / "accelerate"
    )


def test_core_never_imports_the_frameworks():
    code = (
        "import sys, stagesave, stagesave.checkpointer; print(sorted(m for m in sys.modules if "
        "m.split('.')[0] in ('lightning', 'pytorch_lightning', 'accelerate', 's3fs')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_regular_install_from_a_wheel(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if r.returncode != 0 and "No matching distribution" in r.stderr:
        pytest.skip(f"cannot fetch the build backend here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr
    [wheel] = list(tmp_path.glob("stagesave-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    for expected in (
        "stagesave/__init__.py",
        "stagesave/py.typed",
        "stagesave/lightning/__init__.py",
        "stagesave/accelerate/__init__.py",
        "stagesave/dcp/__init__.py",
        "stagesave/cli/__init__.py",
        "stagesave/agent/__init__.py",
        "stagesave/agent/serve.py",
    ):
        assert expected in names, expected
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    code = (
        "import stagesave, stagesave.lightning, stagesave.accelerate, stagesave.agent.serve; "
        "print(stagesave.lightning.__file__); print(stagesave.agent.serve.__file__)"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r}); {code}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    for line in out.stdout.split():
        assert line.startswith(str(tmp_path / "site")), line
