"""One run, every alternative, several state sizes: the performance sweep of issue #7.

For each state size (``--sizes``, GiB of synthetic transformer-like state from
``common.transformer_state``) every alternative saves the same state into the same directory,
interleaved within each of ``--repeats`` rounds (the order rotates from round to round) so that
drift of the machine hits all of them alike. Per alternative and round:

- blocking: how long the save call held the training loop, and its ratio to the copy floor (the
  state's bytes copied once into a reused buffer, measured in the same round);
- commit: from the call until the checkpoint is complete (durable where the alternative fsyncs;
  the table says which), and its ratio to the ``dd`` O_DIRECT write floor of the same bytes,
  measured in the same round;
- training time lost per save and the mean and p99 step-time inflation while the background write
  runs (``bench_interference.Loop`` and ``measure``: an MLP on torch's default threads), and its
  ratio to the copy floor plus what the loop loses while ``raw_write.py`` writes the same bytes
  with O_DIRECT in another process (``write_lost_s``: the disk write's own cost to the loop on
  this machine, a floor for the background part of any writer's loss; ``write_s`` is the same
  write alone, a floor without dd's zero-filling of every block);
- the loop's baseline ms/iteration just before and just after the save. An after/before ratio
  well above 1 is an OpenMP regime change (a background thread that ran torch ops, or a gloo
  group, made libgomp wait passively); it is printed, and the next alternative's "before" shows
  whether it outlived the alternative's teardown.

Each round then loads the torch.save file and the stagesave file: ``torch.load`` against
stagesave verified (mmap, the default; and a full copy) and unverified, cold (page cache dropped,
root only) and warm, beside the raw O_DIRECT read floor.

Alternatives that keep something across saves (stagesave's buffer, a reused DCP stager, DCP's
checkpoint daemon process) get one uncounted warm-up save before the measured one, as in training
where only the first save pays for the allocation. Each alternative is torn down after its
measurement so that only one alternative's copies of the state are in memory at a time; at a size
where the state plus an alternative's copies does not fit in the available memory, that
alternative is skipped and the reason printed.

Usage (as root for cold loads; niced if the machine is shared):
  python benchmarks/bench_sweep.py --dir /work/bench-sweep --sizes 0.5,2,8 --repeats 2 \\
      --json sweep.json --markdown sweep.md --png sweep.png
  python benchmarks/bench_sweep.py --quick --png /tmp/sweep.png     # 0.25 GiB, one round
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_interference as interference
import common

import stagesave
from stagesave.cli.alternatives import Alternative, available_alternatives

GIB = 1 << 30
HEADROOM = 1 * GIB  # memory left free beyond the state and an alternative's copies
REGIME_CHANGE = 1.15  # loop slower by this factor after a save than before: flagged
SAVE_TIMEOUT_S = 1800.0
TORCH_SAVE = "torch.save+fsync"
STAGESAVE = "stagesave checksum_in=staging"  # the default for host state (checksum_in="auto")

warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")


# The alternatives are the ones `stagesave bench` runs (stagesave.cli.alternatives, plus what the
# installed integrations contribute: Lightning's AsyncCheckpointIO, Accelerate's save_state). The
# sweep names stagesave's default by its option ("stagesave checksum_in=staging"), so the plain
# "stagesave" entry is left out; Accelerate's save_state is torch.save without fsync and runs in
# bench_accelerate.py with a real model, so it is left out here too.
ALTERNATIVES: list[Alternative] = [a for a in available_alternatives()
                                   if a.name not in ("stagesave", "accelerate save_state")]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def wait_done(done: Callable[[], bool], what: str) -> None:
    end = time.perf_counter() + SAVE_TIMEOUT_S
    while not done():
        if time.perf_counter() > end:
            raise TimeoutError(f"{what} did not finish in {SAVE_TIMEOUT_S:.0f} s")
        time.sleep(0.02)


def run_one(
    alt: Alternative, state: Any, folder: str, loop: interference.Loop, baseline_s: float
) -> dict[str, Any]:
    """Set up ``alt``, warm it up if it keeps state across saves, measure one save, tear down."""
    os.makedirs(folder, exist_ok=True)
    session = alt.make(folder, {})
    try:
        if alt.warmup:
            warm = os.path.join(folder, "warmup")
            os.makedirs(warm)
            _, done = session.start(state, os.path.join(warm, "ckpt"))
            wait_done(done, f"{alt.name} warm-up save")
            session.check()
            session.after_warmup()
            shutil.rmtree(warm)
        os.sync()  # no writeback of earlier saves inside this one's window
        time.sleep(0.5)
        before = loop.baseline(baseline_s)
        m = interference.measure(loop, session.start, state, os.path.join(folder, "ckpt"), before)
        session.check()
        commit = session.commit_s()
        # writeback left behind by an alternative that does not fsync is not the loop's speed
        os.sync()
        after = loop.baseline(baseline_s)
    finally:
        session.close()
        gc.collect()
    return {
        "blocking_s": m["blocking"], "window_s": m["window"],
        "commit_s": commit if commit is not None else m["blocking"] + m["window"],
        "lost_s": m["lost"], "step_mean_x": m["meanx"], "step_p99_x": m["p99x"],
        "baseline_before_ms": before * 1e3, "baseline_after_ms": after * 1e3,
    }


def touch_all(obj: Any) -> None:
    """Read one element of every tensor, so lazily mapped tensors are really there."""
    for t in common.tensors_of(obj):
        if t.numel():
            float(t.reshape(-1)[-1])


def run_loads(torch_path: str | None, ss_path: str | None) -> tuple[dict[str, float], bool]:
    """Cold and warm loads of this round's torch.save and stagesave files; and whether cold was
    possible."""
    out: dict[str, float] = {}
    cold = common.drop_caches()
    if ss_path:
        out["raw O_DIRECT read floor cold"] = common.raw_read_floor_s(ss_path)
    loaders: list[tuple[str, Callable[[], Any]]] = []
    loader = stagesave.Checkpointer(max_pending=1)
    if torch_path:
        loaders.append(("torch.load", lambda: torch.load(torch_path, weights_only=True)))
    if ss_path:
        loaders += [
            ("stagesave load verified (mmap)", lambda: loader.load(ss_path)),
            ("stagesave load verified (copy)", lambda: loader.load(ss_path, mmap=False)),
            (
                "stagesave load unverified (copy)",
                lambda: loader.load(ss_path, verify=False, mmap=False),
            ),
        ]
    try:
        for name, fn in loaders:
            for temp in ("cold", "warm"):
                if temp == "cold":
                    common.drop_caches()
                t0 = time.perf_counter()
                obj = fn()
                touch_all(obj)
                out[f"{name} {temp}"] = time.perf_counter() - t0
                del obj
                gc.collect()
    finally:
        loader.close()
    return out, cold


RAW_WRITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "raw_write.py")


def raw_write_floor_s(base: str, nbytes: int) -> float:
    """Seconds for ``raw_write.py`` (a separate process) to write ``nbytes`` with O_DIRECT +
    fsync."""
    out = subprocess.run(
        [sys.executable, RAW_WRITE, os.path.join(base, "raw-write.bin"), str(nbytes)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out.strip())


def raw_write_lost_s(base: str, nbytes: int, loop: interference.Loop, baseline_s: float) -> float:
    """What the training loop loses while ``raw_write.py`` writes ``nbytes`` in another process.

    No copy, no hashing, no Python between the writes: the disk write's own cost to the loop on
    this machine (interrupts, the kernel pinning pages, the hypervisor's I/O path), a floor for
    the background part of any writer's time lost.
    """
    path = os.path.join(base, "raw-write-lost.bin")
    os.sync()
    time.sleep(0.5)
    before = loop.baseline(baseline_s)

    procs: list[subprocess.Popen[bytes]] = []

    def start(_state: Any, _path: str) -> tuple[float, Callable[[], bool]]:
        procs.append(
            subprocess.Popen(
                [sys.executable, RAW_WRITE, path, str(nbytes)], stdout=subprocess.DEVNULL
            )
        )
        return 0.0, lambda: procs[0].poll() is not None

    lost = float(interference.measure(loop, start, None, path, before)["lost"])
    if procs[0].returncode != 0:
        raise RuntimeError(f"raw_write.py failed (exit {procs[0].returncode}): no raw write floor")
    return lost


def run_size(gib: float, alts: list[Alternative], args: argparse.Namespace, base: str,
             loop: interference.Loop) -> dict[str, Any]:
    """Every alternative on one state size, ``args.repeats`` interleaved rounds, then loads."""
    want = int(gib * GIB)
    avail = common.mem_available_bytes()
    res: dict[str, Any] = {"gib": gib, "skipped": None}
    if 2 * want + HEADROOM > avail:  # the state and one copy (copy floor, loads) at least
        res["skipped"] = (
            f"the state ({gib:g} GiB) and one copy of it need {(2 * want + HEADROOM) / GIB:.1f} "
            f"GiB, {avail / GIB:.1f} GiB available"
        )
        print(f"== {gib:g} GiB: skipped: {res['skipped']}", flush=True)
        return res
    state = common.transformer_state(want, d_model=common.d_model_for(want))
    nbytes = common.state_bytes(state)
    avail = common.mem_available_bytes()
    res.update(
        bytes=nbytes,
        tensors=len(common.tensors_of(state)),
        mem_available_with_state=avail,
        floors={"copy_s": [], "dd_direct_s": [], "write_s": [], "write_lost_s": []},
        loads={},
        cold_cache=None,
        alternatives={},
    )
    print(f"== {gib:g} GiB: {nbytes / GIB:.2f} GiB in {res['tensors']} tensors; "
          f"{avail / GIB:.1f} GiB memory available beside it", flush=True)
    runnable: list[Alternative] = []
    for alt in alts:
        reason = alt.unavailable()
        need = alt.copies * nbytes + HEADROOM
        if reason is None and need > avail:
            reason = (
                f"needs ~{need / GIB:.1f} GiB beside the state ({alt.copies:g} copies + headroom), "
                f"{avail / GIB:.1f} GiB available"
            )
        res["alternatives"][alt.name] = {
            "skipped": reason,
            "durable": alt.durable,
            "note": alt.note,
            "runs": [],
        }
        if reason:
            print(f"   skip {alt.name}: {reason}", flush=True)
        else:
            runnable.append(alt)
    res["loop_start_ms"] = loop.baseline(args.baseline_s) * 1e3
    for r in range(args.repeats):
        gc.collect()
        copy_floor = common.copy_floor_s(state, repeats=1)
        gc.collect()
        dd_floor = common.raw_write_floor_s(base, nbytes)
        write_floor = raw_write_floor_s(base, nbytes)
        write_lost = raw_write_lost_s(base, nbytes, loop, args.baseline_s)
        res["floors"]["copy_s"].append(copy_floor)
        res["floors"]["dd_direct_s"].append(dd_floor)
        res["floors"]["write_s"].append(write_floor)
        res["floors"]["write_lost_s"].append(write_lost)
        print(
            f"   round {r + 1}/{args.repeats}: copy floor {copy_floor:.3f} s, dd O_DIRECT floor "
            f"{dd_floor:.3f} s, raw O_DIRECT write floor {write_floor:.3f} s, the loop lost "
            f"{write_lost:.3f} s to "
            "that raw write",
            flush=True,
        )
        order = runnable[r % len(runnable):] + runnable[:r % len(runnable)] if runnable else []
        kept: dict[str, str] = {}
        for alt in order:
            folder = os.path.join(base, f"r{r}-{slug(alt.name)}")
            try:
                run = run_one(alt, state, folder, loop, args.baseline_s)
            except Exception as exc:  # noqa: BLE001 - one alternative failing must not lose the others' figures
                reason = f"failed in round {r + 1}: {type(exc).__name__}: {exc}"
                res["alternatives"][alt.name]["skipped"] = reason
                runnable.remove(alt)
                print(f"   !! {alt.name}: {reason}; not run again", flush=True)
                shutil.rmtree(folder, ignore_errors=True)
                continue
            run.update(round=r, copy_floor_s=copy_floor, dd_floor_s=dd_floor,
                       blocking_over_copy_floor=run["blocking_s"] / copy_floor,
                       commit_over_dd_floor=run["commit_s"] / dd_floor,
                       lost_over_copy_floor=run["lost_s"] / copy_floor,
                       commit_over_write_floor=run["commit_s"] / write_floor,
                       lost_over_copy_and_write_floor=run["lost_s"] / (copy_floor + write_lost))
            res["alternatives"][alt.name]["runs"].append(run)
            drift = run["baseline_after_ms"] / run["baseline_before_ms"]
            print(
                f"   {alt.name:42s} blocking {run['blocking_s']:7.3f} s  commit "
                f"{run['commit_s']:7.3f} s  lost {run['lost_s']:7.3f} s  p99 "
                f"{run['step_p99_x']:5.2f}x  loop {run['baseline_before_ms']:.1f} -> "
                f"{run['baseline_after_ms']:.1f} ms/it",
                flush=True,
            )
            if drift > REGIME_CHANGE:
                print(
                    f"   !! {alt.name}: the loop ran {drift:.2f}x slower after the save than "
                    "before it "
                    "(an OpenMP regime change?)",
                    flush=True,
                )
            if alt.name in (TORCH_SAVE, STAGESAVE):
                kept[alt.name] = os.path.join(folder, "ckpt")
            else:
                shutil.rmtree(folder, ignore_errors=True)
        if not args.no_loads and kept:
            loads, cold = run_loads(kept.get(TORCH_SAVE), kept.get(STAGESAVE))
            res["cold_cache"] = cold
            for k, v in loads.items():
                res["loads"].setdefault(k, []).append(v)
            print("   loads: " + ", ".join(f"{k} {v:.3f} s" for k, v in loads.items()), flush=True)
        for path in kept.values():
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    del state
    gc.collect()
    res["loop_end_ms"] = loop.baseline(args.baseline_s) * 1e3
    print(
        f"   loop baseline {res['loop_start_ms']:.1f} ms/it before this size, "
        f"{res['loop_end_ms']:.1f} after",
        flush=True,
    )
    return res


def fmt_spread(xs: list[float], digits: int = 3) -> str:
    if not xs:
        return "-"
    s = common.spread(xs)
    if len(xs) == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def markdown(doc: dict[str, Any]) -> str:
    """The sweep as markdown: per size, one table of saves and one of loads (median (min–max))."""
    meta = doc["meta"]
    lines = [
        f"## Sweep {meta['date']}",
        "",
        f"`{meta['command']}`",
        "",
        (
            f"{meta['cpus']} CPUs, torch {meta['torch']} with {meta['torch_threads']} threads, "
            f"{meta['mem_total'] / GIB:.1f} GiB RAM, repeats {meta['repeats']}, directory "
            f"`{meta['dir']}`; "
            "figures are median (min–max) over rounds; ratios are to the floors of the same round."
        ),
        "",
    ]
    for size in doc["sizes"]:
        if size["skipped"]:
            lines += [f"### {size['gib']:g} GiB: skipped ({size['skipped']})", ""]
            continue
        fl = size["floors"]
        lines += [
            f"### {size['bytes'] / GIB:.2f} GiB state ({size['tensors']} tensors)",
            "",
            (
                f"copy floor {fmt_spread(fl['copy_s'])} s; dd O_DIRECT write floor "
                f"{fmt_spread(fl['dd_direct_s'])} s"
                + (
                    f"; raw O_DIRECT write floor {fmt_spread(fl['write_s'])} s (`raw_write.py`), "
                    f"the loop lost {fmt_spread(fl['write_lost_s'])} s while it ran"
                    if fl.get("write_lost_s")
                    else ""
                )
                + f"; loop baseline {size['loop_start_ms']:.1f} ms/it before this size, "
                f"{size['loop_end_ms']:.1f} after"
            ),
            "",
            (
                "| alternative | blocking s | × copy floor | commit s | × dd floor | × raw write "
                "floor | durable | lost per save s "
                "| × copy floor | × (copy floor + raw write lost) | mean step × | p99 step × | "
                "loop ms/it before → after |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, a in size["alternatives"].items():
            if a["skipped"] and not a["runs"]:
                lines.append(f"| {name} | skipped: {a['skipped']} |||||||||||| ")
                continue
            runs = a["runs"]

            def col(key: str, digits: int = 3, runs: list[dict[str, Any]] = runs) -> str:
                return fmt_spread([x[key] for x in runs], digits)

            label = f"{name} (then {a['skipped']})" if a["skipped"] else name
            over_write = (
                col("commit_over_write_floor", 2) if "commit_over_write_floor" in runs[0] else "—"
            )
            lost_over_both = (
                col("lost_over_copy_and_write_floor", 2)
                if "lost_over_copy_and_write_floor" in runs[0]
                else "—"
            )
            lines.append(
                f"| {label} | {col('blocking_s')} | {col('blocking_over_copy_floor', 2)} | "
                f"{col('commit_s')} | {col('commit_over_dd_floor', 2)} | "
                f"{over_write} | "
                f"{'yes' if a['durable'] else 'no'} | {col('lost_s')} | "
                f"{col('lost_over_copy_floor', 2)} | "
                f"{lost_over_both} | "
                f"{col('step_mean_x', 2)} | {col('step_p99_x', 2)} | "
                f"{col('baseline_before_ms', 1)} → {col('baseline_after_ms', 1)} |"
            )
        if size["loads"]:
            cold = (
                "cold = page cache dropped"
                if size["cold_cache"]
                else "cold NOT possible here (not root): cache warm"
            )
            lines += ["", f"| load ({cold}) | seconds |", "|---|---|"]
            lines += [f"| {k} | {fmt_spread(v)} |" for k, v in size["loads"].items()]
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: str) -> None:
    """Blocking time and time to commit against state size, one line per alternative, log-scale
    y."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [s for s in doc["sizes"] if not s["skipped"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    panels = (("blocking_s", "copy_s", "copy floor", "training blocked per save (s)"),
              ("commit_s", "dd_direct_s", "dd O_DIRECT write floor", "time to commit (s)"))
    names = list(dict.fromkeys(n for s in sizes for n in s["alternatives"]))
    for ax, (key, floor_key, floor_name, ylabel) in zip(axes, panels, strict=True):
        for name in names:
            xs, med, lo, hi = [], [], [], []
            for s in sizes:
                runs = s["alternatives"].get(name, {}).get("runs") or []
                if runs:
                    sp = common.spread([x[key] for x in runs])
                    xs.append(s["bytes"] / GIB)
                    med.append(sp["median"])
                    lo.append(sp["median"] - sp["min"])
                    hi.append(sp["max"] - sp["median"])
            if xs:
                ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
        fx = [s["bytes"] / GIB for s in sizes]
        fy = [statistics.median(s["floors"][floor_key]) for s in sizes]
        ax.plot(fx, fy, "k--", marker="x", label=floor_name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(fx, [f"{x:.2f}" for x in fx])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("state size (GiB)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_title("blocking per save (median, min–max)")
    axes[1].set_title("time to commit (median, min–max)")
    fig.suptitle(
        f"checkpoint saves by state size, {doc['meta']['cpus']} CPUs, {doc['meta']['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--dir",
        default=None,
        help="directory on the disk to test (default: a temp dir under /work)",
    )
    ap.add_argument(
        "--sizes", default="0.5,2,8", help="state sizes in GiB, comma-separated (default 0.5,2,8)"
    )
    ap.add_argument(
        "--repeats", type=int, default=2, help="interleaved rounds per size (default 2)"
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: --sizes 0.25 --repeats 1")
    ap.add_argument("--alternatives", default=",".join(a.name for a in ALTERNATIVES),
                    help="comma-separated names (default: all)")
    ap.add_argument("--baseline-s", type=float, default=2.0,
                    help="seconds of loop baseline before and after each save (default 2)")
    ap.add_argument("--no-loads", action="store_true", help="skip the load measurements")
    ap.add_argument("--json", default=None, help="write every raw figure here")
    ap.add_argument("--markdown", default=None, help="append the tables to this file")
    ap.add_argument(
        "--png", default=None, help="plot blocking and commit time against state size here"
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="measure nothing: merge the --json files of earlier runs (a size measured in a "
        "later file replaces one skipped or measured in an earlier one) and write "
        "--markdown/--png/--json from them",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = "0.25", 1
    known = {a.name for a in ALTERNATIVES}
    unknown = [n for n in args.alternatives.split(",") if n and n not in known]
    if unknown:
        ap.error(f"unknown alternatives {unknown}; known: {sorted(known)}")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    return args


def merge(paths: list[str]) -> dict[str, Any]:
    """One document from the ``--json`` files of several runs, sizes in ascending order."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
    by_size: dict[float, dict[str, Any]] = {}
    for d in docs:
        for s in d["sizes"]:
            key = round(s["gib"], 3)
            if not s["skipped"] or key not in by_size:
                by_size[key] = s
    meta = dict(docs[0]["meta"])
    meta["command"] = " + ".join(d["meta"]["command"] for d in docs)
    meta["date"] = ", ".join(d["meta"]["date"] for d in docs)
    meta["repeats"] = "/".join(str(d["meta"]["repeats"]) for d in docs)
    return {"meta": meta, "sizes": [by_size[k] for k in sorted(by_size)]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        doc = merge(args.merge)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
        if args.markdown:
            with open(args.markdown, "a") as f:
                f.write(markdown(doc))
        if args.png:
            plot(doc, args.png)
        return
    sizes = [float(x) for x in args.sizes.split(",") if x]
    chosen = set(args.alternatives.split(","))
    alts = [a for a in ALTERNATIVES if a.name in chosen]
    base = args.dir or tempfile.mkdtemp(
        prefix="stagesave-sweep-", dir="/work" if os.path.isdir("/work") else None
    )
    os.makedirs(base, exist_ok=True)
    t_start = time.perf_counter()
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
        "dir": base,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "mem_total": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "repeats": args.repeats,
        "sizes_gib": sizes,
        "stagesave": getattr(stagesave, "__version__", None),
    }
    print(f"sweep: sizes {sizes} GiB, {args.repeats} rounds, {len(alts)} alternatives, dir {base}; "
          f"torch {torch.__version__} with {torch.get_num_threads()} threads", flush=True)
    loop = interference.Loop()
    loop.baseline(1.0)  # warm the loop's allocations and threads once
    doc: dict[str, Any] = {"meta": meta, "sizes": []}
    try:
        for gib in sizes:
            doc["sizes"].append(run_size(gib, alts, args, base, loop))
    finally:
        meta["wall_s"] = time.perf_counter() - t_start
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    text = markdown(doc)
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text)
    if args.png:
        plot(doc, args.png)
        print(f"plot: {args.png}")
    print(f"sweep took {meta['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
