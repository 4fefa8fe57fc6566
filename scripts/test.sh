#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not vllm and not e2e"` for the quick layer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GLOG_minloglevel=2 TOKENIZERS_PARALLELISM=false
echo "[test] ruff check + ruff format --check"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = "5" ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
