"""megatron-core GPTModel under torchrun on CPU (gloo) at TP=2 x PP=2 (4 ranks).

For the layout (ranks run tests/integration/dist/megatron_tp_worker.py):
  - converted HF shards give HF's logits on the last stage: float32, max |diff| <= 1e-5 (seen ~4e-7)
  - one forward + backward across TP ranks and PP stages; the gradients, gathered and converted to HF
    layout like the weights, equal HF's for the same loss: max |diff| <= 1e-6 (seen ~5e-8)
  - the shards gathered back convert to the original HF state dict bit-exactly
PP stages exchange activations/gradients with plain gloo send/recv (megatron's own schedules
hard-code CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.dist.harness import REPO, _env, free_port

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
pytest.importorskip("transformers")


def _torchrun(tp: int, pp: int, out_dir, timeout_s: float = 240.0) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(tp * pp),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(REPO / "tests" / "integration" / "dist" / "megatron_tp_worker.py"),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--out",
        str(out_dir),
    ]
    try:
        return subprocess.run(
            cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"torchrun hung past {timeout_s} s: {exc.output}") from None


# TP=2 x PP=2 shards along both axes at once (every TP and PP code path of the layout); TP=1 and PP=1
# alone are the in-process trainer's case (tests/unit/trainer/test_megatron_trainer.py,
# test_megatron_convert.py). Separate TP=2 and PP=2 runs (two more torchrun starts, ~40 s of CI)
# checked nothing this one does not.
@pytest.mark.parametrize("tp,pp", [(2, 2)], ids=["tp2xpp2"])
def test_megatron_logits_grads_and_round_trip(tmp_path, tp, pp):
    proc = _torchrun(tp, pp, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(tp * pp)]
    # megatron's rank order is tp fastest, then pp
    assert [r["this_rank"] for r in results] == [[p, t] for p in range(pp) for t in range(tp)]
    last_stage = [r for r in results if r["this_rank"][0] == pp - 1]
    for r in last_stage:
        print(f"TP={tp} PP={pp} rank {r['rank']}: max |megatron - HF| logits {r['logits_max_abs_diff']:.3g}")
        assert r["logits_ok"] and r["logits_max_abs_diff"] <= 1e-5
    assert all(r["grads_finite"] for r in results)
    print(f"TP={tp} PP={pp}: max |megatron - HF| gradients {results[0]['grads_max_abs_diff']:.3g}")
    assert results[0]["grads_ok"] and results[0]["grads_max_abs_diff"] <= 1e-6
    assert results[0]["round_trip_exact"]
