"""Does the writer's thread count or chunk size change what the background write costs the loop?

One 2 GiB (``GIB``) transformer-like state; stagesave ``Checkpointer(max_pending=1)`` with
``io_threads`` x ``chunk_bytes`` in {4 x 32 MiB (the defaults), 1 x 128 MiB, 2 x 64 MiB,
1 x 32 MiB}, plus ``raw_write.py`` (the same bytes written with O_DIRECT from a prefilled buffer
by a separate process, no copy, no hashing), interleaved over ``ROUNDS`` rounds (the order
rotates), each beside the training loop of ``bench_interference`` after a 1 s baseline. Printed
per variant, medians: blocking, the write's window, lost per save, ``interf`` = lost - blocking
(what the background part cost the loop), mean and p99 step inflation.

Usage: python benchmarks/bench_writer_tuning.py [GIB] [ROUNDS]     (default 2 6)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_interference as bi
import common

import stagesave

RAW_WRITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "raw_write.py")
VARIANTS: dict[str, dict[str, int]] = {
    "io4 c32": {"io_threads": 4},
    "io1 c128": {"io_threads": 1, "chunk_bytes": 128 << 20},
    "io2 c64": {"io_threads": 2, "chunk_bytes": 64 << 20},
    "io1 c32": {"io_threads": 1},
}


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    n = int(gib * (1 << 30))
    state = common.transformer_state(n, d_model=common.d_model_for(n))
    nbytes = common.state_bytes(state)
    d = os.environ.get("BENCH_DIR", "/work/bench-sweep/writer-tuning")
    os.makedirs(d, exist_ok=True)
    loop = bi.Loop()
    loop.baseline(1.0)
    cks = {k: stagesave.Checkpointer(max_pending=1, **v) for k, v in VARIANTS.items()}
    res: dict[str, list[dict[str, float]]] = {k: [] for k in [*VARIANTS, "raw write", "copy floor"]}

    def raw_start(_state: Any, path: str) -> tuple[float, Callable[[], bool]]:
        p = subprocess.Popen(
            [sys.executable, RAW_WRITE, path, str(nbytes)], stdout=subprocess.DEVNULL
        )
        return 0.0, lambda: p.poll() is not None

    for ck in cks.values():  # allocate and touch each buffer before measuring
        ck.save(state, f"{d}/warm.ckpt").result()
    for r in range(rounds):
        res["copy floor"].append({"lost": common.copy_floor_s(state)})
        order = list(res)[:-1]
        order = order[r % len(order):] + order[: r % len(order)]
        for name in order:
            os.sync()
            time.sleep(0.5)
            base = loop.baseline(1.0)
            if name == "raw write":
                start = raw_start
            else:

                def start(
                    s: Any, path: str, ck: stagesave.Checkpointer = cks[name]
                ) -> tuple[float, Callable[[], bool]]:
                    t0 = time.perf_counter()
                    h = ck.save(s, path)
                    return time.perf_counter() - t0, h.done
            m = bi.measure(loop, start, state, f"{d}/{name.replace(' ', '_')}.ckpt", base)
            m["interf"] = m["lost"] - m["blocking"]
            m["base_ms"] = base * 1e3
            res[name].append(m)
            print(r, name, {k: round(v, 3) for k, v in m.items()}, flush=True)
    print("\nmedians:")
    for name, ms in res.items():
        print(f"{name:10s}", {k: round(statistics.median(m[k] for m in ms), 3) for k in ms[0]})
    for ck in cks.values():
        ck.close()


if __name__ == "__main__":
    main()
