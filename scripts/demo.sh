#!/usr/bin/env bash
# The main job: fine-tune a small transformer with PyTorch Lightning and asynchronous stagesave
# checkpoints, kill it with SIGKILL mid-run, rerun it, and watch it resume from the newest
# valid checkpoint; check that it ends with bitwise the weights of a run that never crashed;
# show what each save cost (`stagesave report`, from the telemetry both runs recorded); then
# measure what checkpointing costs the same training of 0.6 GiB of model + Adam state with
# Lightning's default IO (TorchCheckpointIO) and with stagesave, side by side.
#
#   bash scripts/demo.sh                       # checkpoints under ./runs/demo
#   bash scripts/demo.sh --dir /nvme/demo      # or STAGESAVE_DEMO_DIR=/nvme/demo
#   STAGESAVE_DEMO_COMPARE=0 bash scripts/demo.sh   # skip the uninterrupted reference run
#   bash scripts/demo.sh --no-cost             # or STAGESAVE_DEMO_COST=0: skip the cost comparison
#
# Takes about 4 minutes on 2 CPU cores (the cost comparison ~2 of them, up to 2.5 GiB of memory,
# 1.2 GiB of disk in DIR-cost, removed after). Every run starts from an empty directory.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${STAGESAVE_DEMO_DIR:-./runs/demo}
STEPS=${STAGESAVE_DEMO_STEPS:-60}
EVERY=${STAGESAVE_DEMO_EVERY:-10}
CRASH=${STAGESAVE_DEMO_CRASH:-30}
COMPARE=${STAGESAVE_DEMO_COMPARE:-1}
COST=${STAGESAVE_DEMO_COST:-1}
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR=$2; shift 2 ;;
    --dir=*) DIR=${1#--dir=}; shift ;;
    --no-cost) COST=0; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
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

rm -rf "$DIR" "$DIR-reference" "$DIR-cost" "$DIR-timeline.png"
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

say "what each save cost: stagesave report $DIR (telemetry of both runs, the crashed one included)"
.venv/bin/stagesave report "$DIR" --png "$DIR-timeline.png"

if [ "$COST" = "1" ]; then
  say "what checkpointing costs the training: Lightning's default IO vs stagesave, 0.6 GiB of state"
  # (its figures also end in a JSON line: kept in the log, not shown)
  "$PY" examples/compare_checkpoint_cost.py --dir "$DIR-cost" | tee "$LOGS/cost.log" \
    | grep --line-buffered -v '^result: '
fi

say "done"
echo "checkpoints: $DIR  (plain Lightning .ckpt files, each carrying its proof inside)"
echo "telemetry:   $DIR/stagesave-telemetry.jsonl  (stagesave report $DIR; timeline $DIR-timeline.png)"
if [ "$COST" = "1" ]; then
  echo "cost:        $(grep '^ratio: ' "$LOGS/cost.log" | sed 's/^ratio: //')"
fi
