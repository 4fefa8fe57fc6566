#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not vllm and not e2e"` for the quick layer.
# Ends with the minutes of each step (set-up, lint, pytest); pytest itself ends with its 30 slowest
# tests and its minutes per layer against their budgets (tests/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
bash scripts/setup.sh
t_setup=$((SECONDS - t0))
export GLOG_minloglevel=2 TOKENIZERS_PARALLELISM=false
echo "[test] ruff check + ruff format --check"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
t_lint=$((SECONDS - t0 - t_setup))
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
t_pytest=$((SECONDS - t0 - t_setup - t_lint))
awk -v s="$t_setup" -v l="$t_lint" -v p="$t_pytest" 'BEGIN {
  printf "[test] set-up %.1f min, lint %.1f min, pytest %.1f min: %.1f min in all\n", s/60, l/60, p/60, (s+l+p)/60 }'
if [ "$rc" = "5" ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
