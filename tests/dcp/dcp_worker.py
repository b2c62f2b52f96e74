"""Multi-process scenarios of the sharded-checkpoint tests.

``python dcp_worker.py serve`` imports torch once, then for each request read from stdin (one
JSON line: scenario, world size, output folder, environment) forks that many real processes
that form a gloo group through a file rendezvous (no ports to collide) and run the scenario;
it answers one JSON line with every rank's exit code (-9 for a rank SIGKILLed at a crash point).
Forking from this clean, thread-free process instead of starting Python per rank saves an
import of torch per process. ``python dcp_worker.py SCENARIO N OUT`` runs one scenario.

Every rank writes what it saw to ``OUT/<scenario>-rank<R>.json`` (its error as a traceback, if
any) and its output to ``OUT/<scenario>-rank<R>.log``.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dcp_helpers import build_model, proof, replicated_state, train

import stagesave.dcp as sdcp
from stagesave import Checkpointer, CheckpointError, FsspecStore
from stagesave.dcp import _rankjob as _writer  # the rank job calls write_rank: faults wrap it there
from stagesave.dcp import _writer as _writer_module  # write_data calls layout_rank_file there
from stagesave.dcp._metadata import load_metadata  # reads .metadata to compare two folders


def _tel(telemetry: Any) -> dict[str, Any]:
    return dict(telemetry.to_dict())


def fsdp_save(rank: int, world: int, out: str) -> dict[str, Any]:
    """FSDP2 on CPU: train, save sharded (model + Adam), and record the full reference state."""
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(0)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 100 + rank, 2)
    msd, osd = get_state_dict(model, opt)
    result: dict[str, Any] = {"dtensor": type(msd["0.weight"]).__name__,
                              "local_rows": int(msd["0.weight"].to_local().shape[0])}
    writer = sdcp.StagedStorageWriter(root=os.path.join(out, "ckpt"), commit_timeout=120)
    t0 = time.perf_counter()
    handle = sdcp.save({"model": msd, "optim": osd, "step": 2}, "step-2", writer=writer)
    result["returned_s"] = time.perf_counter() - t0
    result["save"] = _tel(handle.result(120))
    full_m, full_o = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"model": full_m, "optim": full_o}, os.path.join(out, "ref.pt"))
    # Steady saves (another writer, another folder), a training step before each, the state
    # taken anew each time as a training loop takes it: from the second, every rank's structure
    # is a kept one, so they exchange plan names.
    steady = sdcp.StagedStorageWriter(root=os.path.join(out, "steady"), commit_timeout=120)
    for step in (2, 3, 4, 5):
        train(model, opt, 200 + 10 * step + rank, 1)
        msd, osd = get_state_dict(model, opt)
        sdcp.save({"model": msd, "optim": osd, "step": step}, f"step-{step}",
                  writer=steady).result(120)
    result["exchanged"] = steady.exchanged.saves
    steady.close()
    full_m, full_o = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"model": full_m, "optim": full_o}, os.path.join(out, "ref5.pt"))

    # DDP-style replicated state: identical on every rank, written once.
    rep = replicated_state()
    writer2 = sdcp.StagedStorageWriter(checkpointer=writer.checkpointer)
    root = os.path.join(out, "rep")
    result["rep_default"] = _tel(
        sdcp.save(rep, os.path.join(root, "default"), writer=writer2).result(120)
    )
    planner = sdcp.SplitReplicatedPlanner(split_bytes=256 * 1024)
    result["rep_split"] = _tel(
        sdcp.save(rep, os.path.join(root, "split"), writer=writer2, planner=planner).result(120)
    )
    writer.close()
    return result


def fsdp_load(rank: int, world: int, out: str) -> dict[str, Any]:
    """FSDP2 on a different number of ranks: load the sharded checkpoint, record the full state."""
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(1)  # different weights: the load must overwrite every one
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 999, 1)  # optimizer state exists, with other values
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    sdcp.load(state, os.path.join(out, "ckpt", "step-2"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full_m, full_o = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    rep = replicated_state()
    zeros = {
        "emb": torch.zeros_like(rep["emb"]),
        "blocks": {k: torch.zeros_like(v) for k, v in rep["blocks"].items()},
        "bias": torch.zeros_like(rep["bias"]),
        "epoch": 0,
    }
    sdcp.load(zeros, os.path.join(out, "rep", "split"))
    if rank == 0:
        torch.save({"model": full_m, "optim": full_o, "step": state["step"], "rep": zeros},
                   os.path.join(out, "loaded.pt"))
    return {"local_rows": int(msd["0.weight"].to_local().shape[0])}


def killed_save(rank: int, world: int, out: str) -> dict[str, Any]:
    """Save A (committed), then save B during which the rank named by KILL_RANK is SIGKILLed."""
    mesh = init_device_mesh("cpu", (world,))
    victim = int(os.environ["KILL_RANK"])
    ckpt = Checkpointer(os.path.join(out, "ckpt"), chunk_bytes=64 * 1024)
    writer = sdcp.StagedStorageWriter(checkpointer=ckpt, commit_timeout=120)
    g = torch.Generator().manual_seed(11)
    full_a = torch.randn(512, 256, generator=g)  # 512 KiB: several 64 KiB chunks per rank file
    state = {"w": distribute_tensor(full_a.clone(), mesh, [Shard(0)]), "step": 1}
    sdcp.save(state, "step-1", writer=writer).result(60)
    if rank == 0:
        torch.save({"w": full_a, "step": 1}, os.path.join(out, "ref-a.pt"))
    state = {"w": distribute_tensor(full_a * 2, mesh, [Shard(0)]), "step": 2}
    # Save B: the survivor gives up soon. The victim keeps the long deadline, so that on a loaded
    # machine a coordinator chosen as victim still reaches its crash point (it waits for every
    # part before committing) instead of timing out first.
    if rank != victim:
        writer.commit_timeout = float(os.environ.get("COMMIT_TIMEOUT", "4"))
    gated = os.environ.get("KILL_AFTER_SAVE_RETURNED") == "1"
    gate = threading.Event()
    if rank == victim:
        if gated:
            # Fault injection by wrapping the real thing: the victim's background write starts
            # only once its dcp.save returned, so it dies after every collective finished.
            real = _writer.write_rank

            def gated_write(*args: Any, **kwargs: Any) -> Any:
                gate.wait(60)
                return real(*args, **kwargs)

            _writer.write_rank = gated_write  # type: ignore[assignment]
        else:
            os.environ["STAGESAVE_CRASH_AT"] = os.environ["KILL_AT"]
    result: dict[str, Any] = {}
    try:
        handle = sdcp.save(state, "step-2", writer=writer)
    except BaseException as exc:  # noqa: BLE001 - a peer died inside dcp.save's collectives
        result["outcome"] = "dcp.save raised"
        result["message"] = f"{type(exc).__name__}: {exc}"
        return result
    if rank == victim and gated:
        os.environ["STAGESAVE_CRASH_AT"] = os.environ["KILL_AT"]
        gate.set()
    try:
        handle.result(60)
        result["outcome"] = "committed"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["outcome"] = type(exc).__name__
        result["message"] = str(exc)
    try:
        ckpt.close()
    except Exception as exc:  # noqa: BLE001 - the same failure, delivered again: not expected
        result["close"] = f"{type(exc).__name__}: {exc}"
    return result


def object_store_save(rank: int, world: int, out: str) -> dict[str, Any]:
    """The object-store protocol (no rename) on a shared folder, through fsspec's local backend."""
    mesh = init_device_mesh("cpu", (world,))
    store = FsspecStore(f"file://{os.path.join(out, 'objects')}", {"auto_mkdir": True})
    writer = sdcp.StagedStorageWriter(root=store, commit_timeout=60)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(64, 32, generator=g)
    for step in (1, 2):  # the second save replaces the folder in place
        state = {"w": distribute_tensor(full * step, mesh, [Shard(0)]), "step": step}
        sdcp.save(state, "last", writer=writer).result(60)
    loaded = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]), "step": 0}
    sdcp.load(loaded, "last", reader=sdcp.StagedStorageReader(store=store))
    same = bool(torch.equal(loaded["w"].full_tensor(), full * 2)) and loaded["step"] == 2
    writer.close()
    return {"loaded_equal": same}


def steady_plans(rank: int, world: int, out: str) -> dict[str, Any]:
    """Three saves through one writer per rank: new values (the plans are reused), then rank 1's
    own tensor reshaped (every plan made again); each folder read back in one process."""
    writer = sdcp.StagedStorageWriter(root=os.path.join(out, "steady"), commit_timeout=60)
    g = torch.Generator().manual_seed(11)
    shared, own = torch.randn(64, 32, generator=g), torch.randn(5, 7, generator=g) + rank
    saved, reused = {}, []
    for step in (1, 2, 3):
        if step == 3 and rank == 1:
            own = torch.randn(7, 5, generator=g)
        state = {"w": shared * step, f"own{rank}": own * step, "step": step}
        sdcp.save(state, f"step-{step}", writer=writer).result(60)
        reused.append([writer.planner.reused_local, writer.planner.reused_global])
        saved[step] = {"w": (shared * step).tolist(), "own": (own * step).tolist()}
    dist.barrier()
    result: dict[str, Any] = {"reused": reused, "saved": saved}
    if rank == 0:  # every folder holds what every rank saved at that step
        result["read"] = {}
        for step in (1, 2, 3):
            whole = sdcp.to_state_dict(os.path.join(out, "steady", f"step-{step}"))
            result["read"][step] = {k: v.tolist() if isinstance(v, torch.Tensor) else v
                                    for k, v in whole.items()}
    dist.barrier()
    writer.close()
    return result


def steady_places(rank: int, world: int, out: str) -> dict[str, Any]:
    """Five saves through one writer per rank (a replicated tensor DCP gives one rank, and each
    rank's own tensors): DCP hands each rank an unpickled plan at every save, and a rank given
    the same global plan again resolves its items by their tensors' places from the third save;
    at the fourth, two of each rank's tensors swap keys and one is a new object."""
    writer = sdcp.StagedStorageWriter(root=os.path.join(out, "places"), commit_timeout=60)
    g = torch.Generator().manual_seed(5)
    shared = torch.randn(16, 8, generator=g)
    own = {f"r{rank}.t{i}": torch.randn(4, 4, generator=g) + 10 * rank + i for i in range(4)}
    saved, counts = {}, []
    for step in (1, 2, 3, 4, 5):
        if step == 4:
            own[f"r{rank}.t0"], own[f"r{rank}.t1"] = own[f"r{rank}.t1"], own[f"r{rank}.t0"]
            own[f"r{rank}.t2"] = torch.randn(4, 4, generator=g)
        with torch.no_grad():
            shared.add_(1)
        state = {"shared": shared, "own": dict(own), "step": step}
        sdcp.save(state, f"step-{step}", writer=writer).result(60)
        planner = writer.planner
        counts.append([planner.reused_global, planner.resolved_by_place])
        saved[step] = {k: v.tolist() for k, v in own.items()}
        saved[step]["shared"] = shared.tolist()
    dist.barrier()
    result: dict[str, Any] = {"counts": counts, "saved": saved}
    if rank == 0:
        result["read"] = {}
        for step in (1, 2, 3, 4, 5):
            whole = sdcp.to_state_dict(os.path.join(out, "places", f"step-{step}"))
            result["read"][step] = {"shared": whole["shared"].tolist(),
                                    **{k: v.tolist() for k, v in whole["own"].items()}}
    dist.barrier()
    writer.close()
    return result


def coordinator_fails(rank: int, world: int, out: str) -> dict[str, Any]:
    """The coordinator's background write fails (disk full): the other ranks, waiting for the
    commit, learn it from the store (staging folder gone, or the abort marker on object stores)."""
    mesh = init_device_mesh("cpu", (world,))
    objects = os.environ.get("OBJECT_STORE") == "1"
    root: Any = (
        FsspecStore(f"file://{os.path.join(out, 'ckpt')}", {"auto_mkdir": True})
        if objects
        else os.path.join(out, "ckpt")
    )
    writer = sdcp.StagedStorageWriter(root=root, commit_timeout=120)
    result: dict[str, Any] = {}
    # 1. Staging fails on the coordinator (a meta tensor has no bytes): its commit job never
    #    exists, dcp.save raises everywhere, and rank 1's background part must not wait.
    state: dict[str, Any] = {"w": distribute_tensor(torch.ones(64, 8), mesh, [Shard(0)])}
    if rank == 0:
        state["bad"] = torch.empty(4, device="meta")
    t0 = time.monotonic()
    try:
        dcp.save(state, checkpoint_id="step-0", storage_writer=writer)
    except BaseException:  # noqa: BLE001, S110 - DCP re-raises rank 0's error on every rank
        pass
    result["staging"] = (
        _outcome(writer.last_handle) if rank == 1 and writer.last_handle is not None else None
    )
    result["staging_seconds"] = time.monotonic() - t0
    # 2. The coordinator's background write fails (disk full).
    if rank == 0:
        def disk_full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        _writer.write_rank = disk_full  # type: ignore[assignment]
    t0 = time.monotonic()
    state = {"w": distribute_tensor(torch.ones(64, 8), mesh, [Shard(0)])}
    result.update(_outcome(sdcp.save(state, "step-1", writer=writer)))
    result["seconds"] = time.monotonic() - t0
    writer.close()
    return result


def crash_replace(rank: int, world: int, out: str) -> dict[str, Any]:
    """Save ``step-0`` and A into ``last`` (committed), then B over ``last`` with ``keep_last=1``
    (its retention removes ``step-0``), SIGKILLed at the crash point ``KILL_AT`` of save B."""
    ckpt = Checkpointer(os.path.join(out, "ckpt"), chunk_bytes=64 * 1024)
    writer = sdcp.StagedStorageWriter(checkpointer=ckpt, commit_timeout=60)
    g = torch.Generator().manual_seed(21)
    a = {"w": torch.randn(512, 256, generator=g), "step": 1}  # 512 KiB: several chunks per file
    b = {"w": torch.randn(512, 256, generator=g), "step": 2}
    if rank == 0:
        torch.save({"A": a, "B": b}, os.path.join(out, "states.pt"))
    sdcp.save({"w": torch.zeros(4), "step": 0}, "step-0", writer=writer).result(60)
    sdcp.save(a, "last", writer=writer).result(60)
    ckpt.keep_last = 1
    # a filesystem without RENAME_EXCHANGE: old folder aside first
    if os.environ.get("NO_EXCHANGE") == "1":
        from stagesave.stores import posix as _fsops

        def no_exchange(a: str, b: str) -> None:
            raise OSError(errno.ENOSYS, "renameat2(RENAME_EXCHANGE) is not supported here")

        _fsops.exchange = no_exchange  # type: ignore[assignment]
    os.environ["STAGESAVE_CRASH_AT"] = os.environ["KILL_AT"]
    sdcp.save(b, "last", writer=writer).result(60)
    os.environ.pop("STAGESAVE_CRASH_AT")
    writer.close()
    ckpt.close()
    return {"outcome": "committed"}


def _outcome(handle: Any) -> dict[str, Any]:
    try:
        handle.result(120)
        return {"error_type": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error_type": type(exc).__name__, "message": str(exc),
                "traceback": "".join(traceback.format_exception(exc))}


def failed_write(rank: int, world: int, out: str) -> dict[str, Any]:
    """Rank 1 fails, first while staging, then in its background write: no one waits for it."""
    mesh = init_device_mesh("cpu", (world,))
    writer = sdcp.StagedStorageWriter(root=os.path.join(out, "ckpt"), commit_timeout=120)
    result: dict[str, Any] = {}
    # 1. Staging fails on rank 1 (a meta tensor has no bytes); plain dcp.save, no stagesave helper.
    state: dict[str, Any] = {"w": distribute_tensor(torch.ones(64, 8), mesh, [Shard(0)])}
    if rank == 1:
        state["bad"] = torch.empty(4, device="meta")
    try:
        dcp.save(state, checkpoint_id="step-1", storage_writer=writer)
        result["dcp_save_raised"] = False
    except BaseException:  # noqa: BLE001 - DCP re-raises rank 1's error on every rank
        result["dcp_save_raised"] = True
    result["staging"] = _outcome(writer.last_handle) if rank == 0 else None
    # 2. Rank 1's background write fails (disk full).
    if rank == 1:
        def disk_full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        _writer.write_rank = disk_full  # type: ignore[assignment]
    state = {"w": distribute_tensor(torch.ones(64, 8), mesh, [Shard(0)])}
    result["write"] = _outcome(sdcp.save(state, "step-2", writer=writer))
    writer.close()  # the failures were delivered by the handles: not raised again
    return result


def _settled(writer: Any) -> str | None:
    """``writer.wait``: None, or the error it raised (a failure not delivered yet)."""
    try:
        writer.wait(120)
        return None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"


def _failed_save(save: Any) -> str | None:
    try:
        save()
        return None
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return type(exc).__name__


def raised_once(rank: int, world: int, out: str) -> dict[str, Any]:
    """Saves that raised on every rank: their background sides fail too, and that failure is
    not raised a second time by a later wait or save (each handle's ``result()`` still has it);
    a background failure after a ``dcp.save`` that returned is raised at the next call."""
    writer = sdcp.StagedStorageWriter(root=os.path.join(out, "ckpt"), commit_timeout=120)
    result: dict[str, Any] = {}

    def state(bad_on: int | None) -> dict[str, Any]:
        st: dict[str, Any] = {"w": torch.ones(8), "note": "replicated"}
        st[f"own{rank}"] = torch.arange(4.0) + 10 * rank
        if rank == bad_on:  # a meta tensor has no bytes: staging fails on that rank
            st["bad"] = torch.empty(4, device="meta")
        return st

    # 1. stagesave.dcp.save; staging fails on rank 1 (the coordinator's commit job fails).
    result["1"] = _failed_save(lambda: sdcp.save(state(1), "step-1", writer=writer))
    result["1_settled"] = _settled(writer)
    result["1_handle"] = _outcome(writer.last_handle)["error_type"] if rank == 0 else None
    # 2. plain dcp.save, the caller calls abandon(); staging fails on the coordinator (rank 1's
    #    part, written, fails when the coordinator gives up).
    def plain_then_abandon() -> None:
        try:
            dcp.save(state(0), checkpoint_id="step-2", storage_writer=writer)
        except BaseException:
            writer.abandon()
            raise

    result["2"] = _failed_save(plain_then_abandon)
    result["2_settled"] = _settled(writer)
    result["2_handle"] = _outcome(writer.last_handle)["message"] if rank == 1 else None
    # 3. plain dcp.save, nobody calls abandon(); staging fails on rank 1: the coordinator's
    #    save never reached finish(), which its next save knows.
    result["3"] = _failed_save(
        lambda: dcp.save(state(1), checkpoint_id="step-3", storage_writer=writer)
    )
    dist.barrier()
    # 4. A healthy save commits.
    sdcp.save(state(None), "step-4", writer=writer).result(60)
    # 5. rank 1's background write fails after dcp.save returned: raised once, at the next call.
    real = _writer.write_rank
    if rank == 1:
        def disk_full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        _writer.write_rank = disk_full  # type: ignore[assignment]
    sdcp.save(state(None), "step-5", writer=writer).exception(60)  # done, not delivered
    _writer.write_rank = real  # type: ignore[assignment]
    try:
        sdcp.save(state(None), "step-6", writer=writer)
        result["6"] = None
    except CheckpointError as exc:
        result["6"] = f"{type(exc).__name__}: {exc}"
    result["6_settled"] = _settled(writer)
    sdcp.save(state(None), "step-7", writer=writer).result(60)
    dist.barrier()
    if rank == 0:
        got = sdcp.to_state_dict(os.path.join(out, "ckpt", "step-7"))
        result["read"] = {k: v.tolist() if isinstance(v, torch.Tensor) else v
                          for k, v in got.items()}
    writer.close()
    return result


def told_once(rank: int, world: int, out: str) -> dict[str, Any]:
    """Rank 1's background write of save b fails at once; the coordinator's part of b is still
    being written (slow) when save c starts, where rank 1 raises b's failure and DCP hands it to
    rank 0 too. Rank 0's own failure of b comes later: it is not raised again (by wait, or by
    save d, which commits on both ranks)."""
    writer = sdcp.StagedStorageWriter(root=os.path.join(out, "ckpt"), commit_timeout=60)
    state = {"w": torch.full((8,), float(rank)), f"own{rank}": torch.arange(3.0) + rank}
    result: dict[str, Any] = {}
    sdcp.save(state, "a", writer=writer).result(60)
    real = _writer.write_rank

    def failing(*args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            raise OSError(28, "No space left on device")
        time.sleep(3.0)  # the coordinator's part of b: slow storage
        return real(*args, **kwargs)

    _writer.write_rank = failing  # type: ignore[assignment]
    b = sdcp.save(state, "b", writer=writer)
    _writer.write_rank = real  # type: ignore[assignment]
    if rank == 1:
        b.exception(60)  # failed, not delivered yet
    try:
        sdcp.save(state, "c", writer=writer)
        result["c"] = None
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException included
        result["c"] = f"{type(exc).__name__}: {exc}"
    result["b_done_at_c"] = b.done()
    err = b.exception(60)
    result["b"] = f"{type(err).__name__}: {err}" if err is not None else None
    try:
        writer.wait(60)
        result["wait"] = None
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result["wait"] = f"{type(exc).__name__}: {exc}"
    sdcp.save(state, "d", writer=writer).result(60)
    writer.close()
    return result


def _flat_lists(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested state as ``{"a.b": value}``, tensors as lists."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out |= _flat_lists(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v.tolist() if isinstance(v, torch.Tensor) else v
    return out


def steady_exchange(rank: int, world: int, out: str) -> dict[str, Any]:
    """Seven saves of a state of DTensor shards, a replicated tensor, each rank's own tensors
    and a number through one writer per rank (``stagesave.dcp.save``): which saves ran
    ``dcp.save`` and which exchanged names only, values changed in place, tensors swapping keys
    and replaced by new objects (save 4), a shape changed on rank 1 only (save 5), a save
    failing on rank 1 after its layout (save 6), a DTensor that now requires grad (save 7);
    each folder compared with a fresh writer's."""
    mesh = init_device_mesh("cpu", (world,))
    writer = sdcp.StagedStorageWriter(root=os.path.join(out, "steady"), commit_timeout=60)
    calls = {"dcp.save": 0, "by DCP itself": 0}  # saves planned from the state; of them, dcp.save
    real_full, real_save = sdcp._full_save, sdcp._dcp_save
    real_layout = _writer_module.layout_rank_file

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["dcp.save"] += 1
        return real_full(*args, **kwargs)

    def counted_dcp(*args: Any, **kwargs: Any) -> Any:
        calls["by DCP itself"] += 1
        return real_save(*args, **kwargs)

    sdcp._full_save = counted  # type: ignore[attr-defined]
    sdcp._dcp_save = counted_dcp  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(3)
    sharded = {f"layer{i}": distribute_tensor(torch.randn(8 * world, 4, generator=g), mesh,
                                              [Shard(0)]) for i in range(3)}
    shared = torch.randn(6, generator=g)
    own = {f"r{rank}.t{i}": torch.randn(3, 2, generator=g) + 10 * rank for i in range(3)}
    result: dict[str, Any] = {"paths": [], "errors": {}, "saved": {}}
    for step in range(1, 8):
        with torch.no_grad():
            shared.add_(1)
            for d in sharded.values():
                d._local_tensor.add_(1)
        if step == 4:
            own[f"r{rank}.t0"], own[f"r{rank}.t1"] = own[f"r{rank}.t1"], own[f"r{rank}.t0"]
            own[f"r{rank}.t2"] = torch.randn(3, 2, generator=g)
        if step == 5 and rank == 1:
            own[f"r{rank}.t2"] = torch.randn(2, 3, generator=g)
        if step == 5:  # another spec, the same local shard's facts: (16, 4) sharded -> (8, 4)
            sharded["layer0"] = distribute_tensor(torch.randn(8, 4, generator=g), mesh,
                                                  [Replicate()])
        if step == 7:  # a DTensor now requires grad (DCP records it: grad mode is on)
            sharded["layer1"].requires_grad_(True)
        state = {"model": dict(sharded), "shared": shared, "own": dict(own), "step": step}
        before, exchanged = calls["dcp.save"], writer.exchanged.saves

        def failing(*args: Any, **kwargs: Any) -> Any:
            real_layout(*args, **kwargs)
            raise OSError("injected after the layout")

        if step == 6 and rank == 1:
            _writer_module.layout_rank_file = failing  # type: ignore[assignment]
        try:
            sdcp.save(state, f"step-{step}", writer=writer).result(60)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException included
            result["errors"][step] = type(exc).__name__
        _writer_module.layout_rank_file = real_layout  # type: ignore[assignment]
        result["paths"].append([calls["dcp.save"] - before, writer.exchanged.saves - exchanged])
        if step in result["errors"]:
            continue
        fresh = sdcp.StagedStorageWriter(root=os.path.join(out, "fresh"), commit_timeout=60)
        sdcp.save(state, f"step-{step}", writer=fresh).result(60)
        fresh.close()
        dist.barrier()
        mine = [os.path.join(out, kind, f"step-{step}", f"__{rank}_0.distcp")
                for kind in ("steady", "fresh")]
        data = [Path(f).read_bytes()[: proof(f).summary.proof_offset] for f in mine]
        result.setdefault("same_bytes", []).append(data[0] == data[1])
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {k: v.tolist() for k, v in own.items()})
        if rank == 0:
            whole = sdcp.to_state_dict(os.path.join(out, "steady", f"step-{step}"))
            expect = {f"model.{k}": v.full_tensor().tolist() for k, v in sharded.items()}
            expect |= {"shared": shared.tolist(), "step": step}
            for theirs in gathered:
                expect |= {f"own.{k}": v for k, v in theirs.items()}
            got = _flat_lists(whole)
            result["saved"][step] = got == expect or {"got": got, "expect": expect}
            steady_md, fresh_md = (
                load_metadata(Path(out, kind, f"step-{step}", ".metadata").read_bytes(), kind)
                for kind in ("steady", "fresh"))
            result.setdefault("same_metadata", []).append(
                steady_md.state_dict_metadata == fresh_md.state_dict_metadata
                and steady_md.storage_data == fresh_md.storage_data
                and steady_md.planner_data == fresh_md.planner_data)
        else:
            for v in sharded.values():  # full_tensor() is a collective: every rank joins
                v.full_tensor()
        dist.barrier()
    sdcp._full_save, sdcp._dcp_save = real_full, real_save  # type: ignore[attr-defined]
    result["by_dcp"] = calls["by DCP itself"]
    result["counts"] = [writer.planner.reused_local, writer.planner.reused_global,
                        writer.planner.resolved_by_place, writer.exchanged.by_mark]
    writer.close()
    return result


SCENARIOS = {
    f.__name__: f
    for f in (
        fsdp_save,
        fsdp_load,
        killed_save,
        object_store_save,
        steady_plans,
        steady_places,
        failed_write,
        raised_once,
        steady_exchange,
        told_once,
        coordinator_fails,
        crash_replace,
    )
}


def _child(scenario: str, rank: int, world: int, out: str, env: dict[str, str]) -> None:
    log = os.open(
        os.path.join(out, f"{scenario}-rank{rank}.log"),
        os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
        0o644,
    )
    os.dup2(log, 1)  # never write into the launcher's answer channel
    os.dup2(log, 2)
    os.environ.update(env)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    path = os.path.join(out, f"{scenario}-rank{rank}.json")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(out, scenario + '.rdzv')}",
            rank=rank,
            world_size=world,
        )
        result = SCENARIOS[scenario](rank, world, out)
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the test
        result = {"ok": False, "error": traceback.format_exc()}
    with open(path, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)  # never hang in teardown of a group with a dead peer


def launch(
    scenario: str, world: int, out: str, env: dict[str, str] | None = None, timeout: float = 240.0
) -> list[Any]:
    """Fork ``world`` ranks running ``scenario``; every rank's exit code (or "timeout")."""
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_child, args=(scenario, r, world, out, dict(env or {})))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes: list[Any] = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
            codes.append("timeout")
        else:
            codes.append(p.exitcode)
    with open(os.path.join(out, f"{scenario}-exit.json"), "w") as f:
        json.dump(codes, f)
    return codes


def serve() -> int:
    """Answer launch requests from stdin until it closes."""
    for line in sys.stdin:
        req = json.loads(line)
        try:
            codes = launch(
                req["scenario"], req["world"], req["out"], req.get("env"), req.get("timeout", 240.0)
            )
            answer: dict[str, Any] = {"exit_codes": codes}
        except Exception:  # noqa: BLE001 - reported to the test
            answer = {"error": traceback.format_exc()}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        sys.exit(serve())
    print(launch(sys.argv[1], int(sys.argv[2]), sys.argv[3], dict(os.environ)))
