#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run on a lent GPU machine (no package registry there):
#   the `gpu`-marked tests, the unit tests of the trainer and the checkpoint engine on that machine,
#   the CUDA update benchmark and the trainer's device-memory release (colocated switch).
# Packages the machine lacks travel as wheels in .whl/ (git-ignored through .git/info/exclude), made here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pyzmq megatron-core==0.16.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
# Logs and the benchmark's JSON go to $OUT (default: ./out/gpu).
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'

rc=0
# its own process first: it needs a pytest process with no default process group yet
timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 100 \
  tests/unit/trainer/test_megatron_model.py::test_gpu_no_redirects_and_logits_equal_hf 2>&1 | tee "$OUT/pytest_megatron_gpu.log" | tail -4
rc=$((rc | ${PIPESTATUS[0]}))
timeout 300 python3 -m pytest -q -p no:cacheprovider --timeout 240 -m "not vllm" \
  ${GPU_TEST_PATHS:-tests/integration/gpu tests/unit/trainer tests/unit/checkpoint_engine} 2>&1 | tee "$OUT/pytest.log" | tail -45
rc=$((rc | ${PIPESTATUS[0]}))

timeout 200 torchrun --nproc-per-node 1 benchmarks/bench_update_cuda.py \
  --layers 16 --bucket-sizes-mib "${BUCKETS_MIB:-2048}" --repeats 3 --skip-naive 2>&1 | tee "$OUT/bench_update_cuda.log" | tail -6
rc=$((rc | ${PIPESTATUS[0]}))

timeout 180 python3 benchmarks/bench_offload_cuda.py --layers "${OFFLOAD_LAYERS:-16}" 2>&1 | tee "$OUT/bench_offload_cuda.log" | tail -3
rc=$((rc | ${PIPESTATUS[0]}))
exit $rc
