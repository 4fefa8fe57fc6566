"""Registration without disk and without a gather, at TP=2 under torchrun (gloo, CPU).

Both TP ranks of a MegatronTrainer write their own HF slices into one shared-memory buffer made by
rank 0; rank 0's ParameterServer registers that buffer without a copy (see
tests/integration/dist/megatron_handoff_worker.py for the steps). Checked:
  - named_tensors() moves no shard between ranks: its only torch.distributed calls are one 24-byte
    broadcast (the buffer's pid, fd, size) and a barrier; the trainer has no gather method;
  - the registered checkpoint is the buffer itself (adopted) and equals the model directory
    bit-exactly, per-tensor dtypes included (bfloat16 weights, float32 norms); an update delivers it;
  - after a training step it equals the old path (gather to rank 0, megatron_to_hf, cast) bit-exactly,
    is written into the second buffer while v0 is registered, and into v0's once v0 is unregistered.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.dist.harness import REPO, _env, free_port

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")


def test_tp2_ranks_write_one_shared_hf_buffer_the_ps_adopts(tmp_path):
    import torch

    from demo.tiny_model import write_model_dir
    from tests.unit.trainer.tiny import tiny_config, tiny_hf

    _, state = tiny_hf(seed=5)
    state = {n: t if n.endswith("norm.weight") else t.to(torch.bfloat16) for n, t in state.items()}
    model_dir = write_model_dir(tmp_path / "model", tiny_config(), state)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(REPO / "tests" / "integration" / "dist" / "megatron_handoff_worker.py"),
        "--model-dir",
        str(model_dir),
        "--out",
        str(tmp_path / "out"),
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"torchrun hung past 240 s: {exc.output}") from None
    assert proc.returncode == 0, proc.stdout[-4000:]
    r0, r1 = (json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2))
    print(json.dumps(r0))
    for r in (r0, r1):
        assert r["no_gather_method"] and r["no_shard_traffic"], r
        assert r["calls"] == {"broadcast": 1, "barrier": 1} and r["bytes_sent"] == 24, r
    assert r0["adopted"] and r0["registered_equals_hf"] and r0["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert r0["update_mode"] == "local" and r0["engine_equals_hf"]
    assert r0["weights_moved"] and r0["trained_equals_old_path"]
    assert r0["second_buffer_differs"] and r0["v0_unchanged"]
    assert r0["buffer_reused_after_unregister"] and r0["third_equals_second"]
