"""The RL job's Megatron trainer at TP=2 (trainer.megatron.tp): this test's child process is TP rank 0
(as the RL job's process is), it starts one follower rank; compared with HFTrainer on the same weights:

- named_tensors() before training equals the model directory exactly (shards gathered and merged);
- sequence log-probs: max |diff| <= 1e-4 (float32; measured ~4e-6);
- one k1.5 iteration (trainer.policy.train_iteration, AdamW and SGD, lr 1e-3): HF tensors
  within 1e-4 (AdamW: sign-like first step, see tests/unit/trainer/test_megatron_trainer.py) /
  1e-6 (SGD), same loss, same gradient norm (TP-summed) within 1e-4 relative;
- save -> load_hf_weights restores the trained weights; close() leaves no follower running.
The child runs this file as a script so the pytest process holds no process group.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
pytest.importorskip("transformers")


def _child(model_dir: str, out_json: str) -> None:
    import torch

    from demo.tiny_model import load_state_dict_from_dir
    from tests.unit.trainer.test_megatron_trainer import _batch
    from trainer import policy
    from trainer.base import TrainerConfig
    from trainer.factory import make_trainer
    from trainer.hf import HFTrainer

    result: dict = {}
    disk = load_state_dict_from_dir(model_dir)
    for optimizer in ("adamw", "sgd"):
        config = TrainerConfig(lr=1e-3, optimizer=optimizer, autocast_dtype="float32", num_threads=1)
        mg = make_trainer("megatron", model_dir, config, tp_size=2)
        try:
            hf = HFTrainer(model_dir, config)
            got = mg.named_tensors()
            result["round_trip_exact"] = set(got) == set(disk) and all(torch.equal(got[n], disk[n]) for n in disk)
            batch = _batch(0)
            with torch.no_grad():
                a = mg.sequence_logprobs(batch.prompt_ids, batch.response_ids, batch.response_masks)
                b = hf.sequence_logprobs(batch.prompt_ids, batch.response_ids, batch.response_masks)
            result["logprob_diff"] = (a - b).abs().max().item()
            train = policy.TrainConfig(tau=0.5, lr=1e-3, num_minibatches=2, num_epochs=1)
            s_mg = policy.train_iteration(mg, _batch(1), train, random.Random(0))
            s_hf = policy.train_iteration(hf, _batch(1), train, random.Random(0))
            got, want = mg.named_tensors(), hf.named_tensors()
            result[f"{optimizer}_step_diff"] = max((got[n] - want[n]).abs().max().item() for n in want)
            result[f"{optimizer}_loss_diff"] = abs(s_mg["loss"] - s_hf["loss"])
            result[f"{optimizer}_grad_norm_rel"] = abs(s_mg["grad_norm"] - s_hf["grad_norm"]) / s_hf["grad_norm"]
            result[f"{optimizer}_num_steps"] = [s_mg["num_steps"], s_hf["num_steps"]]
            if optimizer == "sgd":
                trained = mg.named_tensors(copy=True)
                out = mg.save(Path(out_json).parent / "saved")
                mg.load_hf_weights(disk)
                mg.load_hf_weights(load_state_dict_from_dir(out))
                now = mg.named_tensors()
                result["save_load_exact"] = all(torch.equal(now[n], trained[n]) for n in trained)
        finally:
            mg.close()
        result["followers_exited"] = all(p.poll() is not None for p in mg._followers)
    Path(out_json).write_text(json.dumps(result))


def test_tp2_trainer_matches_hf(tmp_path):
    from demo.tiny_model import write_model_dir
    from tests.integration.dist.harness import run_python
    from tests.unit.trainer.tiny import tiny_config, tiny_hf

    _, state = tiny_hf(seed=3)
    model_dir = write_model_dir(tmp_path / "model", tiny_config(), state)
    out = tmp_path / "out.json"
    run_python(__file__, str(model_dir), str(out), timeout_s=300)
    r = json.loads(out.read_text())
    print(json.dumps(r))
    assert r["round_trip_exact"] and r["save_load_exact"] and r["followers_exited"]
    assert r["logprob_diff"] <= 1e-4
    assert r["adamw_step_diff"] <= 1e-4 and r["sgd_step_diff"] <= 1e-6
    for opt in ("adamw", "sgd"):
        assert r[f"{opt}_loss_diff"] <= 1e-4 and r[f"{opt}_grad_norm_rel"] <= 1e-4
        assert r[f"{opt}_num_steps"] == [2, 2]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _child(sys.argv[1], sys.argv[2])
