"""What a verified resume costs: choosing with ``latest()`` (verifying) and loading, side by side.

Usage: python benchmarks/bench_resume_verify.py --dir /path/on/the/disk --gib 0.5 2 --rounds 3

For each size, a directory holds two checkpoints of a transformer-like state (the newest one is
what every variant resumes from). Each variant runs in a fresh process, as a resume does (no
verification remembered, torch imported before the clock starts), and times the choice, the
load and a touch of every tensor's bytes (what copying into the model costs; with ``mmap`` the
pages are read only then):

* ``latest(verify=False) + load``: the proof read, the bytes verified by ``load`` (its default);
* ``latest() + load``: verified while choosing; the load reuses that verification (same inode,
  unchanged) and hashes nothing again;
* ``resume_from(last) + load``: Lightning's ``ckpt_path="last"`` with the plugin: the path
  Lightning chose, verified before the load (which reuses the verification);
* ``latest() + load, not shared``: the same with the remembered verification forgotten in
  between: what reading and hashing twice would cost;
* ``load(verify=True)``: the path known, verified by the load alone;
* ``load(verify=False)``: the floor, nothing hashed.

Cold runs drop the page cache before each process (root only: ``/proc/sys/vm/drop_caches``);
otherwise, and in the warm runs, the files are in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402, RUF100 - after the sys.path insertion

import stagesave  # noqa: E402, RUF100 - after the sys.path insertion

_CHILD = textwrap.dedent(
    """
    import json, sys, time, warnings
    import torch, stagesave
    from stagesave.restore import discovery as _discovery
    root, variant = sys.argv[1], sys.argv[2]
    warnings.simplefilter("ignore")
    newest = root + "/step-2.ckpt"
    t0 = time.perf_counter()
    with stagesave.Checkpointer(root) as ck:
        if variant == "latest_noverify+load":
            path = ck.latest(verify=False).path
        elif variant == "resume_from+load":
            path = ck.resume_from(newest)
        elif variant.startswith("latest+load"):
            path = ck.latest().path
            if variant == "latest+load_unshared":
                _discovery.forget_verified()
        else:
            path = newest
        assert path == newest, path
        t1 = time.perf_counter()
        state = ck.load(path, verify=variant != "load_noverify")
        t2 = time.perf_counter()
        total = 0.0
        stack = [state]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                total += float(x.sum())
            elif isinstance(x, dict):
                stack.extend(x.values())
        t3 = time.perf_counter()
    print(json.dumps({"choose_s": t1 - t0, "load_s": t2 - t1, "touch_s": t3 - t2,
                      "total_s": t3 - t0}))
    """
)

VARIANTS = [
    "latest_noverify+load",
    "latest+load",
    "resume_from+load",
    "latest+load_unshared",
    "load_verify",
    "load_noverify",
]
LABELS = {
    "latest_noverify+load": "latest(verify=False) + load",
    "latest+load": "latest() + load (shared)",
    "resume_from+load": "resume_from(last) + load",
    "latest+load_unshared": "latest() + load, not shared",
    "load_verify": "load(verify=True) alone",
    "load_noverify": "load(verify=False) (floor)",
}


def run_child(root: str, variant: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, root, variant],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if r.returncode:
        raise RuntimeError(f"{variant} failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--dir", default=None, help="where to write the checkpoints (default: a temporary dir)"
    )
    ap.add_argument("--gib", type=float, nargs="+", default=[0.5, 2.0])
    ap.add_argument(
        "--rounds", type=int, default=3, help="runs per variant and cache state (median reported)"
    )
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-resume-", dir=args.dir)
    can_drop = common.drop_caches()
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    try:
        for gib in args.gib:
            root = os.path.join(base, f"{gib:g}GiB")
            nbytes = int(gib * (1 << 30))
            state = common.transformer_state(nbytes, d_model=common.d_model_for(nbytes))
            with stagesave.Checkpointer(root) as ck:
                for step in (1, 2):
                    state["step"] = step
                    ck.save(state, f"step-{step}.ckpt").result()
            del state
            size = os.path.getsize(os.path.join(root, "step-2.ckpt"))
            key = f"{size / (1 << 30):.2f} GiB"
            results[key] = {}
            caches = (["cold"] if can_drop else []) + ["warm"]
            for cache in caches:
                for variant in args.variants:
                    runs: dict[str, list[float]] = {}
                    for _ in range(args.rounds):
                        if cache == "cold":
                            common.drop_caches()
                        else:
                            run_child(root, "load_noverify")  # the file in the page cache
                        for k, v in run_child(root, variant).items():
                            runs.setdefault(k, []).append(v)
                    results[key][f"{cache}/{variant}"] = runs
                    med = {k: statistics.median(v) for k, v in runs.items()}
                    print(
                        f"{key} {cache:4} {LABELS[variant]:30} choose {med['choose_s']:6.3f} s  "
                        f"load {med['load_s']:6.3f} s  touch {med['touch_s']:6.3f} s  "
                        f"total {med['total_s']:6.3f} s  (min total {min(runs['total_s']):.3f})",
                        flush=True,
                    )
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if not can_drop:
        print("page cache could not be dropped (not root): every figure is warm-cache")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"page_cache_dropped": can_drop, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
