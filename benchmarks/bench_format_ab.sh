#!/usr/bin/env bash
# Blocking, commit and training time lost per 2 GiB save, this checkout against another one (e.g.
# the last format-1 commit), alternating round by round so that the machine's drift hits both:
#
#   git worktree add /tmp/f1 61c2ee3
#   bash benchmarks/bench_format_ab.sh /tmp/f1 [ROUNDS] [OUT_DIR]
#
# Each round runs bench_sweep.py (each checkout's own) (blocking, commit, lost; the copy and raw-write floors of the same
# run) and bench_interference.py (lost per save) once with each checkout's `src` on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
OTHER=${1:?usage: bench_format_ab.sh OTHER_CHECKOUT [ROUNDS] [OUT_DIR]}
ROUNDS=${2:-3}
OUT=${3:-benchmarks/results/format2}
SCRATCH=${STAGESAVE_BENCH_DIR:-/work/bench-ab}
mkdir -p "$OUT" "$SCRATCH"
for r in $(seq 1 "$ROUNDS"); do
  for v in new old; do
    # each checkout runs its own benchmark scripts (their imports follow its tree)
    pp=""; bd=benchmarks; [ "$v" = old ] && pp="$OTHER/src" && bd="$OTHER/benchmarks"
    PYTHONPATH=$pp .venv/bin/python "$bd/bench_sweep.py" --dir "$SCRATCH" --sizes 2 --repeats 1 --no-loads \
      --alternatives "stagesave checksum_in=staging,stagesave checksum_in=background" --json "$OUT/sweep-$v-$r.json"
    PYTHONPATH=$pp .venv/bin/python "$bd/bench_interference.py" --gib 2 --repeats 1 --dir "$SCRATCH" \
      --alternatives "stagesave checksum_in=staging" | tee -a "$OUT/interference-$v.md"
  done
done
