"""Measure the shape of the code base: the figures of the restructure's before/after table.

Usage: ``.venv/bin/python scripts/house_metrics.py [--json]`` from the repository root.

- lines per product module (the largest), adapter sizes (lines and files per integration);
- the path of one save: which product files its calls pass through, from ``Checkpointer.save``
  (and from the Lightning plugin's ``save_checkpoint``) to the committed file, on the caller's
  and the writer's threads: "stops" are the entries into a different file than the one calling,
  "re-entries" how often the most-visited file is entered again;
- private names imported across modules (``from .x import _y``), plain ``RuntimeError`` raised
  by the product, ruff and mypy findings.
"""

from __future__ import annotations

import ast
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = (ROOT / "src" / "stagesave", ROOT / "integrations")


def product_files() -> list[Path]:
    return sorted(p for base in PRODUCT for p in base.rglob("*.py"))


def rel(p: Path | str) -> str:
    return os.path.relpath(p, ROOT)


def line_counts() -> dict[str, int]:
    return {rel(p): sum(1 for _ in p.open(encoding="utf-8")) for p in product_files()}


def private_imports() -> list[str]:
    """Private names (``_x``, not modules of the importing package) that a product module
    imports from another stagesave module; third-party private names are counted apart."""
    found = []
    for p in product_files():
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            ours = node.level > 0 or (node.module or "").startswith("stagesave")
            for alias in node.names:
                if not alias.name.startswith("_") or alias.name.startswith("__"):
                    continue
                module = "." * node.level + (node.module or "")
                if ours and node.module is None:
                    continue  # ``from . import _module``: a private module of its own package
                kind = "ours" if ours else "third-party"
                found.append(f"{kind}: {rel(p)}: from {module} import {alias.name}")
    return found


def runtime_errors() -> list[str]:
    found = []
    for p in product_files():
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id == "RuntimeError":
                    found.append(f"{rel(p)}:{node.lineno}")
    return found


def tool_count(cmd: list[str]) -> int:
    out = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True).stdout
    finding = re.compile(r"^\S+\.py:\d+:(\d+:)? (error:|[A-Z]+\d+)")
    return sum(1 for line in out.splitlines() if finding.match(line))


class PathTracer:
    """Records, per thread, the product files entered by calls while it is installed."""

    def __init__(self) -> None:
        self.seq: dict[int, list[str]] = collections.defaultdict(list)
        self.roots = tuple(str(b) + os.sep for b in PRODUCT)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        fname = frame.f_code.co_filename
        if not fname.startswith(self.roots):
            return
        seq = self.seq[threading.get_ident()]
        name = rel(fname)
        if not seq or seq[-1] != name:
            seq.append(name)

    def summary(self) -> dict[str, Any]:
        stops = [name for s in self.seq.values() for name in s]
        counts = collections.Counter(stops)
        most, n = counts.most_common(1)[0] if counts else ("", 0)
        hub = next((k for k in counts if k.endswith("stagesave/checkpointer.py")), "")
        return {"stops": len(stops), "files": len(counts), "most_entered": most,
                "re_entries": max(0, n - 1), "checkpointer_entries": counts.get(hub, 0),
                "top": counts.most_common(4)}


def trace(run: Any) -> dict[str, Any]:
    tracer = PathTracer()
    threading.setprofile(tracer)
    sys.setprofile(tracer)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return tracer.summary()


def save_path() -> dict[str, Any]:
    import torch

    import stagesave

    state = {"w": torch.randn(64, 64), "step": 3}
    with tempfile.TemporaryDirectory() as d:
        ck = stagesave.Checkpointer(d)
        ck.save(state, "warm.ckpt").result()  # first-use work (threads, probes) is not the path

        def run() -> None:
            ck.save(state, "a.ckpt").result()

        core = trace(run)
        ck.close()
        try:
            from stagesave.lightning import StagedCheckpointIO
        except ImportError:
            return {"checkpointer": core}
        io = StagedCheckpointIO()
        io.save_checkpoint({"state_dict": state}, os.path.join(d, "warm.ckpt"))
        io.teardown()

        def run_plugin() -> None:
            io.save_checkpoint({"state_dict": state}, os.path.join(d, "b.ckpt"))
            io.teardown()

        return {"checkpointer": core, "lightning": trace(run_plugin)}


def main() -> None:
    lines = line_counts()
    largest = sorted(lines.items(), key=lambda kv: -kv[1])[:12]
    adapters = {}
    for name in ("lightning", "accelerate"):
        files = {k: v for k, v in lines.items() if k.startswith(f"integrations/{name}/")}
        adapters[name] = {"lines": sum(files.values()), "files": len(files),
                          "largest": max(files.values())}
    src_targets = ["src", "integrations", "tests", "benchmarks"]
    result = {
        "largest_modules": largest,
        "modules_over_400": sum(1 for k, v in lines.items() if v > 400),
        "adapters": adapters,
        "save_path": save_path(),
        "private_imports": sum(1 for x in private_imports() if x.startswith("ours")),
        "third_party_private_imports": sum(1 for x in private_imports() if x.startswith("third")),
        "runtime_errors": len(runtime_errors()),
        "ruff": tool_count([".venv/bin/ruff", "check", "--output-format=concise", *src_targets]),
        "ruff_E501": tool_count([".venv/bin/ruff", "check", "--output-format=concise",
                                 "--select", "E501", *src_targets]),
        "mypy_src": tool_count([".venv/bin/mypy", "src"]),
        "mypy_integrations": tool_count([".venv/bin/mypy", "integrations"]),
    }
    if "--json" in sys.argv:
        print(json.dumps(result, indent=1))
        return
    for k, v in result.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
