"""Child process for test_bench_alternatives: every alternative really saves the state.

Runs each available alternative of ``stagesave bench`` once on a small state, loads what it wrote
with that alternative's own loader and prints ``{name: true/false}`` (loaded tensors and values
equal to the state). In a child because DCP's process mode starts a daemon and Accelerate keeps a
process-wide singleton.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import torch

from stagesave.cli._bench_state import synthetic_state

# the alternatives themselves, one save each in a fresh process (what `bench` runs in rounds)
from stagesave.cli.alternatives import available_alternatives


def equal(a, b) -> bool:  # type: ignore[no-untyped-def]
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def load(name: str, path: str, state):  # type: ignore[no-untyped-def]
    if name.startswith("dcp."):
        import torch.distributed.checkpoint as dcp

        template = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
                    "optimizer": {"state": {i: {k: torch.zeros_like(v) for k, v in s.items()}
                                            for i, s in state["optimizer"]["state"].items()},
                                  "param_groups": [{"lr": 0.0, "params": []}]},
                    "step": 0}
        dcp.load(template, checkpoint_id=path)
        return template
    if name.startswith("accelerate"):
        (path,) = glob.glob(os.path.join(path, "custom_checkpoint_*.pkl"))
    return torch.load(path, weights_only=True)


def main() -> None:
    root = sys.argv[1]
    state = synthetic_state(2e6)
    out = {}
    for alt in available_alternatives():
        if alt.unavailable() is not None:
            continue
        folder = os.path.join(root, "".join(c if c.isalnum() else "-" for c in alt.name))
        os.makedirs(folder)
        session = alt.make(folder, {})
        try:
            path = os.path.join(folder, "ckpt")
            blocked, done = session.start(state, path)
            end = time.monotonic() + 120
            while not done():
                assert time.monotonic() < end, alt.name
                time.sleep(0.01)
            session.check()
            out[alt.name] = blocked > 0 and equal(state, load(alt.name, path, state))
        finally:
            session.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
