"""Helpers of the CLI tests: real checkpoints written by the core, and an S3 adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import stagesave
from stagesave.formats import Safetensors


@dataclass
class CliRun:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def small_state(step: int, width: int = 64) -> dict[str, Any]:
    """A real little training state: model, Adam state, step, numpy RNG state."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 4)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,
        "rng": np.random.RandomState(step).get_state(),
    }


def write_checkpoints(
    root: os.PathLike[str] | str, steps: tuple[int, ...] = (10, 20, 30), **options: Any
) -> list[str]:
    """Committed stagesave checkpoints ``step=<n>.ckpt`` in ``root``, oldest first; their paths."""
    paths = []
    with stagesave.Checkpointer(root, **options) as ck:
        for step in steps:
            ck.save(small_state(step), f"step={step}.ckpt", metadata={"step": step}).result()
            paths.append(os.path.join(str(root), f"step={step}.ckpt"))
    return paths


def write_dir_checkpoint(
    root: os.PathLike[str] | str, name: str = "checkpoint_3", step: int = 3, **options: Any
) -> str:
    """An Accelerate-layout folder committed by stagesave (model.safetensors, optimizer.bin,
    ...)."""
    state = small_state(step)
    with stagesave.Checkpointer(root, **options) as ck:
        ck.save_dir(
            {
                "model.safetensors": Safetensors(
                    {k: v.contiguous() for k, v in state["model"].items()}
                ),
                "optimizer.bin": state["optimizer"],
                "random_states_0.pkl": {"step": step, "numpy_random_seed": state["rng"]},
            },
            name,
            metadata={"step": step},
        ).result()
    return os.path.join(str(root), name)


def format1_entry(path: str, name: str, kind: str, algorithm: str, chunk_bytes: int) -> Any:
    """The format-1 manifest entry of one file as stagesave wrote it before format 2: chunk
    digests, and for a torch zip its storage records and serialization id."""
    import zipfile

    from stagesave.ondisk.checksum import digest
    from stagesave.ondisk.manifest import FileEntry, StorageRecord

    data = Path(path).read_bytes()
    chunks = tuple(
        digest(algorithm, data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)
    )
    sid = id_offset = None
    storages: list[Any] = []
    if kind == "torch" and data[:4] == b"PK\x03\x04":
        reader = torch._C.PyTorchFileReader(path)
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                rel = info.filename.partition("/")[2]
                if rel.startswith("data/") and "/" not in rel[5:]:
                    off = int(reader.get_record_offset(rel))
                    storages.append(StorageRecord(rel[5:], off, info.file_size))
        sid = str(reader.serialization_id())
        id_offset = int(reader.get_record_offset(".data/serialization_id"))
    return FileEntry(
        name, len(data), algorithm, chunk_bytes, chunks, kind, sid, id_offset, tuple(storages)
    )


def write_format1(
    root: os.PathLike[str] | str, name: str, state: Any, *, metadata: dict[str, Any] | None = None,
    algorithm: str = "xxh3_128", chunk_bytes: int = 64 * 1024, created_ns: int | None = None,
) -> tuple[str, str]:
    """A format-1 checkpoint as stagesave wrote it before format 2: ``torch.save`` file + its
    sidecar ``<name>.<serialization id>.stagesave.json`` (with tensor index and telemetry).
    Returns ``(file path, sidecar path)``."""
    import time

    from stagesave.ondisk.manifest import Manifest
    from stagesave.ondisk.names import manifest_name
    from stagesave.saving.plan import plan_torch_file

    path = os.path.join(str(root), name)
    torch.save(state, path)
    entry = format1_entry(path, name, "torch", algorithm, chunk_bytes)
    tensors = [
        {
            "name": t.name,
            "storage": t.storage_key,
            "dtype": t.dtype,
            "shape": list(t.shape),
            "stride": list(t.stride),
            "storage_offset": t.storage_offset,
        }
        for t in plan_torch_file(state).tensors
    ]
    manifest = Manifest([entry], created_ns or time.time_ns(), tensors, metadata or {},
                        {"blocking_s": 0.25, "bytes": entry.size})
    sidecar = os.path.join(str(root), manifest_name(name, entry.serialization_id))
    with open(sidecar, "wb") as f:
        f.write(manifest.to_json())
    return path, sidecar


def write_format1_dir(
    root: os.PathLike[str] | str,
    name: str = "checkpoint_1",
    step: int = 1,
    *,
    chunk_bytes: int = 64 * 1024,
) -> str:
    """A format-1 folder checkpoint (Accelerate layout) with its ``checkpoint.stagesave.json``."""
    import json
    import time

    from safetensors.torch import save_file

    from stagesave.ondisk.manifest import Manifest
    from stagesave.ondisk.names import DIR_MANIFEST

    d = os.path.join(str(root), name)
    os.makedirs(d)
    state = small_state(step)
    save_file(
        {k: v.contiguous() for k, v in state["model"].items()},
        os.path.join(d, "model.safetensors"),
        metadata={"format": "pt"},
    )
    torch.save(state["optimizer"], os.path.join(d, "optimizer.bin"))
    torch.save(
        {"step": step, "numpy_random_seed": state["rng"]}, os.path.join(d, "random_states_0.pkl")
    )
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"step": step}, f)
    kinds = {
        "model.safetensors": "safetensors",
        "optimizer.bin": "torch",
        "random_states_0.pkl": "torch",
        "config.json": "raw",
    }
    entries = [
        format1_entry(os.path.join(d, n), n, k, "xxh3_128", chunk_bytes)
        for n, k in sorted(kinds.items())
    ]
    with open(os.path.join(d, DIR_MANIFEST), "wb") as f:
        f.write(
            Manifest(entries, time.time_ns(), [], {"step": step}, {"blocking_s": 0.5}).to_json()
        )
    return d


_CRASH_DRIVER = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch, stagesave
    from stagesave.formats import Safetensors

    def scenario(root, mode, name, options):
        w = torch.arange(600_000 if mode != "big" else 5_000_000, dtype=torch.float32)
        with stagesave.Checkpointer(root, chunk_bytes=1 << 20, storage_options=options) as ck:
            if mode in ("file", "big"):
                ck.save({"w": w}, name).result()
            elif mode == "replace":  # a committed file, then a crash while replacing it
                ck.save({"w": w}, name).result()
                ck.save({"w": w + 1}, name).result()
            else:  # a committed folder, then a crash while replacing it
                files = {"model.safetensors": Safetensors({"w": w}), "optimizer.bin": {"step": 1}}
                ck.save_dir(files, name).result()
                ck.save_dir({**files, "optimizer.bin": {"step": 2}}, name).result()

    def no_exchange(a, b):
        import errno
        raise OSError(errno.ENOSYS, "renameat2 unavailable (simulated filesystem without it)")

    results = []
    for root, mode, name, point, *options in json.loads(sys.argv[1]):
        pid = os.fork()  # one import of torch, one real process per crash
        if pid == 0:
            os.environ["STAGESAVE_CRASH_AT"] = point
            if mode == "dir_noexchange":  # the two-rename fallback, which leaves an aside folder
                import stagesave.stores.posix
                stagesave.stores.posix.exchange = no_exchange
            try:
                scenario(root, mode, name, options[0] if options else None)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        results.append(os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status))
    print(json.dumps(results))
    """
)


def crash_saves(scenarios: list[tuple[Any, ...]]) -> list[int]:
    """Each ``(root, mode, name, point[, storage_options])``: a real process saves ``name`` into
    ``root`` and is SIGKILLed at crash point ``point``; returns the signal that ended each (9
    when killed).

    ``mode``: ``file`` (the first save crashes), ``big`` (the same with 20 MB: a multipart upload
    on S3), ``replace`` / ``dir`` (a committed file / folder, then the save replacing it
    crashes: pass ``point`` as ``<point>:2``), ``dir_noexchange`` (as ``dir`` on a filesystem
    without ``RENAME_EXCHANGE``, simulated: the folder is replaced by two renames).
    """
    env = {k: v for k, v in os.environ.items() if k != "STAGESAVE_CRASH_AT"}
    env["STAGESAVE_WRITER"] = "thread"  # the crash points are in this process's writer
    r = subprocess.run([sys.executable, "-c", _CRASH_DRIVER, json.dumps(scenarios)], env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    result: list[int] = json.loads(r.stdout.strip().splitlines()[-1])
    return result
