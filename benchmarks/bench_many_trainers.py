"""Many Trainers in one process (a sweep, a notebook): live threads and RSS after each.

Runs ``tests/lightning/many_trainers.py`` in a fresh child per configuration: N Trainers, one
after another, each fitting a 48 MiB state (weights and Adam moments) with ``ModelCheckpoint``
and saving once more after ``fit``. Configurations, side by side in one run:

- ``torch``: Lightning's default ``TorchCheckpointIO`` (the reference: nothing to leak);
- ``staged``: ``StagedCheckpointIO`` from this checkout;
- ``staged@REV`` (``--before REV``): the plugin as it was at git revision ``REV``, extracted with
  ``git archive`` and put first on ``PYTHONPATH``.

The child fixes glibc's mmap threshold at 1 MiB, so RSS shows live memory rather than the
allocator's cache. Writes a Markdown table (``--out``) and prints it.

Usage: python benchmarks/bench_many_trainers.py [--runs 100] [--before 0c33bef --before-runs 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "lightning" / "many_trainers.py"


def checkout_of(rev: str, into: Path) -> Path:
    """The ``stagesave`` package (with its Lightning adapter) as it was at ``rev``."""
    tree = into / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src", "integrations"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    pkg = into / "path" / "stagesave"
    shutil.copytree(tree / "src" / "stagesave", pkg)
    shutil.copytree(tree / "integrations" / "lightning", pkg / "lightning")
    return into / "path"


def run(io: str, runs: int, path: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = f"{path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    with tempfile.TemporaryDirectory(prefix="many-trainers-") as d:
        out = subprocess.run(
            [sys.executable, str(CHILD), "--runs", str(runs), "--io", io, "--dir", d],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    if out.returncode != 0:
        raise SystemExit(f"{io} failed:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def row(name: str, r: dict[str, Any]) -> str:
    mib = 2**20
    rss, threads, secs = r["rss"], r["threads"], r["seconds"]
    n = len(rss)
    per = (rss[-1] - rss[0]) / max(1, n - 1) / mib
    return (
        f"| {name} | {n} | {threads[0]} | {threads[-1]} | {max(threads)} | {rss[0] / mib:,.0f} | "
        f"{rss[-1] / mib:,.0f} | {(max(rss) - rss[0]) / mib:,.0f} | {per:,.1f} | "
        f"{sum(secs) / n:.2f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--before", help="a git revision to compare with (its plugin, same child)")
    p.add_argument(
        "--before-runs", type=int, default=30, help="trainers for --before (it may leak GiBs)"
    )
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "many-trainers.md")
    a = p.parse_args()
    rows = [
        ("TorchCheckpointIO", run("torch", a.runs, None)),
        ("StagedCheckpointIO", run("staged", a.runs, None)),
    ]
    if a.before:
        with tempfile.TemporaryDirectory(prefix="stagesave-before-") as d:
            rows.append(
                (
                    f"StagedCheckpointIO @ {a.before}",
                    run("staged", a.before_runs, checkout_of(a.before, Path(d))),
                )
            )
    state = rows[0][1]["state_bytes"] / 2**20
    lines = [
        (
            f"Trainers fitted one after another in one process, each with a {state:.0f} MiB state "
            "(ModelCheckpoint every step, top-1, plus a save after fit); threads = live "
            "`stagesave-*` threads, RSS in MiB after each trainer (glibc mmap threshold fixed at 1 "
            "MiB)."
        ),
        "",
        (
            "| IO | trainers | threads after 1st | after last | max | RSS after 1st | after last | "
            "max growth | growth per trainer | s per trainer |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
        *(row(name, r) for name, r in rows),
        "",
        f"`{' '.join(['python', 'benchmarks/bench_many_trainers.py', *sys.argv[1:]])}`",
    ]
    text = "\n".join(lines) + "\n"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
