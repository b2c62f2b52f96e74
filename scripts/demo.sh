#!/usr/bin/env bash
# The main job: fine-tune a small transformer with PyTorch Lightning and asynchronous stagesave
# checkpoints, kill it with SIGKILL mid-run, rerun it, and watch it resume from the newest
# valid checkpoint; then check that it ends with bitwise the weights of a run that never crashed.
#
#   bash scripts/demo.sh                       # checkpoints under ./runs/demo
#   bash scripts/demo.sh --dir /nvme/demo      # or STAGESAVE_DEMO_DIR=/nvme/demo
#   STAGESAVE_DEMO_COMPARE=0 bash scripts/demo.sh   # skip the uninterrupted reference run
#
# Takes a few minutes on 2 CPU cores. Every run starts from an empty directory.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${STAGESAVE_DEMO_DIR:-./runs/demo}
STEPS=${STAGESAVE_DEMO_STEPS:-60}
EVERY=${STAGESAVE_DEMO_EVERY:-10}
CRASH=${STAGESAVE_DEMO_CRASH:-30}
COMPARE=${STAGESAVE_DEMO_COMPARE:-1}
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR=$2; shift 2 ;;
    --dir=*) DIR=${1#--dir=}; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "set-up (idempotent)"
bash scripts/setup.sh
PY=.venv/bin/python
EXAMPLE=(examples/lightning_finetune.py --max-steps "$STEPS" --every "$EVERY")
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT

rm -rf "$DIR" "$DIR-reference"
mkdir -p "$(dirname "$DIR")"

say "run 1: train to step $STEPS, checkpoint every $EVERY steps, crash (SIGKILL) after step $CRASH"
set +e
"$PY" "${EXAMPLE[@]}" --dir "$DIR" --crash-after-step "$CRASH" --sample 0
rc=$?
set -e
if [ "$rc" -ne 137 ]; then
  echo "demo: expected the first run to die of SIGKILL (exit 137), got $rc" >&2
  exit 1
fi
echo "run 1 died of SIGKILL (exit $rc), as planned."

say "run 2: the same command without --crash-after-step: it resumes by itself"
"$PY" "${EXAMPLE[@]}" --dir "$DIR" | tee "$LOGS/run2.log"
resumed=$(grep '^result: ' "$LOGS/run2.log" | tail -1 | sed 's/^result: //')

if [ "$COMPARE" = "1" ]; then
  say "reference: the same training without a crash, in $DIR-reference"
  "$PY" "${EXAMPLE[@]}" --dir "$DIR-reference" --sample 0 | tee "$LOGS/reference.log"
  reference=$(grep '^result: ' "$LOGS/reference.log" | tail -1 | sed 's/^result: //')
  "$PY" - "$resumed" "$reference" <<'EOF'
import json, sys
resumed, reference = (json.loads(a) for a in sys.argv[1:3])
print()
print(f"crashed + resumed run (resumed from {resumed['start']}): {resumed['weights_sha256']}")
print(f"uninterrupted run:                                 {reference['weights_sha256']}")
if resumed["weights_sha256"] != reference["weights_sha256"]:
    sys.exit("demo: the resumed run did NOT end with the same weights")
print("identical: the crash cost only the replayed steps, nothing else.")
EOF
fi

say "done"
echo "checkpoints: $DIR  (plain Lightning .ckpt files, each carrying its proof inside)"
