#!/usr/bin/env bash
# The README's main command: set up (idempotent), then the RL demo end to end: SFT warm-up (cached in
# .cache/sft), RL with vLLM on CPU and the checkpoint engine. Writes runs/demo/metrics.jsonl,
# runs/demo/metrics.png and runs/demo/summary.json; running it again resumes (or just re-reports) the run.
# Extra arguments go to the job, e.g. `bash scripts/main.sh --set rl.num_iterations=40`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GLOG_minloglevel=2 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m orchestrator --config configs/demo.json --output-dir "${OUTPUT_DIR:-runs/demo}" "$@"
