"""How discovery scales with the number of checkpoints in a directory.

For N checkpoints (real saves of a small state, each with its own sequence number) in one
directory, measured in fresh processes (nothing cached in the process; the files themselves in
the page cache, as on a node that just wrote them):

* ``latest(verify=False)``: list the directory, read each file's summary, read and check the newest
  proof (the listing's cost; ``bench_resume_verify.py`` measures the verifying default);
* ``list()``;
* a ``keep_last`` save: the time its retention takes (the scan under the commit lock, plus
  removing the one checkpoint it pushes out) and the save's whole time to commit.

Run it against the code under test, or (``--src``) against another checkout's ``src`` and
``integrations`` (e.g. the format-1 commit) for a side-by-side figure::

    .venv/bin/python benchmarks/bench_discovery.py --counts 250 2000 10000
    git worktree add /tmp/f1 61c2ee3
    .venv/bin/python benchmarks/bench_discovery.py --counts 250 2000 --src /tmp/f1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

_CHILD = textwrap.dedent(
    """
    import json, sys, time, warnings
    sys.path[:0] = {paths!r}
    import stagesave, torch
    root, what, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    warnings.simplefilter("ignore")
    out = {{}}
    if what == "make":
        t0 = time.perf_counter()
        with stagesave.Checkpointer(root) as ck:
            have = len(ck.list())
            for i in range(have, n):
                ck.save({{"step": i, "w": torch.full((16,), float(i))}},
                        f"step={{i:06d}}.ckpt").result()
        out["make_s"] = time.perf_counter() - t0
    elif what == "latest":
        t0 = time.perf_counter()
        info = stagesave.latest(root, verify=False)
        out["latest_s"] = time.perf_counter() - t0
        out["name"] = info.name
        import importlib
        forget = getattr(importlib.import_module("stagesave.restore.discovery"), "forget", None)
        if forget is not None:  # format 2 caches what a listing learnt: measure it cold
            from stagesave.stores.local import LocalStore
            forget(LocalStore(root), "")
        t0 = time.perf_counter()
        found = stagesave.list_checkpoints(root)
        out["list_s"] = time.perf_counter() - t0
        out["listed"] = len(found)
    elif what == "retain":
        with stagesave.Checkpointer(root, keep_last=n) as ck:
            state = {{"step": 10**7, "w": torch.full((16,), -1.0)}}
            t0 = time.perf_counter()
            h = ck.save(state, "newest.ckpt")
            h.result()
            out["save_to_commit_s"] = time.perf_counter() - t0
            # the retention alone, as the save ran it (a fresh process: nothing cached)
        import importlib
        disc = importlib.import_module("stagesave.restore.discovery")
        with stagesave.Checkpointer(root, keep_last=n) as ck2:
            store = ck2.targets.root
            if hasattr(disc, "forget"):  # format 2: nothing cached
                from stagesave.saving.commit import retain
                disc.forget(store, "")
                t0 = time.perf_counter()
                retain(store, "", n)
            else:  # format 1 (the previous commit)
                t0 = time.perf_counter()
                ck2._retain(store, "")
            out["retention_s"] = time.perf_counter() - t0
    print(json.dumps(out))
    """
)


def _run(paths: list[str], root: str, what: str, n: int) -> dict[str, object]:
    code = _CHILD.format(paths=paths)
    done = subprocess.run(
        [sys.executable, "-c", code, root, what, str(n)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"child failed ({what}, {n}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[250, 2000, 10000])
    ap.add_argument("--src", help="another checkout to measure (its src/ and integrations/)")
    ap.add_argument(
        "--dir", help="where to create the checkpoints (default: a temporary directory)"
    )
    ap.add_argument(
        "--repeat", type=int, default=3, help="fresh-process measurements per count (median)"
    )
    args = ap.parse_args()
    paths: list[str] = []
    if args.src:
        # the checkout's package layout (pyproject maps stagesave.{lightning,accelerate} too; the
        # core suffices)
        paths = [os.path.join(args.src, "src")]
    base = args.dir or tempfile.mkdtemp(prefix="stagesave-discovery-")
    root = os.path.join(base, "ckpt")
    os.makedirs(root, exist_ok=True)
    label = args.src or "this checkout"
    print(f"# discovery at N checkpoints ({label}); medians of {args.repeat} fresh processes")
    print(
        "| N | latest() | list() | keep_last save: retention | save to commit | (creating N saves) "
        "|"
    )
    print("|---|---|---|---|---|---|")
    for n in sorted(args.counts):
        t0 = time.perf_counter()
        made = _run(paths, root, "make", n)
        rows = [_run(paths, root, "latest", n) for _ in range(args.repeat)]
        assert all(r["listed"] == n for r in rows), rows
        ret = [_run(paths, root, "retain", n) for _ in range(args.repeat)]
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731, RUF100
        print(
            f"| {n} | {med([r['latest_s'] for r in rows]):.3f} s "
            f"| {med([r['list_s'] for r in rows]):.3f} s "
            f"| {med([r['retention_s'] for r in ret]):.3f} s "
            f"| {med([r['save_to_commit_s'] for r in ret]):.3f} s "
            f"| {made['make_s']:.0f} s, {time.perf_counter() - t0:.0f} s in all |",
            flush=True,
        )


if __name__ == "__main__":
    main()
