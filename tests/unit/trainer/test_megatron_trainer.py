"""MegatronTrainer (megatron-core GPTModel, TP=1, CPU, in this process) against HFTrainer.

On one tiny Qwen2 model directory (random weights, biases and norms), float32:
- ``named_tensors()`` before training equals the directory's tensors exactly (HF -> Megatron -> HF);
- sequence log-probs equal HFTrainer's: max |diff| <= 1e-4 on sums of ~10 token log-probs
  (measured ~1e-6; the two compute attention and RMSNorm in different orders);
- one k1.5 iteration (``trainer.policy.train_iteration``, same batch, same settings, lr 1e-3)
  leaves both trainers' HF tensors close: SGD max |diff| <= 1e-6; AdamW max |diff| <= 1e-4 (10% of
  lr: a fresh AdamW's first step is lr * g / (|g| + eps), sign-like, so a weight whose gradient is
  near eps turns a ~1e-7 gradient difference into up to ~3e-5, measured) and mean |diff| <= 1e-6;
  both give the same loss after the step, and the SGD step lowers it;
- save -> load_hf_weights round trip; token log-probs (GRPO) agree with HF's.
"""

from __future__ import annotations

import pathlib
import random

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
pytest.importorskip("transformers")

from demo.tiny_model import VOCAB_SIZE, load_state_dict_from_dir, write_model_dir
from tests.unit.trainer.tiny import tiny_config, tiny_hf
from trainer import policy
from trainer.base import TrainerConfig
from trainer.factory import make_trainer
from trainer.hf import HFTrainer
from trainer.loss import k15_policy_loss

REPO = pathlib.Path(__file__).resolve().parents[3]
LOGPROB_ATOL = 1e-4
STEP_ATOL = {"sgd": 1e-6, "adamw": 1e-4}
STEP_MEAN_ATOL = 1e-6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if torch.distributed.is_initialized():
        pytest.skip("a default process group is already initialized in this pytest process")
    _, state = tiny_hf(seed=3)
    return write_model_dir(tmp_path_factory.mktemp("mg_trainer") / "model", tiny_config(), state)


@pytest.fixture
def trainers(model_dir):
    config = TrainerConfig(lr=1e-3, autocast_dtype="float32", num_threads=1, grad_clip=1.0)
    mg = make_trainer("megatron", model_dir, config)
    try:
        yield mg, HFTrainer(model_dir, config)
    finally:
        mg.close()


def _batch(seed: int, groups: int = 3, k: int = 4) -> policy.TrainBatch:
    rng = random.Random(seed)
    prompts, responses, masks, rewards = [], [], [], []
    for _ in range(groups):
        prompt = tuple([1] + [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(3, 8))])
        group_rewards = []
        for j in range(k):
            response = tuple(rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(2, 12)))
            prompts.append(prompt)
            responses.append(response)
            masks.append(tuple(1 for _ in response))
            group_rewards.append(float(j % 2))
        rewards.append(tuple(group_rewards))
    return policy.TrainBatch(tuple(prompts), tuple(responses), tuple(masks), tuple(rewards))


def test_named_tensors_round_trip_exactly(trainers, model_dir):
    mg, _ = trainers
    want = load_state_dict_from_dir(model_dir)
    got = mg.named_tensors()
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_sequence_logprobs_equal_hf(trainers):
    mg, hf = trainers
    batch = _batch(0)
    rows = list(range(len(batch.prompt_ids)))
    masks = [tuple(int(t % 3 != 0) for t in range(len(r))) for r in batch.response_ids]  # some tokens dropped
    with torch.no_grad():
        a = mg.sequence_logprobs(batch.prompt_ids, batch.response_ids, masks)
        b = hf.sequence_logprobs(batch.prompt_ids, batch.response_ids, masks)
        ta = policy.token_logprobs(mg, batch, rows, 12)
        tb = policy.token_logprobs(hf, batch, rows, 12)
    diff = (a - b).abs().max().item()
    print(f"max |megatron - HF| sequence log-prob: {diff:.3g} (values ~{b.abs().mean():.1f})")
    assert a.shape == b.shape and diff <= LOGPROB_ATOL
    assert (ta - tb).abs().max().item() <= LOGPROB_ATOL


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_one_k15_iteration_matches_hf_and_lowers_the_loss(model_dir, optimizer):
    config = TrainerConfig(lr=1e-3, optimizer=optimizer, autocast_dtype="float32", num_threads=1)
    mg = make_trainer("megatron", model_dir, config)
    try:
        hf = HFTrainer(model_dir, config)
        batch = _batch(1)
        train = policy.TrainConfig(tau=0.5, lr=1e-3, num_minibatches=1, num_epochs=1)
        with torch.no_grad():
            ref = mg.sequence_logprobs(batch.prompt_ids, batch.response_ids, batch.response_masks)
        ref = ref.view(batch.num_groups, batch.k)
        rewards = torch.tensor(batch.rewards)
        stats = {}
        for name, t in (("megatron", mg), ("hf", hf)):
            stats[name] = policy.train_iteration(t, batch, train, random.Random(0))
        assert stats["megatron"]["num_steps"] == stats["hf"]["num_steps"] == 1
        assert abs(stats["megatron"]["loss"] - stats["hf"]["loss"]) <= 1e-5
        got, want = mg.named_tensors(), hf.named_tensors()
        diff = max((got[n] - want[n]).abs().max().item() for n in want)
        mean = sum((got[n] - want[n]).abs().sum().item() for n in want) / sum(t.numel() for t in want.values())
        moved = max((want[n] - w).abs().max().item() for n, w in load_state_dict_from_dir(model_dir).items())
        print(
            f"{optimizer}: after one k1.5 step |megatron - HF| max {diff:.3g} mean {mean:.3g} "
            f"(weights moved up to {moved:.3g})"
        )
        assert diff <= STEP_ATOL[optimizer] and mean <= STEP_MEAN_ATOL and moved > 10 * STEP_ATOL[optimizer]
        with torch.no_grad():
            after = {
                name: k15_policy_loss(
                    t.sequence_logprobs(batch.prompt_ids, batch.response_ids, batch.response_masks).view(
                        batch.num_groups, batch.k
                    ),
                    ref,
                    rewards,
                    0.5,
                ).item()
                for name, t in (("megatron", mg), ("hf", hf))
            }
        assert abs(after["megatron"] - after["hf"]) <= 1e-4
        if optimizer == "sgd":  # a small plain gradient step descends (AdamW's sign-like lr 1e-3 step may overshoot)
            assert after["megatron"] < stats["megatron"]["loss"]
    finally:
        mg.close()


def test_save_then_load_restores_the_weights(trainers, tmp_path):
    mg, _ = trainers
    batch = _batch(2)
    mg.step(-mg.sequence_logprobs(batch.prompt_ids, batch.response_ids).mean())
    trained = mg.named_tensors(copy=True)
    out = mg.save(tmp_path / "ckpt")
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    mg.load_hf_weights(load_state_dict_from_dir(mg.source_dir))
    assert not torch.equal(mg.named_tensors()["model.embed_tokens.weight"], trained["model.embed_tokens.weight"])
    mg.load_hf_weights(load_state_dict_from_dir(out))
    now = mg.named_tensors()
    assert all(torch.equal(now[n], trained[n]) for n in trained)


def test_factory_rejects_unknown_backend(model_dir):
    with pytest.raises(ValueError, match="backend"):
        make_trainer("deepspeed", model_dir)
    with pytest.raises(ValueError, match="tensor parallelism"):
        make_trainer("hf", model_dir, tp_size=2)


def test_autocast_auto_resolves_to_float32_and_bfloat16_is_refused(model_dir):
    mg = make_trainer("megatron", model_dir, TrainerConfig(autocast_dtype="auto", num_threads=1))
    try:
        assert mg.dtype_choice.chosen == "float32"
    finally:
        mg.close()
    with pytest.raises(ValueError, match="custom autograd"):
        make_trainer("megatron", model_dir, TrainerConfig(autocast_dtype="bfloat16"))
    assert not torch.distributed.is_initialized()


def test_trainer_config_section():
    from orchestrator.config import load_config

    assert load_config().trainer.type == "hf"
    config = load_config("configs/megatron.json")
    assert config.trainer.type == "megatron"
    assert load_config(None, ["trainer.type=megatron", "trainer.tp_size=2"]).trainer.tp_size == 2
    with pytest.raises(ValueError, match="only the megatron trainer"):
        load_config(None, ["trainer.tp_size=2"])
    with pytest.raises(ValueError, match="trainer.type"):
        load_config(None, ["trainer.type=deepspeed"])


def test_the_megatron_config_is_the_demo_recipe_with_another_trainer():
    """configs/megatron.json differs from configs/demo.json in its trainer section alone: the RL recipe,
    data, rollout, rewards, engine and evaluation are the demo's. With the Megatron step equal to the HF
    trainer's (tests/integration/dist/test_megatron_tp_trainer.py, TP=2) this makes the demo's learning
    run (tests/integration/e2e/test_rl_demo.py) the learning check of the Megatron job too."""
    import dataclasses

    from orchestrator.config import load_config

    demo, megatron = load_config(REPO / "configs" / "demo.json"), load_config(REPO / "configs" / "megatron.json")
    assert (megatron.trainer.type, megatron.trainer.tp_size) == ("megatron", 2)
    assert dataclasses.replace(megatron, trainer=demo.trainer) == demo


def test_the_rl_job_builds_an_in_process_megatron_trainer_at_tp1(model_dir, tmp_path):
    """configs/megatron.json at trainer.tp_size=1: the job's own make_trainers gives an in-process
    MegatronTrainer with the job's optimizer settings, which trains, and saves an HF directory the job
    can load (the RL loop's TP=1 wiring; the loop itself runs Megatron at TP=2 in test_megatron_rl.py)."""
    from orchestrator.config import load_config
    from orchestrator.loop_setup import make_trainers
    from trainer.megatron.trainer import MegatronTrainer

    job = load_config(REPO / "configs" / "megatron.json", ["trainer.tp_size=1", "rl.autocast_dtype=float32"])
    trainer, reference = make_trainers(job, model_dir)
    try:
        assert type(trainer) is MegatronTrainer
        assert (trainer.config.lr, trainer.config.optimizer) == (job.rl.lr, job.rl.optimizer)
        disk = load_state_dict_from_dir(model_dir)
        before = trainer.named_tensors()
        assert set(before) == set(disk) and all(torch.equal(before[n], disk[n]) for n in disk)
        train = policy.TrainConfig(tau=job.rl.tau, lr=job.rl.lr, num_minibatches=1, num_epochs=1)
        assert policy.train_iteration(trainer, _batch(5), train, random.Random(0))["num_steps"] == 1
        saved = load_state_dict_from_dir(trainer.save(tmp_path / "saved"))
        assert set(saved) == set(disk) and any(not torch.equal(saved[n], disk[n]) for n in disk)
    finally:
        trainer.close()
        if reference is not None:
            reference.close()
