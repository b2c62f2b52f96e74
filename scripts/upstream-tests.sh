#!/usr/bin/env bash
# Lightning's and Accelerate's own checkpointing tests, with and without stagesave as the default.
#
#   bash scripts/upstream-tests.sh                       # both suites, modes plain and staged
#   bash scripts/upstream-tests.sh --suite lightning --mode staged
#   bash scripts/upstream-tests.sh --rev 61c2ee3         # stagesave as of a commit (own venv copy)
#   bash scripts/upstream-tests.sh --suite accelerate -- -k test_with_save_limit
#
# Modes:
#   plain    the upstream tests as they are (no stagesave involved)
#   staged   Lightning: StagedCheckpointIO is every Trainer's default CheckpointIO
#            (tests/upstream/lightning_default_io.py); Accelerate: stagesave.accelerate.enable()
#            on every Accelerator (tests/upstream/accelerate_enabled.py)
#   control  Lightning only: TorchCheckpointIO created through the same patch as `staged`
#            (shows that the patch alone breaks nothing)
#   staged-sync  diagnostic: `staged` with every save and removal (Lightning) or save_state
#            (Accelerate) waited for; a test failing in `staged` but passing here failed
#            because of asynchrony, and the report categorizes it `async`
#
# Options:
#   --suite lightning|accelerate|all   (default all)
#   --mode  plain|staged|control|staged-sync[,...] (default plain,staged)
#   --selection core|extended          Lightning's selection (default core; see below)
#   --rev REV      test stagesave at git revision REV instead of the working tree: extracts it to
#                  $UPSTREAM_DIR/stagesave-<sha> (git archive) and installs it, editable, into a
#                  copy of .venv at $UPSTREAM_DIR/venv-<sha> (made once)
#   --python PATH  interpreter to run with (default .venv/bin/python, or the --rev venv)
#   --out DIR      results root (default build/upstream-tests); each run goes to
#                  DIR/<stagesave-id>/<suite>-<mode>/ (pytest.log, records.jsonl, summary.json)
#                  and the report of this invocation to DIR/<stagesave-id>/results.md
#   --timeout S    per-test timeout (default 300); the whole pytest run is capped at 40 min
#   --setup-only   install the test requirements and extract the upstream tests, run nothing
#   --no-setup     skip the requirement checks/installs
#   --report-only  rebuild results.md from the existing runs of the selected suites and modes
#   -- ARGS        passed to pytest
#
# Environment: UPSTREAM_DIR (default /work/upstream) holds the extracted upstream sources;
# LIGHTNING_MIRROR / ACCELERATE_MIRROR are bare git snapshots of the upstream repositories
# (default /work/.mirror/<owner>+<name>/repo). Upstream sources never go inside this repository.
# STAGESAVE_UPSTREAM_IO_OPTIONS / STAGESAVE_UPSTREAM_ACCELERATE_OPTIONS (JSON) pass options to
# StagedCheckpointIO / enable(). LIGHTNING_TESTS / ACCELERATE_TESTS name an upstream tree to use
# as is (Lightning: the folder holding tests/tests_pytorch; Accelerate: the one holding tests/).
#
# Upstream sources: Lightning's tests at the tag equal to the installed `lightning` version, or
# else the highest tag below it (2.6.6 is installed; the snapshot's newest 2.6 tag is 2.6.5, whose
# package differs from 2.6.6 only by a hparams-instantiator allow-list in core/saving.py).
# Accelerate's at tag v<version> if the snapshot has it, else the tests inside the PyPI source
# distribution of the installed version (exact), else the snapshot's HEAD (closest).
set -euo pipefail
{  # parsed whole before it runs: editing this file while it runs cannot break the run
REPO=$(cd "$(dirname "$0")/.." && pwd)
UPSTREAM_DIR=${UPSTREAM_DIR:-/work/upstream}
LIGHTNING_MIRROR=${LIGHTNING_MIRROR:-/work/.mirror/Lightning-AI+pytorch-lightning/repo}
ACCELERATE_MIRROR=${ACCELERATE_MIRROR:-/work/.mirror/huggingface+accelerate/repo}

SUITE=all MODES=plain,staged SELECTION=core REV="" PY="" OUTROOT="$REPO/build/upstream-tests"
TEST_TIMEOUT=300 SETUP=1 RUN=1 REPORT_ONLY=0
PYTEST_EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --suite) SUITE=$2; shift 2 ;;
    --mode) MODES=$2; shift 2 ;;
    --selection) SELECTION=$2; shift 2 ;;
    --rev) REV=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --out) OUTROOT=$2; shift 2 ;;
    --timeout) TEST_TIMEOUT=$2; shift 2 ;;
    --setup-only) RUN=0; shift ;;
    --no-setup) SETUP=0; shift ;;
    --report-only) REPORT_ONLY=1; SETUP=0; shift ;;
    --) shift; PYTEST_EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "upstream-tests: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$SUITE" in lightning|accelerate|all) ;; *) echo "--suite: lightning, accelerate or all" >&2; exit 2 ;; esac
case "$SELECTION" in core|extended) ;; *) echo "--selection: core or extended" >&2; exit 2 ;; esac
mkdir -p "$UPSTREAM_DIR"
log() { echo "upstream-tests: $*" >&2; }

# ---------------------------------------------------------------- which stagesave
if [ -n "$REV" ]; then
  SHA=$(git -C "$REPO" rev-parse --verify "$REV^{commit}")
  SHORT=${SHA:0:7}
  SRC="$UPSTREAM_DIR/stagesave-$SHORT"
  VENV="$UPSTREAM_DIR/venv-$SHORT"
  if [ ! -f "$SRC/pyproject.toml" ]; then
    log "extracting stagesave $SHORT to $SRC"
    rm -rf "$SRC"; mkdir -p "$SRC"
    git -C "$REPO" archive "$SHA" | tar -x -C "$SRC"
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    log "copying $REPO/.venv to $VENV (once)"
    rm -rf "$VENV"; cp -a "$REPO/.venv" "$VENV"
  fi
  if ! "$VENV/bin/python" -c "import stagesave, sys; sys.exit(not stagesave.__file__.startswith('$SRC/'))" 2>/dev/null; then
    log "installing stagesave $SHORT into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$SRC" 2>&1 \
      | grep -v "is ignored" || true
  fi
  PY=${PY:-$VENV/bin/python}
  STAGESAVE_ID=$SHORT
else
  PY=${PY:-$REPO/.venv/bin/python}
  STAGESAVE_ID="worktree-$(git -C "$REPO" rev-parse --short HEAD)"
  if [ -n "$(git -C "$REPO" status --porcelain -- src integrations pyproject.toml)" ]; then
    # Uncommitted changes: name them by a digest of the diff and keep the list with the results.
    DIRTY=$( (git -C "$REPO" diff HEAD -- src integrations pyproject.toml;
              git -C "$REPO" ls-files -o --exclude-standard -- src integrations | xargs -r -I{} cat "$REPO/{}") | sha1sum | cut -c1-8)
    STAGESAVE_ID="$STAGESAVE_ID-dirty-$DIRTY"
  fi
fi
[ -x "$PY" ] || { log "no interpreter at $PY (run scripts/setup.sh)"; exit 1; }

# ---------------------------------------------------------------- test requirements (CPU only)
# Only what the selected tests import or need to run instead of skipping: the default logger
# (tensorboard, as in Lightning's requirements/pytorch/test.txt; with tensorboardX instead,
# memory:// logs land in the working directory and two tests fail), Lightning's test helpers (cloudpickle, scikit-learn, omegaconf), Accelerate's
# (parameterized, torchdata for its StatefulDataLoader save_state tests).
need() {  # need "import-name pip-spec" ...
  local missing=() pair
  for pair in "$@"; do
    "$PY" -c "import ${pair%% *}" >/dev/null 2>&1 || missing+=("${pair#* }")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} into $("$PY" -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install -q --disable-pip-version-check "${missing[@]}" 2>&1 | grep -v "is ignored" || true
  fi
}
pkg_version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }

# The newest tag <= the installed version among tags of the form [v]X.Y.Z.
pick_tag() {  # pick_tag GITDIR PREFIX VERSION
  git --git-dir="$1" tag | "$PY" -c '
import re, sys
prefix, want = sys.argv[1], tuple(int(x) for x in sys.argv[2].split(".")[:3])
best = None
for tag in sys.stdin.read().split():
    m = re.fullmatch(re.escape(prefix) + r"(\d+)\.(\d+)\.(\d+)", tag)
    if m:
        v = tuple(map(int, m.groups()))
        if v <= want and (best is None or v > best[0]):
            best = (v, tag)
print(best[1] if best else "")' "$2" "$3"
}

setup_lightning() {
  [ "$SETUP" = 0 ] || need "cloudpickle cloudpickle>=1.3,<3.2.0" "tensorboard tensorboard>=2.11,<2.21.0" \
       "sklearn scikit-learn>0.22.1,<1.9.0" "omegaconf omegaconf"
  local version tag
  version=$(pkg_version lightning)
  if [ -z "${LIGHTNING_TESTS:-}" ]; then
    [ -d "$LIGHTNING_MIRROR" ] || { log "no snapshot of Lightning-AI/pytorch-lightning at $LIGHTNING_MIRROR (fetch it first)"; exit 1; }
    tag=$(pick_tag "$LIGHTNING_MIRROR" "" "$version")
    [ -n "$tag" ] || { log "no Lightning tag <= $version in $LIGHTNING_MIRROR"; exit 1; }
    LIGHTNING_TESTS="$UPSTREAM_DIR/lightning-$tag"
    if [ ! -f "$LIGHTNING_TESTS/SOURCE" ]; then
      log "extracting Lightning $tag tests (installed: $version) to $LIGHTNING_TESTS"
      rm -rf "$LIGHTNING_TESTS"; mkdir -p "$LIGHTNING_TESTS"
      git --git-dir="$LIGHTNING_MIRROR" archive "$tag" tests/tests_pytorch pyproject.toml requirements/pytorch 2>/dev/null \
        | tar -x -C "$LIGHTNING_TESTS"
      echo "Lightning-AI/pytorch-lightning tag $tag ($(git --git-dir="$LIGHTNING_MIRROR" rev-parse "$tag^{commit}")); installed lightning $version" \
        > "$LIGHTNING_TESTS/SOURCE"
    fi
  fi
}

setup_accelerate() {
  [ "$SETUP" = 0 ] || need "parameterized parameterized" "torchdata.stateful_dataloader torchdata>=0.8"
  local version tag tmp
  version=$(pkg_version accelerate)
  if [ -z "${ACCELERATE_TESTS:-}" ]; then
    ACCELERATE_TESTS="$UPSTREAM_DIR/accelerate-$version"
    [ -f "$ACCELERATE_TESTS/SOURCE" ] && return
    rm -rf "$ACCELERATE_TESTS"; mkdir -p "$ACCELERATE_TESTS"
    if [ -d "$ACCELERATE_MIRROR" ] && git --git-dir="$ACCELERATE_MIRROR" rev-parse -q --verify "refs/tags/v$version" >/dev/null; then
      git --git-dir="$ACCELERATE_MIRROR" archive "v$version" tests | tar -x -C "$ACCELERATE_TESTS"
      echo "huggingface/accelerate tag v$version; installed accelerate $version" > "$ACCELERATE_TESTS/SOURCE"
      return
    fi
    tmp=$(mktemp -d)
    if timeout 300 "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
         -d "$tmp" "accelerate==$version" >/dev/null 2>&1 \
       && tar -xzf "$tmp"/accelerate-"$version".tar.gz -C "$tmp" "accelerate-$version/tests"; then
      mv "$tmp/accelerate-$version/tests" "$ACCELERATE_TESTS/tests"
      echo "accelerate $version source distribution from the package index (the snapshot has no tag v$version); installed accelerate $version" \
        > "$ACCELERATE_TESTS/SOURCE"
    else
      [ -d "$ACCELERATE_MIRROR" ] || { log "no accelerate $version sdist and no snapshot at $ACCELERATE_MIRROR"; exit 1; }
      tag=$(pick_tag "$ACCELERATE_MIRROR" v "$version")
      log "no tag v$version and no sdist: using the snapshot's HEAD (closest to $version; newest tag <= it: ${tag:-none})"
      git --git-dir="$ACCELERATE_MIRROR" archive HEAD tests | tar -x -C "$ACCELERATE_TESTS"
      echo "huggingface/accelerate HEAD $(git --git-dir="$ACCELERATE_MIRROR" rev-parse HEAD) (no tag v$version); installed accelerate $version" \
        > "$ACCELERATE_TESTS/SOURCE"
    fi
    rm -rf "$tmp"
  fi
}

do_lightning=0 do_accelerate=0
[ "$SUITE" = lightning ] || [ "$SUITE" = all ] && do_lightning=1
[ "$SUITE" = accelerate ] || [ "$SUITE" = all ] && do_accelerate=1
# --no-setup skips the pip installs; the upstream tests are located (and extracted) regardless.
if [ "$REPORT_ONLY" = 0 ]; then
  [ $do_lightning = 0 ] || setup_lightning
  [ $do_accelerate = 0 ] || setup_accelerate
fi
[ "$RUN" = 1 ] || exit 0

# ---------------------------------------------------------------- selections
# Lightning "core": every checkpointing test file that runs on CPU. test_legacy_checkpoints.py is
# left out (it needs the downloaded legacy checkpoint archive). Every Trainer in test_trainer.py
# and test_loops.py that fits with the default callbacks saves through the default IO.
LIGHTNING_CORE=(
  tests_pytorch/checkpointing
  --ignore=tests_pytorch/checkpointing/test_legacy_checkpoints.py
  tests_pytorch/trainer/connectors/test_checkpoint_connector.py
  tests_pytorch/callbacks/test_model_checkpoint_additional_cases.py
  tests_pytorch/callbacks/test_model_checkpoint_edge_cases.py
  tests_pytorch/callbacks/test_model_checkpoint_manual_opt.py
  tests_pytorch/callbacks/test_model_checkpoint_step_interval_val_metric.py
  tests_pytorch/models/test_restore.py
  tests_pytorch/loops/test_loops.py
  tests_pytorch/trainer/test_trainer.py
)
# "extended": plus the other files that save, resume or load checkpoints.
LIGHTNING_EXTENDED=(
  tests_pytorch/core/test_saving.py
  tests_pytorch/models/test_hparams.py
  tests_pytorch/models/test_hooks.py
  tests_pytorch/trainer/test_dataloaders.py
  tests_pytorch/callbacks/test_callbacks.py
  tests_pytorch/callbacks/test_early_stopping.py
  tests_pytorch/callbacks/test_finetuning_callback.py
  tests_pytorch/loops/test_training_epoch_loop.py
  tests_pytorch/loops/test_loop_state_dict.py
  tests_pytorch/loops/test_double_iter_in_iterable_dataset.py
  tests_pytorch/trainer/connectors/test_callback_connector.py
  tests_pytorch/trainer/connectors/test_signal_connector.py
)
# Accelerate: all of test_state_checkpointing.py, and the save_state/load_state tests of
# test_accelerator.py (model + optimizer + scheduler, with save/load hooks, StatefulDataLoader).
ACCELERATE_SEL=(
  tests/test_state_checkpointing.py tests/test_accelerator.py
  -k "CheckpointTest or save_load_model or save_model_with_stateful_dataloader"
)

RESULTS="$OUTROOT/$STAGESAVE_ID"
mkdir -p "$RESULTS"
if [ -z "$REV" ]; then
  { echo "stagesave working tree of $REPO at $(git -C "$REPO" rev-parse HEAD), $(date -u +%Y-%m-%dT%H:%M:%SZ)";
    git -C "$REPO" status --porcelain -- src integrations pyproject.toml; } > "$RESULTS/WORKTREE"
fi
RUN_DIRS=()

run_one() {  # run_one SUITE MODE
  local suite=$1 mode=$2 out="$RESULTS/$1-$2" cwd plugins=(-p upstream_record) sel envs=() t0 t1 rc
  case "$suite/$mode" in
    lightning/plain|accelerate/plain) ;;
    lightning/staged) plugins+=(-p lightning_default_io); envs+=(STAGESAVE_UPSTREAM_IO=staged) ;;
    lightning/control) plugins+=(-p lightning_default_io); envs+=(STAGESAVE_UPSTREAM_IO=torch) ;;
    lightning/staged-sync) plugins+=(-p lightning_default_io); envs+=(STAGESAVE_UPSTREAM_IO=staged STAGESAVE_UPSTREAM_SYNC=1) ;;
    accelerate/staged) plugins+=(-p accelerate_enabled) ;;
    accelerate/staged-sync) plugins+=(-p accelerate_enabled); envs+=(STAGESAVE_UPSTREAM_SYNC=1) ;;
    accelerate/control) log "accelerate has no control mode; skipped"; return ;;
    *) log "unknown mode $mode"; exit 2 ;;
  esac
  if [ "$suite" = lightning ]; then
    cwd="$LIGHTNING_TESTS/tests"; sel=("${LIGHTNING_CORE[@]}")
    [ "$SELECTION" = extended ] && sel+=("${LIGHTNING_EXTENDED[@]}")
  else
    cwd="$ACCELERATE_TESTS"; sel=("${ACCELERATE_SEL[@]}")
  fi
  rm -rf "$out"; mkdir -p "$out"
  # a TensorBoardLogger on tensorboardX (not tensorboard) writes memory:// runs to a local "memory:" folder
  [ "$suite" = lightning ] && rm -rf "$cwd/memory:"
  log "$suite/$mode, stagesave $STAGESAVE_ID -> $out"
  t0=$(date +%s)
  set +e
  (cd "$cwd" && env "${envs[@]}" STAGESAVE_UPSTREAM_RECORD="$out/records.jsonl" \
      PYTHONPATH="$REPO/tests/upstream${PYTHONPATH:+:$PYTHONPATH}" \
      timeout -k 60 2400 "$PY" -m pytest -p no:cacheprovider -q --color=no -rfE \
        --timeout="$TEST_TIMEOUT" --basetemp="$out/tmp" "${plugins[@]}" "${sel[@]}" "${PYTEST_EXTRA[@]}" \
      > "$out/pytest.log" 2>&1)
  rc=$?
  set -e
  t1=$(date +%s)
  rm -rf "$out/tmp"
  "$PY" - "$out/meta.json" <<EOF
import json, os, re, sys
json.dump({"suite": "$suite", "mode": "$mode", "stagesave": "$STAGESAVE_ID",
           "selection": "$( [ "$suite" = lightning ] && echo "$SELECTION" || echo default)",
           "upstream": (lambda p: open(p).read().strip() if os.path.exists(p) else os.path.dirname(p))(
               "$( [ "$suite" = lightning ] && echo "$LIGHTNING_TESTS" || echo "$ACCELERATE_TESTS")/SOURCE"),
           "python": "$PY", "exit_code": $rc, "wall_s": $((t1 - t0)),
           "pytest_line": next((l.strip("= ") for l in reversed(open("$out/pytest.log").read().splitlines())
                                if re.search(r"\b(passed|failed|errors?|no tests ran)\b.* in [\d.]+s", l)), ""),
           "plugin_line": next((l.strip() for l in open("$out/pytest.log").read().splitlines()
                                if re.match(r"(lightning_default_io\[|accelerate_enabled)", l)), ""),
           "extra_args": $(printf '%s\n' "${PYTEST_EXTRA[@]}" | "$PY" -c 'import json,sys; print(json.dumps([l for l in sys.stdin.read().splitlines() if l]))')},
          open(sys.argv[1], "w"), indent=1)
EOF
  log "$suite/$mode: $("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["pytest_line"])' "$out/meta.json") (exit $rc, $((t1 - t0)) s)"
  [ "$rc" -le 1 ] || log "$suite/$mode: pytest exit $rc (see $out/pytest.log)"
  RUN_DIRS+=("$out")
}

IFS=, read -r -a MODE_LIST <<< "$MODES"
for suite in lightning accelerate; do
  [ "$suite" = lightning ] && [ $do_lightning = 0 ] && continue
  [ "$suite" = accelerate ] && [ $do_accelerate = 0 ] && continue
  for mode in "${MODE_LIST[@]}"; do
    if [ "$REPORT_ONLY" = 1 ]; then
      [ -f "$RESULTS/$suite-$mode/meta.json" ] && RUN_DIRS+=("$RESULTS/$suite-$mode")
    else
      run_one "$suite" "$mode"
    fi
  done
done

# One report for this invocation; a plain run of the same suite, if any, is the reference.
REPORT="$RESULTS/results.md"
{
  echo "# Upstream checkpointing tests, stagesave $STAGESAVE_ID"
  echo
  echo "Report written $(date -u +%Y-%m-%dT%H:%M:%SZ) (each run: see its wall time), $(nproc) CPUs, $("$PY" -c 'import torch, lightning, accelerate; print(f"torch {torch.__version__}, lightning {lightning.__version__}, accelerate {accelerate.__version__}")')"
  echo
  for suite in lightning accelerate; do
    dirs=() ref=()
    for d in "${RUN_DIRS[@]}"; do
      case "$(basename "$d")" in "$suite"-*) dirs+=("$d") ;; esac
      [ "$(basename "$d")" = "$suite-plain" ] && ref+=(--reference "$d")
      [ "$(basename "$d")" = "$suite-staged-sync" ] && ref+=(--sync "$d")
    done
    [ ${#dirs[@]} -gt 0 ] || continue
    echo "## $suite"
    echo
    "$PY" "$REPO/tests/upstream/summarize.py" "${dirs[@]}" "${ref[@]}"
  done
} > "$REPORT"
log "report: $REPORT"
grep -E '^\|' "$REPORT" >&2 || true
exit 0
}
