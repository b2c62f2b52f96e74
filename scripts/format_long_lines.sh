#!/usr/bin/env bash
# Format only the logical lines ruff reports as too long (E501), bottom-up, so the rest of each
# file keeps its layout: `bash scripts/format_long_lines.sh PATH...`.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check --select E501 --output-format=concise "$@" 2>/dev/null \
  | sed -nE 's/^(\S+\.py):([0-9]+):[0-9]+: E501.*/\1 \2/p' | sort -k1,1 -k2,2nr \
  | while read -r file line; do
      .venv/bin/ruff format -q --range="$line:1-$((line + 1)):1" "$file" || true
    done
