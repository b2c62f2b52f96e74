"""Multi-process and crash scenarios of the Accelerate tests: ``python dist_worker.py OUT``.

The script imports torch and Accelerate once and forks every process it needs from that clean,
thread-free state, instead of starting an interpreter (and importing torch) per process. Ranks
form a gloo group through a file rendezvous (no ports) and build real Accelerators from the
environment, as under ``accelerate launch``. Phases, in order:

1. ``ddp``: 2 MULTI_CPU processes with stagesave turned on by ``enable_globally()`` (what
   ``python -m stagesave.accelerate`` does) and configured by ``STAGESAVE_ACCELERATE_*``:
   bitwise restores, plain Accelerate interop, ``save_on_each_node``.
2. ``fsdp_save``: FSDP2 on 2 processes. Accelerate picks ``DistributedType.FSDP`` only on GPU
   back ends, so each rank builds a real MULTI_CPU Accelerator and switches its shared state to
   FSDP with a real ``FullyShardedDataParallelPlugin`` (version 2, ``SHARDED_STATE_DICT``) before
   ``prepare``; from there everything is Accelerate's own FSDP code (``fully_shard``,
   ``save_fsdp_model``, ``load_fsdp_model``, ...) and stagesave's: layout and contents against
   Accelerate's own save, bitwise restores both ways, automatic naming with ``total_limit``, a
   corrupt part skipped and replaced; finally rank 0 is SIGKILLed by a crash point mid-save.
3. ``fsdp_resume``: fresh processes; plain Accelerate and stagesave resume from the last good one.
4. ``crash-<point>``: one process training with ``total_limit=1``, SIGKILLed by a crash point
   during its third save (``test_resume.py`` inspects and resumes what it left).
5. ``example2_crash``: ``examples/accelerate_finetune.py`` on 2 processes, SIGKILLed after a save
   (``test_example.py`` resumes it under ``accelerate launch``).
6. ``example-*``: the example in one process, run as ``__main__`` in a forked child:
   uninterrupted, SIGKILLed after a save, resumed (``test_example.py``).

Every rank writes ``OUT/<phase>-rank<R>.json`` (updated after each scenario) and a log;
``OUT/exit.json`` holds every phase's exit codes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
import traceback
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accel_helpers import Counter, assert_same, clone, load_file_content, train

# the first part of the save committed in staging, not yet renamed
CRASH_POINT = "dcp_after_metadata"


# ----------------------------------------------------------------------------- set-up
def accelerator(project_dir: str | None = None, total_limit: int | None = None) -> Any:
    """A real MULTI_CPU Accelerator switched to FSDP2 with a sharded state dict."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import (
        DistributedType,
        FullyShardedDataParallelPlugin,
        ProjectConfiguration,
    )

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = ProjectConfiguration(
        project_dir=project_dir,
        automatic_checkpoint_naming=project_dir is not None,
        total_limit=total_limit,
    )
    acc = Accelerator(cpu=True, project_config=config)
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT"
    )
    acc.state.distributed_type = DistributedType.FSDP
    # survives AcceleratorState()
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    assert acc.is_fsdp2
    return acc


def build(acc: Any, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = DataLoader(
        TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=8, shuffle=True
    )
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    counters = [Counter()]
    acc.register_for_checkpointing(*counters)
    rank = acc.process_index
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(1000 + rank)  # every process has its own RNG streams
    return {
        "models": [model],
        "opts": [opt],
        "scheds": [sched],
        "loader": loader,
        "counters": counters,
    }


def _local(obj: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    return clone(obj)


def snapshot(acc: Any, run: dict[str, Any]) -> dict[str, Any]:
    """This rank's shards of everything a checkpoint restores, plus its RNG streams."""
    return _local({
        "model": run["models"][0].state_dict(),
        "opt": run["opts"][0].state_dict(),
        "sched": run["scheds"][0].state_dict(),
        "counters": [c.state_dict() for c in run["counters"]],
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "torch_rng": torch.get_rng_state(),
        "step": acc.step,
    })


def check(result: dict[str, Any], key: str, fn: Any) -> None:
    try:
        fn()
        result[key] = "ok"
    except Exception:  # noqa: BLE001, RUF100 - reported to the test
        result[key] = traceback.format_exc()


def tree(folder: str) -> list[str]:
    """Every file under ``folder``, relative, hidden ones included."""
    return sorted(
        os.path.relpath(os.path.join(top, n), folder)
        for top, _, names in os.walk(folder)
        for n in names
    )


def real_zips(folder: str) -> list[str]:
    """Torch files under ``folder`` (``*.bin``/``*.pkl``/``*.pt``) that are not zips whose every
    record carries its real CRC-32 (empty: all are)."""
    import zipfile

    bad = []
    for rel in tree(folder):
        if rel.endswith((".bin", ".pkl", ".pt")):
            path = os.path.join(folder, rel)
            if not zipfile.is_zipfile(path):
                bad.append(rel)
                continue
            with zipfile.ZipFile(path) as z:
                if z.testzip() is not None:
                    bad.append(rel)
    return bad


# ----------------------------------------------------------------------------- ddp
def ddp(rank: int, out: str, result: dict[str, Any], save: Any) -> None:
    """DDP-style state: the main process writes the folder, every rank's RNG state included."""
    import stagesave.accelerate as sa
    from accel_helpers import build as build_ddp
    from accel_helpers import snapshot as snapshot_ddp
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    os.environ["STAGESAVE_ACCELERATE_MAX_PENDING"] = "1"
    sa.enable_globally()  # python -m stagesave.accelerate: the script never calls enable()
    root = os.path.join(out, "ddp")
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=root, automatic_checkpoint_naming=True, total_limit=2))
    run = build_ddp(acc)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(1000 + rank)  # every process has its own RNG streams
    ckpt = sa.enabled(acc)
    result.update({
        "distributed_type": str(acc.distributed_type), "num_processes": acc.num_processes,
        "enabled_by_runner": ckpt is not None and ckpt.asynchronous,
        "max_pending_from_env": ckpt.options.max_pending if ckpt else None,
    })
    assert ckpt is not None
    before = None
    for i in range(3):
        train(acc, run, 1)
        if i == 2:
            before = snapshot_ddp(acc, run)
        acc.save_state()
    train(acc, run, 3)
    acc.load_state()
    result["iteration"] = acc.project_configuration.iteration
    check(result, "stagesave_restore", lambda: assert_same(before, snapshot_ddp(acc, run)))
    folder = os.path.join(root, "checkpoints", "checkpoint_2")
    result["folders"] = sorted(os.listdir(os.path.join(root, "checkpoints")))
    result["files"] = sorted(os.listdir(folder))
    result["bad_zips"] = real_zips(folder)
    train(acc, run, 2)
    Accelerator.load_state(acc, folder)  # Accelerate's own load_state, in every process
    check(result, "plain_restore", lambda: assert_same(before, snapshot_ddp(acc, run)))
    # save_on_each_node: every node's local main writes the folder, with every rank's RNG states
    config = acc.project_configuration
    config.automatic_checkpoint_naming, config.save_on_each_node = False, True
    each = os.path.join(out, "each_node")
    before_each = snapshot_ddp(acc, run)
    acc.save_state(each)
    ckpt.wait()
    acc.wait_for_everyone()
    result["each_node_files"] = sorted(os.listdir(each))
    train(acc, run, 1)
    acc.load_state(each)
    check(result, "each_node_restore", lambda: assert_same(before_each, snapshot_ddp(acc, run)))
    sa.disable(acc)
    sa.disable_globally()


# ----------------------------------------------------------------------------- fsdp_save
def explicit_folders(rank: int, out: str, result: dict[str, Any]) -> None:
    import stagesave.accelerate as sa
    from accelerate import Accelerator

    import stagesave
    import stagesave.dcp as sdcp

    acc = accelerator()
    run = build(acc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = sa.enable(acc)
    result["fallback_warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, sa.SynchronousFallbackWarning)
    ]
    result["asynchronous"] = ckpt.asynchronous
    train(acc, run, 2)
    before = snapshot(acc, run)
    plain, staged = os.path.join(out, "plain"), os.path.join(out, "staged")
    Accelerator.save_state(acc, plain)  # Accelerate's own FSDP save (FileSystemWriter)
    t0 = time.perf_counter()
    returned = acc.save_state(staged)
    result["blocking_s"] = time.perf_counter() - t0
    result["returned"] = str(returned)
    result["pending_after_return"] = ckpt.pending()
    ckpt.wait()
    acc.wait_for_everyone()
    if rank == 0:
        result["plain_tree"] = tree(plain)
        result["staged_tree"] = tree(staged)
        result["verify"] = stagesave.verify(staged).status
        result["parts_verify"] = [stagesave.verify(os.path.join(staged, p)).status
                                  for p in ("pytorch_model_fsdp_0", "optimizer_0")]
        # the carrier's proof
        result["metadata"] = stagesave.verify(staged).manifest.metadata["accelerate"]
        result["bad_zips"] = real_zips(staged)

        def same_contents() -> None:
            for name in (
                "scheduler.bin",
                "custom_checkpoint_0.pkl",
                "random_states_0.pkl",
                "random_states_1.pkl",
            ):
                assert_same(
                    load_file_content(os.path.join(plain, name)),
                    load_file_content(os.path.join(staged, name)),
                    name,
                )
            for part in ("pytorch_model_fsdp_0", "optimizer_0"):
                theirs = sdcp.to_state_dict(os.path.join(plain, part), verify=False)
                ours = sdcp.to_state_dict(os.path.join(staged, part))
                assert_same(theirs, ours, part)

        check(result, "same_contents", same_contents)
    train(acc, run, 3)
    acc.load_state(staged)  # stagesave: verified, DCP parts through StagedStorageReader
    check(result, "stagesave_restore", lambda: assert_same(before, snapshot(acc, run)))
    train(acc, run, 2)
    Accelerator.load_state(acc, staged)  # Accelerate's own load_state reads stagesave's folder
    check(result, "plain_reads_stagesave", lambda: assert_same(before, snapshot(acc, run)))
    train(acc, run, 1)
    acc.load_state(plain)  # stagesave reads Accelerate's own folder
    check(result, "stagesave_reads_plain", lambda: assert_same(before, snapshot(acc, run)))
    try:
        acc.save_state(staged)
        result["overwrite"] = "no error"
    except ValueError as exc:
        result["overwrite"] = str(exc)
    sa.disable(acc)


def automatic_naming(rank: int, out: str, result: dict[str, Any]) -> None:
    import stagesave.accelerate as sa
    from accelerate import Accelerator

    project = os.path.join(out, "auto")
    root = os.path.join(project, "checkpoints")
    acc = accelerator(project, total_limit=2)
    run = build(acc)
    ckpt = sa.enable(acc)
    states = []
    for _ in range(3):
        train(acc, run, 1)
        states.append(snapshot(acc, run))
        acc.save_state()
    ckpt.wait()
    acc.wait_for_everyone()
    result["auto_listing"] = sorted(os.listdir(root))  # hidden entries included
    result["auto_project_listing"] = sorted(os.listdir(project))
    train(acc, run, 2)
    acc.load_state()
    result["auto_iteration"] = acc.project_configuration.iteration
    check(result, "auto_restore", lambda: assert_same(states[2], snapshot(acc, run)))

    if rank == 0:  # one flipped byte in the data of rank 1's shard of the newest model
        with open(
            os.path.join(root, "checkpoint_2", "pytorch_model_fsdp_0", "__1_0.distcp"), "r+b"
        ) as f:
            f.seek(16)  # the shard's bytes come first; its proof is a trailer at the end
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
    acc.wait_for_everyone()
    train(acc, run, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state()
    result["corrupt_warnings"] = [str(w.message) for w in caught if "stagesave" in str(w.message)]
    result["corrupt_iteration"] = acc.project_configuration.iteration
    check(result, "corrupt_skipped", lambda: assert_same(states[1], snapshot(acc, run)))

    train(acc, run, 1)
    after = snapshot(acc, run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.save_state()  # checkpoint_2 again: the corrupt folder is replaced
    result["replace_warnings"] = [str(w.message) for w in caught if "stagesave" in str(w.message)]
    ckpt.wait()
    acc.wait_for_everyone()
    result["replaced_listing"] = sorted(os.listdir(root))
    train(acc, run, 1)
    Accelerator.load_state(acc)  # plain Accelerate's automatic choice: the new checkpoint_2
    check(result, "replaced_plain_restore", lambda: assert_same(after, snapshot(acc, run)))
    sa.disable(acc)


class _Unpicklable:
    """A registered object whose state holds a lambda: staging it fails on the main process."""

    def state_dict(self) -> dict[str, Any]:
        return {"fn": lambda: 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def failed_save(rank: int, out: str, result: dict[str, Any]) -> None:
    """The main process fails while staging, after every rank submitted its DCP parts."""
    import stagesave.accelerate as sa

    project = os.path.join(out, "failed")
    acc = accelerator(project)
    run = build(acc)
    ckpt = sa.enable(acc)
    train(acc, run, 1)
    acc.save_state()
    acc.register_for_checkpointing(_Unpicklable())
    try:
        acc.save_state()
        result["failed_save"] = "no error"
    except Exception as exc:  # noqa: BLE001, RUF100 - reported to the test
        result["failed_save"] = f"{type(exc).__name__}: {exc}"
    ckpt.wait()
    acc.wait_for_everyone()
    # hidden ones too
    result["failed_listing"] = sorted(os.listdir(os.path.join(project, "checkpoints")))
    result["failed_project_listing"] = sorted(os.listdir(project))
    acc._custom_objects.pop()
    sa.disable(acc)


def crash(rank: int, out: str, result: dict[str, Any], save: Any) -> None:
    import stagesave.accelerate as sa

    acc = accelerator(os.path.join(out, "crash"))
    run = build(acc)
    ckpt = sa.enable(acc, writer="thread")  # the crash point is in this process's writer
    train(acc, run, 1)
    acc.save_state()
    ckpt.wait()
    acc.wait_for_everyone()
    torch.save(snapshot(acc, run), os.path.join(out, f"expected-rank{rank}.pt"))
    train(acc, run, 1)
    if rank == 0:
        os.environ["STAGESAVE_CRASH_AT"] = CRASH_POINT
    result["crash_armed"] = True
    save()  # everything before the crash is on disk
    acc.save_state()  # returns after staging; rank 0 dies in its background commit
    ckpt.wait()  # rank 1 waits for a commit that never comes; the launcher kills it
    result["crash_missed"] = True
    save()


# ----------------------------------------------------------------------------- fsdp_resume
def fsdp_resume(rank: int, out: str, result: dict[str, Any], save: Any) -> None:
    import stagesave.accelerate as sa
    from accelerate import Accelerator

    project = os.path.join(out, "crash")
    root = os.path.join(project, "checkpoints")
    expected = torch.load(os.path.join(out, f"expected-rank{rank}.pt"), weights_only=False)
    # hidden entries included: the killed save's work folder
    result["listing"] = sorted(os.listdir(root))
    result["project_listing"] = sorted(os.listdir(project))
    acc = accelerator(project)
    run = build(acc, seed=3)
    sa.enable(acc)
    acc.load_state()  # stagesave never takes the work folder for a checkpoint
    check(result, "stagesave_resume", lambda: assert_same(expected, snapshot(acc, run)))
    sa.disable(acc)
    # plain Accelerate would sort the debris (".checkpoint_1...") as the newest: gc first
    if rank == 0:
        gc = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "stagesave"), "gc", project],
            capture_output=True,
            text=True,
            check=False,
        )
        result["gc"] = [gc.returncode, gc.stdout[-2000:], gc.stderr[-2000:]]
    acc.wait_for_everyone()
    result["listing_after_gc"] = sorted(os.listdir(root))
    train(acc, run, 2)
    Accelerator.load_state(acc)  # plain Accelerate, no stagesave: picks the last good folder
    check(result, "plain_resume", lambda: assert_same(expected, snapshot(acc, run)))
    ckpt = sa.enable(acc)
    result["iteration"] = acc.project_configuration.iteration
    acc.save_state()
    ckpt.wait()
    acc.wait_for_everyone()
    result["listing_after"] = sorted(os.listdir(root))
    sa.disable(acc)


def fsdp_save(rank: int, out: str, result: dict[str, Any], save: Any) -> None:
    for scenario in (explicit_folders, automatic_naming, failed_save):
        try:
            scenario(rank, out, result)
        except Exception:
            result[f"{scenario.__name__}_error"] = traceback.format_exc()
            raise
        save()
    crash(rank, out, result, save)


# ----------------------------------------------------------------------------- one process
#: Crash points of the single-process crash test: the third file of the third save (6 files per
#: save: model, optimizer, scheduler, RNG, two custom objects), and just before the final rename:
#: the folder's carrier (optimizer.bin, sealed last) has its proof, 6 proofs per save.
SINGLE_CRASHES = {
    "third-file-of-third-save": "after_data:15",
    "carrier-proof-before-rename": "after_proof:18",
}


def crash_single(out: str) -> None:
    """A single-process run with ``total_limit=1`` killed during its third save."""
    import stagesave.accelerate as sa
    from accel_helpers import build as build_ddp
    from accel_helpers import snapshot as snapshot_ddp
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=out, automatic_checkpoint_naming=True, total_limit=1))
    run = build_ddp(acc)
    ckpt = sa.enable(acc)
    for i in range(3):
        train(acc, run, 1)
        if i == 1:
            torch.save(snapshot_ddp(acc, run), os.path.join(out, "expected.pt"))
        acc.save_state()
        if i < 2:
            ckpt.wait()
    ckpt.wait()
    print("NOT KILLED")


def example2_crash(rank: int, out: str, result: dict[str, Any], save: Any) -> None:
    """The example on 2 ranks, killed right after the save of step 8 returned (at step 10)."""
    import runpy

    sys.argv = [
        EXAMPLE,
        "--output",
        os.path.join(out, "run2"),
        *EXAMPLE_ARGS,
        "--crash-after-step",
        "10",
    ]
    runpy.run_path(EXAMPLE, run_name="__main__")


PHASES = {
    "ddp": ddp,
    "fsdp_save": fsdp_save,
    "fsdp_resume": fsdp_resume,
    "example2_crash": example2_crash,
}


# ----------------------------------------------------------------------------- processes
def _child(phase: str, rank: int, world: int, out: str) -> None:
    log = os.open(
        os.path.join(out, f"{phase}-rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
    )
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
        }
    )
    for var in list(os.environ):
        if var.startswith(("STAGESAVE_CRASH_AT", "STAGESAVE_ACCELERATE")):
            del os.environ[var]
    torch.set_num_threads(1)
    path = os.path.join(out, f"{phase}-rank{rank}.json")
    result: dict[str, Any] = {"rank": rank}

    def save() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)

    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, phase + '.rdzv')}",
                                rank=rank, world_size=world)
        PHASES[phase](rank, out, result, save)
        result["ok"] = True
    except BaseException:  # noqa: BLE001, RUF100 - reported to the test
        result["error"] = traceback.format_exc()
        code = 1
    save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never hang in teardown of a group with a dead peer


def launch(phase: str, world: int, out: str, timeout: float = 400.0) -> list[Any]:
    """Fork ``world`` ranks of ``phase``; once one is SIGKILLed, kill the others (they would wait
    for it until their commit deadline). Returns every rank's exit code (or ``"timeout"``)."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_child, args=(phase, r, world, out)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    codes: list[Any] = [None] * world
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode == -9 for p in procs):
            for p in procs:
                if p.exitcode is None:
                    p.kill()
        time.sleep(0.05)
    for i, p in enumerate(procs):
        if p.exitcode is None:
            p.kill()
            p.join()
            codes[i] = "timeout"
        else:
            p.join()
            codes[i] = p.exitcode
    return codes


#: examples/accelerate_finetune.py and the arguments of its runs in the tests.
EXAMPLE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "accelerate_finetune.py"
)
EXAMPLE_ARGS = ["--steps", "12", "--save-every", "4", "--total-limit", "2"]
EXAMPLE_RUNS = {
    "example-reference": ("reference", []),
    "example-crash": ("run1", ["--crash-after-step", "10"]),
    "example-resume": ("run1", []),
}


def _example(out: str, name: str, folder: str, extra: list[str]) -> None:
    import runpy

    log = os.open(os.path.join(out, f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "STAGESAVE_CRASH_AT"):
        os.environ.pop(var, None)
    sys.argv = [EXAMPLE, "--output", os.path.join(out, folder), *EXAMPLE_ARGS, *extra]
    code = 0
    try:
        runpy.run_path(EXAMPLE, run_name="__main__")
    except BaseException:  # noqa: BLE001, RUF100 - the log tells the test
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _listing(folder: str) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _fork(target: Any, *args: Any) -> Any:
    """Run ``target(*args)`` in a forked child; its exit code (``"timeout"`` after 300 s)."""
    return _fork_pid(target, *args)[0]


def _fork_pid(target: Any, *args: Any) -> tuple[Any, int]:
    """:func:`_fork`, and the child's pid."""
    p = multiprocessing.get_context("fork").Process(target=target, args=args)
    p.start()
    p.join(300)
    if p.exitcode is None:
        p.kill()
        p.join()
        return "timeout", p.pid or 0
    return p.exitcode, p.pid or 0


def _agents_done(trainer_pid: int) -> None:
    """Wait until the writer agents of the killed ``trainer_pid`` have committed what they were
    handed and exited (a save that returned before the kill is committed by its agent then)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from agentwatch import agents_of, exited

    for agent in agents_of(trainer_pid):
        assert exited(agent), f"the writer agent {agent} of {trainer_pid} did not exit"


def _single(out: str, point: str) -> None:
    log = os.open(os.path.join(out, "log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(var, None)
    os.environ["STAGESAVE_CRASH_AT"] = point
    os.environ["STAGESAVE_WRITER"] = "thread"  # the crash point is in this process's writer
    torch.set_num_threads(1)
    code = 0
    try:
        crash_single(out)
    except BaseException:  # noqa: BLE001, RUF100 - the log tells the test
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    codes: dict[str, Any] = {phase: launch(phase, 2, out) for phase in PHASES}
    for name, point in SINGLE_CRASHES.items():
        folder = os.path.join(out, f"crash-{name}")
        os.makedirs(folder)
        codes[f"crash-{name}"] = _fork(_single, folder, point)
    for name, (folder, extra) in EXAMPLE_RUNS.items():
        codes[name], pid = _fork_pid(_example, out, name, folder, extra)
        if name == "example-crash":  # what the kill left, before the resume changes it
            _agents_done(pid)
            codes["example-crash-left"] = _listing(os.path.join(out, folder, "checkpoints"))
    codes["example2_crash-left"] = _listing(os.path.join(out, "run2", "checkpoints"))
    with open(os.path.join(out, "exit.json"), "w") as f:
        json.dump(codes, f)


if __name__ == "__main__":
    main(sys.argv[1])
