#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -f scripts/s3server.sh ]; then
  # A loopback SeaweedFS S3 server for the S3 tests; the pytest fixture reuses it.
  eval "$(bash scripts/s3server.sh start)"
  trap 'bash scripts/s3server.sh stop >/dev/null 2>&1 || true' EXIT
fi
.venv/bin/python -m pytest -q "$@"
