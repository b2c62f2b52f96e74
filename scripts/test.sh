#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Lint as a habit: ruff (its default rules plus line length) and mypy strict over the core and
# both integrations (`mypy` with no arguments; see [tool.mypy] in pyproject.toml).
.venv/bin/ruff check src integrations tests benchmarks
.venv/bin/mypy
if [ -f scripts/s3server.sh ]; then
  # A loopback SeaweedFS S3 server for the S3 tests; the pytest fixture reuses it.
  eval "$(bash scripts/s3server.sh start)"
  trap 'bash scripts/s3server.sh stop >/dev/null 2>&1 || true' EXIT
fi
.venv/bin/python -m pytest -q "$@"
