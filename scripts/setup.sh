#!/usr/bin/env bash
# One-time set-up: a virtual environment with the CPU build of torch and stagesave[all].
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first, pinned: a bare `torch` requirement could pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q --disable-pip-version-check "torch==${STAGESAVE_TORCH_VERSION:-2.13.0}"
fi
.venv/bin/pip install -q --disable-pip-version-check -e '.[all]' 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import stagesave, stagesave.lightning, stagesave.accelerate" \
  || { echo "setup: stagesave did not install" >&2; exit 1; }
