"""Code run in forked children by the crash tests (imported by the forkserver, not collected)."""

from __future__ import annotations

import os
import sys
import warnings

import torch

import stagesave
from stagesave._crash import ENV_VAR  # fault injection: arms a named crash point in this child
from stagesave.formats import Safetensors


def save_step(root: str, step: int, mode: str, crash: str | None) -> None:
    """Save checkpoint ``step``; SIGKILL at ``crash`` if given."""
    if crash:
        os.environ[ENV_VAR] = crash
    else:
        os.environ.pop(ENV_VAR, None)
    state = {"step": step, "w": torch.full((300_000,), float(step))}
    if mode == "dir_beside":  # a file of an earlier save is never taken for the user's
        warnings.filterwarnings("error", message=".*replaced files of the same names")
    if mode in ("file_device", "dir_device"):
        # device staging's save path (device buffer, bounce writes) with host memory standing
        # in for the GPU, which this machine does not have
        # device staging without a GPU: the device is the host
        import stagesave.saving.stage_device as device_mod
        import stagesave.saving.staging as staging_mod

        staging_mod.device_of = lambda images, store: torch.device("cpu")  # type: ignore[assignment]
        device_mod.gpudirect_kvikio = lambda: None  # type: ignore[assignment]
    with stagesave.Checkpointer(  # the crash points are in this process's writer
        root, chunk_bytes=1 << 20, keep_last=2, device_staging=mode.endswith("_device"),
        writer="thread",
    ) as ck:
        if mode in ("file", "file_device"):
            ck.save(state, "last.ckpt").result()
            ck.save(state, f"step{step}.ckpt").result()
        else:
            name = ("current" if mode in ("dir_replace", "dir_device", "dir_beside")
                    else f"checkpoint_{step}")
            ck.save_dir(
                {"model.safetensors": Safetensors({"w": state["w"]}), "optimizer.bin": state}, name
            ).result()
    sys.stdout.flush()


def save_loop(root: str, start: int, conn) -> None:  # type: ignore[no-untyped-def]
    """Save forever, telling the parent after each submitted save."""
    os.environ.pop(ENV_VAR, None)
    with stagesave.Checkpointer(root, keep_last=3, chunk_bytes=1 << 20, writer="thread") as ck:
        for step in range(start, start + 1000):
            ck.save({"step": step, "w": torch.full((500_000,), float(step))}, f"s{step:05d}.ckpt")
            conn.send(step)
