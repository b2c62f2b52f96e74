#!/usr/bin/env bash
# A loopback SeaweedFS S3 server for the tests and benchmarks (data in a temp dir).
#   eval "$(bash scripts/s3server.sh start)"   # exports STAGESAVE_S3_* once the server answers
#   bash scripts/s3server.sh stop              # stops the server named by STAGESAVE_S3_PID/_DIR
# The pytest fixture (tests/s3server.py) reuses a server announced this way.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  start|stop) exec .venv/bin/python tests/s3server.py "$1" ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
