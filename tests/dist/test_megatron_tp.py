"""megatron-core GPTModel at TP=2 under torchrun on CPU (gloo): converted HF shards give HF's logits
(float32, max abs diff <= 1e-5), backward runs, and the shards gathered back convert to the original
HF state dict bit-exactly. The ranks run tests/dist/megatron_tp_worker.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.dist.harness import REPO, _env, free_port

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
pytest.importorskip("transformers")


def _torchrun(nproc: int, tp: int, out_dir, timeout_s: float = 180.0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(REPO / "tests" / "dist" / "megatron_tp_worker.py"), "--tp", str(tp), "--out", str(out_dir)]
    try:
        return subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"torchrun hung past {timeout_s} s: {exc.output}") from None


def test_tp2_logits_equal_hf_and_shards_convert_back(tmp_path):
    proc = _torchrun(2, 2, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["this_rank"] for r in results] == [[0, 0], [0, 1]]
    for r in results:
        print(f"TP=2 rank {r['rank']}: max |megatron - HF| logits {r['logits_max_abs_diff']:.3g}, {r['seconds']} s")
        assert r["logits_ok"] and r["logits_max_abs_diff"] <= 1e-5
        assert r["grads_finite"] and r["round_trip_exact"]
