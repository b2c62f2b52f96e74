"""Restore from a writer agent's memory against a cold read from storage (issue 21).

Usage: python benchmarks/bench_agent_restore.py --gib 2 --rounds 3 \\
    [--dir /path/on/the/disk] [--json benchmarks/results/writer21/agent-restore.json]

A trainer process builds a transformer-like state (``common.transformer_state``), saves it with
``writer="process"``, waits until the save is committed (``ck.wait()``) and SIGKILLs itself: its
writer agent keeps the newest committed file's staging segment as a *snapshot* in
``$STAGESAVE_SHM_DIR`` (a private folder under /dev/shm made by this script) and exits. A
restarted process's ``Checkpointer.load(path)`` then loads from that memory instead of reading
storage. A snapshot is consumed by the load that uses it, so a fresh trainer recreates it before
every snapshot measurement.

Every measurement runs in a fresh process after the page cache was dropped (root only; a
snapshot lives in tmpfs, which dropping the page cache does not touch) and ends once every
tensor's bytes were touched (summed), as in ``bench_restore.py``. Interleaved rounds (the order
rotates), medians, ratios against the cold ``Checkpointer.load`` from storage:

* ``Checkpointer.load(path)`` from the snapshot (``verify=True``, the default: the memory is
  hashed against the file's proof);
* ``Checkpointer.load(path, verify=False)`` from the snapshot (a snapshot's bytes are matched
  against the proof even then: a trainer killed while staging into the segment leaves it torn);
* ``Checkpointer.load(path)`` and ``load(path, verify=False)`` from storage, no snapshot present;
* ``torch.load(weights_only=True)`` of a ``torch.save`` file of the same state.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

import stagesave
from stagesave.agent.segments import owned_segments, read_snapshot, remove_segment

GIB = 1 << 30
VARIANTS = [
    "snapshot_verify",
    "snapshot_noverify",
    "storage_verify",
    "storage_noverify",
    "torch_load",
]
LABELS = {
    "snapshot_verify": "Checkpointer.load from the agent's snapshot (verify)",
    "snapshot_noverify": "Checkpointer.load(verify=False) from the agent's snapshot",
    "storage_verify": "Checkpointer.load from storage, cold (verify)",
    "storage_noverify": "Checkpointer.load(verify=False) from storage, cold",
    "torch_load": "torch.load(weights_only=True) of a torch.save file, cold",
}
REFERENCE = "storage_verify"
AGENT_TIMEOUT_S = 300.0


def build_state(gib: float) -> dict[str, Any]:
    nbytes = int(gib * GIB)
    return common.transformer_state(nbytes, d_model=common.d_model_for(nbytes))


def touch(state: Any) -> float:
    """Sum every tensor: each byte of each tensor is read (mapped pages faulted in)."""
    return sum(float(t.sum()) for t in common.tensors_of(state))


# ---------------------------------------------------------------------------- child processes
def child_save(path: str, gib: float) -> None:
    """A trainer: save with a writer agent, wait for the commit, die by SIGKILL."""
    state = build_state(gib)
    ck = stagesave.Checkpointer(writer="process")
    ck.save(state, path)
    ck.wait()
    agent = ck.writer.agent
    pid = agent.pid if agent is not None else None
    print(json.dumps({"agent_pid": pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def child_measure(variant: str, ours: str, theirs: str) -> None:
    """One restore, timed until every tensor was touched; prints seconds and what it saw."""
    before = len(owned_segments())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        if variant == "torch_load":
            touch(torch.load(theirs, weights_only=True))
        else:
            with stagesave.Checkpointer() as ck:
                touch(ck.load(ours, verify=variant.endswith("_verify")))
        seconds = time.perf_counter() - t0
    after = len(owned_segments())
    print(json.dumps({"s": seconds, "segments_before": before, "segments_after": after,
                      "warnings": [str(w.message) for w in caught]}), flush=True)


# ---------------------------------------------------------------------------- the parent
def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                          capture_output=True, text=True, check=False)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"Z"  # a zombie nobody reaped
    except OSError:
        return True


def make_snapshot(path: str, gib: float) -> float:
    """A trainer saves ``path`` with a writer agent and is SIGKILLed; wait until its agent kept
    the snapshot and exited. Seconds from the start of the trainer until then."""
    t0 = time.perf_counter()
    r = _run(["--child-save", path, "--gib", str(gib)])
    if r.returncode != -signal.SIGKILL:
        raise RuntimeError(f"the trainer exited with {r.returncode}, not SIGKILL:\n{r.stderr}")
    pid = json.loads(r.stdout.strip().splitlines()[-1])["agent_pid"]
    if not isinstance(pid, int):
        raise TypeError(f"the trainer reported no writer agent's pid: {pid!r}")
    deadline = time.perf_counter() + AGENT_TIMEOUT_S
    while not _gone(pid):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the writer agent {pid} did not exit in {AGENT_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    segments = owned_segments()
    snaps = [read_snapshot(s) for s in segments]
    if len(segments) != 1 or snaps[0] is None or snaps[0].path != path:
        raise RuntimeError(f"expected one snapshot of {path}, found {segments}")
    return time.perf_counter() - t0


def measure(variant: str, ours: str, theirs: str) -> dict[str, Any]:
    common.drop_caches()
    r = _run(["--child-measure", variant, ours, theirs])
    if r.returncode:
        raise RuntimeError(f"{variant} failed:\n{r.stderr}")
    got: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    from_memory = variant.startswith("snapshot")
    expected = (1, 0) if from_memory else (0, 0)
    seen = (got["segments_before"], got["segments_after"])
    if seen != expected or (from_memory and got["warnings"]):
        raise RuntimeError(f"{variant}: segments before/after {seen}, expected {expected}; "
                           f"warnings {got['warnings']}")
    return got


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", "src"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return r.stdout.strip() + (" (src/ modified)" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", default=None, help="folder on the disk (default: a temp dir)")
    ap.add_argument("--shm-parent", default="/dev/shm",
                    help="RAM filesystem for the private $STAGESAVE_SHM_DIR (default /dev/shm)")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child-save", metavar="PATH", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-measure", nargs=3, metavar=("VARIANT", "OURS", "THEIRS"),
                    default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_save:
        child_save(args.child_save, args.gib)
        return
    if args.child_measure:
        child_measure(*args.child_measure)
        return

    command = shlex.join(["python", *sys.argv])
    base = tempfile.mkdtemp(prefix="bench-agent-restore-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="bench-agent-restore-shm-", dir=args.shm_parent)
    os.environ["STAGESAVE_SHM_DIR"] = shm  # the children's segments, apart from anyone else's
    ours = os.path.join(base, "ours.ckpt")
    theirs = os.path.join(base, "theirs.pt")
    cold = common.drop_caches()
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    snapshot_s: list[float] = []
    try:
        state = build_state(args.gib)
        nbytes = common.state_bytes(state)
        n_tensors = len(common.tensors_of(state))
        with open(theirs, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        del state
        # the stagesave file exists before round 1 (its first snapshot is not needed: removed)
        snapshot_s.append(make_snapshot(ours, args.gib))
        for seg in owned_segments():
            remove_segment(seg)
        print(f"{nbytes / GIB:.2f} GiB in {n_tensors} tensors; stagesave file "
              f"{os.path.getsize(ours) / GIB:.2f} GiB, torch.save file "
              f"{os.path.getsize(theirs) / GIB:.2f} GiB; STAGESAVE_SHM_DIR={shm}", flush=True)
        for r in range(args.rounds):  # interleaved: every variant once per round, order rotates
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for variant in order:
                if variant.startswith("snapshot"):
                    snapshot_s.append(make_snapshot(ours, args.gib))
                got = measure(variant, ours, theirs)
                runs[variant].append(got["s"])
                print(f"  round {r + 1}/{args.rounds} {LABELS[variant]:60} {got['s']:7.3f} s",
                      flush=True)
    finally:
        for seg in owned_segments():
            remove_segment(seg)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    ref = statistics.median(runs[REFERENCE])
    medians = {v: statistics.median(runs[v]) for v in VARIANTS}
    print(f"\n| restore ({nbytes / GIB:.2f} GiB, {n_tensors} tensors; median of {args.rounds}) "
          "| seconds | × cold `load` from storage |")
    print("|---|---|---|")
    for v in VARIANTS:
        print(f"| {LABELS[v]} | {medians[v]:.3f} ({min(runs[v]):.3f}–{max(runs[v]):.3f}) | "
              f"{medians[v] / ref:.2f} |")
    print(f"\nrecreating a snapshot (a trainer builds the state, saves, is killed; its agent "
          f"exits): median {statistics.median(snapshot_s):.1f} s")
    if not cold:
        print("page cache could not be dropped (not root): every storage figure is warm")
    if args.json:
        doc = {
            "meta": {
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "command": command, "commit": git_commit(), "cpus": os.cpu_count(),
                "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                "gib": args.gib, "rounds": args.rounds, "bytes": nbytes, "tensors": n_tensors,
                "cold": cold, "reference": REFERENCE,
            },
            "labels": LABELS,
            "runs": runs,
            "medians": medians,
            "over_reference": {v: medians[v] / ref for v in VARIANTS},
            "snapshot_recreate_s": snapshot_s,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
