"""What signing costs a save: the same state saved unsigned (crc32, the default), unsigned with
blake3, and signed (blake3 + HMAC-SHA256 of the proof), interleaved, in one process.

Prints, per configuration, the medians of ``save()`` blocking, time to commit and a verified
load, and separately the time to sign and to check one proof (the HMAC alone).

Usage: python benchmarks/bench_signing.py [--mib 512] [--tensors 256] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import stagesave
from stagesave import signing

KEY = os.urandom(32)
CONFIGS = {
    "unsigned, crc32 (default)": ("crc32", False),
    "unsigned, blake3": ("blake3", False),
    "signed (blake3 + HMAC)": ("crc32", True),  # a key turns crc32 into blake3
}


def state(mib: int, tensors: int) -> dict[str, torch.Tensor]:
    per = mib * 2**20 // 4 // tensors
    return {f"t{i}": torch.randn(per) for i in range(tensors)}


def one(
    cfg: tuple[str, bool], st: dict[str, torch.Tensor], root: str, name: str
) -> dict[str, float]:
    checksum, signed = cfg
    signing.configure([KEY] if signed else None)
    try:
        with stagesave.Checkpointer(root, checksum=checksum) as ck:
            t0 = time.perf_counter()
            h = ck.save(st, name)
            blocking = time.perf_counter() - t0
            h.result()
            commit = time.perf_counter() - t0
            t1 = time.perf_counter()
            ck.load(name, mmap=False)
            load = time.perf_counter() - t1
        os.unlink(os.path.join(root, name))
    finally:
        signing.configure(None)
    return {"blocking": blocking, "commit": commit, "load": load}


def proof_hmac_cost(st: dict[str, torch.Tensor], root: str) -> tuple[float, float, int]:
    """Seconds to sign and to check one real proof (no I/O), and the proof's size."""
    from stagesave.ondisk.manifest import dumps
    from stagesave.ondisk.signing import Keys, check_doc, sign_doc

    signing.configure([KEY])
    try:
        stagesave.save(st, os.path.join(root, "p.ckpt"))
        doc: dict[str, object] = {}
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from proofkit import rewrite_proof

        rewrite_proof(os.path.join(root, "p.ckpt"), lambda d: doc.update(d))
    finally:
        signing.configure(None)
    os.unlink(os.path.join(root, "p.ckpt"))
    keys = Keys((KEY,), False)
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        signed = sign_doc(doc, keys)
    sign_s = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        check_doc(signed, "bench", keys, cryptographic=True)
    check_s = (time.perf_counter() - t0) / n
    return sign_s, check_s, len(dumps(signed))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--tensors", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    st = state(args.mib, args.tensors)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-signing-") as root:
        one(CONFIGS["unsigned, crc32 (default)"], st, root, "warm.ckpt")  # warm-up
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in CONFIGS}
        for _ in range(args.rounds):
            for label, cfg in CONFIGS.items():
                runs[label].append(one(cfg, st, root, "x.ckpt"))
        sign_s, check_s, size = proof_hmac_cost(st, root)
    print(
        f"state {args.mib} MiB in {args.tensors} tensors, {args.rounds} interleaved rounds, "
        f"medians; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print("| configuration | save() blocking | save to commit | verified load |")
    print("|---|---|---|---|")
    for label, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("blocking", "commit", "load")}
        print(
            f"| {label} | {med['blocking'] * 1e3:,.0f} ms | {med['commit'] * 1e3:,.0f} ms | "
            f"{med['load'] * 1e3:,.0f} ms |"
        )
    print(f"\nthe HMAC alone, on this state's proof ({size:,} bytes): sign {sign_s * 1e6:,.0f} us, "
          f"check {check_s * 1e6:,.0f} us")


if __name__ == "__main__":
    main()
