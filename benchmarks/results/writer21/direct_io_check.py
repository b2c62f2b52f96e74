"""What each writer's save reports about its write: O_DIRECT or not, write and fsync seconds.

Usage: python benchmarks/results/writer21/direct_io_check.py [--gib 2] [--dir /work/w21-diag]

Thread, process, thread, process: one warm-up save each, then one timed save of the same
transformer-like state (no training loop); prints blocking, time to commit and the save's
``SaveTelemetry`` fields ``write_s``, ``fsync_s`` and ``direct_io``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import common

import stagesave


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--dir", default="/work/w21-diag")
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30))
    state = common.transformer_state(nbytes, d_model=common.d_model_for(nbytes))
    os.makedirs(args.dir, exist_ok=True)
    try:
        for writer in ("thread", "process", "thread", "process"):
            with stagesave.Checkpointer(args.dir, max_pending=1, writer=writer) as ck:
                ck.save(state, "warm.ckpt").result()
                os.sync()
                time.sleep(0.5)
                t0 = time.perf_counter()
                h = ck.save(state, "x.ckpt")
                blocking = time.perf_counter() - t0
                tel = h.result()
                commit = time.perf_counter() - t0
            print(f"{writer:8} blocking {blocking:.3f} s  commit {commit:.3f} s  write_s "
                  f"{tel.write_s:.3f}  fsync_s {tel.fsync_s:.3f}  direct_io {tel.direct_io}",
                  flush=True)
            for name in os.listdir(args.dir):
                os.unlink(os.path.join(args.dir, name))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
