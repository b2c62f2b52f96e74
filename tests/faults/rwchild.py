"""Processes that replace checkpoints in a loop, and processes that read them meanwhile.

Run as ``python rwchild.py writer|reader|saver ROOT SECONDS [TAG]`` with ``STAGESAVE_RW_OPTIONS``
(JSON storage options, for S3) in the environment. Each prints one JSON line when it ends.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings

import torch

import stagesave
from stagesave.formats import Safetensors

N = 50_000  # 200 KB of floats: several chunks with small chunk sizes


def file_state(step: int) -> dict[str, object]:
    return {"step": step, "w": torch.full((N,), float(step)), "tag": f"v{step}"}


def folder_state(step: int) -> dict[str, object]:
    return {
        "model.safetensors": Safetensors({"w": torch.full((N // 2,), float(step))}),
        "optimizer.bin": {
            "step": step,
            "m": torch.full((N // 4,), float(step), dtype=torch.float64),
        },
    }


def _consistent(state: dict[str, object], key: str) -> int:
    """The step a loaded state says it is, after checking every value agrees with it."""
    step = int(state["step"])  # type: ignore[arg-type]
    t = state[key]
    assert isinstance(t, torch.Tensor) and bool((t == float(step)).all()), (
        f"{key} does not hold step {step}"
    )
    return step


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def writer(root: str, seconds: float, options: dict[str, object]) -> dict[str, object]:
    """Replace last.ckpt, then the folder, again and again."""
    saves = 0
    with stagesave.Checkpointer(root, chunk_bytes=64 * 1024, storage_options=options) as ck:
        # the time counts from when the Checkpointer is open (see saver), and at least 10 saves
        deadline = time.monotonic() + seconds
        step = 1
        while time.monotonic() < deadline or saves < 10:
            ck.save(file_state(step), "last.ckpt").result()
            ck.save_dir(folder_state(step), "folder").result()
            saves += 2
            step += 1
    return {"saves": saves, "last_step": step - 1}


def reader(root: str, seconds: float, options: dict[str, object]) -> dict[str, object]:
    """Load last.ckpt, latest() + load(), and folder/optimizer.bin, in turn, until the deadline."""
    counts = {"last": 0, "latest": 0, "member": 0}
    errors: list[str] = []
    warnings.simplefilter("ignore")
    with stagesave.Checkpointer(root, storage_options=options) as ck:
        # from when the Checkpointer is open (see saver); on a loaded machine, on until every
        # kind of read was made 5 times (for another minute at most)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or (
                min(counts.values()) < 5 and time.monotonic() < deadline + 60):
            for what in counts:
                try:
                    if what == "last":
                        _consistent(ck.load("last.ckpt"), "w")
                    elif what == "latest":
                        info = ck.latest()
                        if info is None:
                            continue  # nothing committed yet
                        target = _join(info.path, "optimizer.bin") if info.is_dir else info.path
                        _consistent(ck.load(target), "m" if info.is_dir else "w")
                    else:
                        _consistent(ck.load("folder/optimizer.bin"), "m")
                    counts[what] += 1
                except FileNotFoundError:
                    continue  # not saved yet at the start
                except Exception as exc:  # noqa: BLE001 - every other failure is a violation
                    errors.append(f"{what}: {type(exc).__name__}: {exc}")
    return {"counts": counts, "errors": errors[:20], "n_errors": len(errors)}


def saver(root: str, seconds: float, options: dict[str, object], tag: str) -> dict[str, object]:
    """Save last.ckpt again and again, each save a state only this process makes (its tag).

    The time counts from when the Checkpointer is open (setting up the S3 client alone can take
    seconds on a loaded machine), and there is always at least one save: a process that made
    none proves nothing.
    """
    saves, failures = 0, []
    with stagesave.Checkpointer(root, chunk_bytes=64 * 1024, storage_options=options) as ck:
        deadline = time.monotonic() + seconds
        step = 0
        while step == 0 or time.monotonic() < deadline:
            step += 1
            state = {"step": step, "w": torch.full((N,), float(step)), "tag": tag}
            try:
                ck.save(state, "last.ckpt").result()
                saves += 1
            except stagesave.CheckpointError as exc:
                failures.append(str(exc))
    return {"saves": saves, "failures": failures[:5]}


if __name__ == "__main__":
    role, root, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    options = json.loads(os.environ.get("STAGESAVE_RW_OPTIONS", "{}"))
    try:
        if role == "writer":
            out = writer(root, seconds, options)
        elif role == "reader":
            out = reader(root, seconds, options)
        else:
            out = saver(root, seconds, options, sys.argv[4])
    except BaseException as exc:  # noqa: BLE001 - the parent judges
        out = {"crashed": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    print(json.dumps(out))
