"""One policy-optimization iteration on a real (tiny) HF trainer: reference policy, optimizer reset, direction."""

import copy
import random

import pytest
import torch

from demo import tiny_model as tm
from tests.unit.trainer.tiny import SMALL
from trainer import policy
from trainer.base import TrainerConfig
from trainer.hf import HFTrainer
from trainer.policy import TrainBatch, TrainConfig, reference_logprobs, train_iteration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.make_tiny_model(tmp_path_factory.mktemp("policy"), SMALL, seed=3)


@pytest.fixture
def trainer(model_dir):
    return HFTrainer(model_dir, TrainerConfig(lr=1e-3, num_threads=1))


def make_batch(num_groups=4, k=4, seed=0, uniform=()):
    rng = random.Random(seed)
    prompts, responses, masks, rewards = [], [], [], []
    for g in range(num_groups):
        prompt = (1,) + tuple(rng.randrange(3, 60) for _ in range(4))
        group_rewards = []
        for j in range(k):
            response = tuple(rng.randrange(3, 60) for _ in range(rng.randint(3, 8)))
            prompts.append(prompt)
            responses.append(response)
            masks.append((1,) * len(response))
            group_rewards.append(0.5 if g in uniform else float(j % 2))
        rewards.append(tuple(group_rewards))
    return TrainBatch(tuple(prompts), tuple(responses), tuple(masks), tuple(rewards))


def test_reference_logprobs_come_from_the_iteration_start_weights(trainer, monkeypatch):
    batch = make_batch()
    start_model = copy.deepcopy(trainer)
    expected_ref = reference_logprobs(start_model, batch)
    seen = []
    real = policy.k15_policy_loss_with_stats

    def spy(logp, logp_ref, rewards, tau):
        seen.append((logp.detach().clone(), logp_ref.clone()))
        return real(logp, logp_ref, rewards, tau)

    monkeypatch.setattr(policy, "k15_policy_loss_with_stats", spy)
    stats = train_iteration(
        trainer, batch, TrainConfig(tau=0.1, lr=1e-3, num_minibatches=2, num_epochs=3), random.Random(0)
    )
    assert stats["num_steps"] == 6 == len(seen)
    refs = torch.cat([ref for _, ref in seen])
    # every step saw rows of the same reference: the start policy's log-probs, whatever the step
    assert refs.shape == (3 * batch.num_groups, batch.k)
    for epoch in range(3):  # each epoch's minibatches cover every group once, with its start-policy row
        ref = torch.cat([r for _, r in seen[2 * epoch : 2 * epoch + 2]])
        nearest = [(expected_ref - row).abs().max(dim=1).values.argmin().item() for row in ref]
        assert sorted(nearest) == list(range(batch.num_groups))
        assert torch.allclose(ref, expected_ref[nearest], atol=1e-5)
    # the first step starts at the reference; later steps have moved away from it
    assert torch.allclose(seen[0][0], seen[0][1], atol=1e-5)
    assert (seen[-1][0] - seen[-1][1]).abs().max() > 1e-4
    # and the reference is not the current policy after training
    assert (reference_logprobs(trainer, batch) - expected_ref).abs().max() > 1e-4


def test_optimizer_is_reset_every_iteration(trainer, monkeypatch):
    calls = []
    real = trainer.reset_optimizer

    def counting():
        calls.append(len(trainer.optimizer.state))
        real()

    monkeypatch.setattr(trainer, "reset_optimizer", counting)
    config = TrainConfig(tau=0.1, lr=1e-3, num_minibatches=2)
    for iteration in range(3):
        train_iteration(trainer, make_batch(seed=iteration), config, random.Random(iteration))
        assert len(trainer.optimizer.state) > 0  # the steps filled the fresh optimizer
    assert len(calls) == 3 and calls[0] == 0 and calls[1] > 0  # state existed and was dropped


def test_training_moves_probability_toward_rewarded_responses(trainer):
    batch = make_batch(num_groups=2, k=4)
    before = reference_logprobs(trainer, batch)
    train_iteration(trainer, batch, TrainConfig(tau=0.01, lr=3e-3, num_minibatches=1, num_epochs=4), random.Random(0))
    delta = reference_logprobs(trainer, batch) - before
    rewarded = delta[:, 1::2].mean()  # reward 1 at odd positions
    penalized = delta[:, 0::2].mean()
    assert rewarded > penalized + 0.1


def test_uniform_groups_are_skipped_and_all_uniform_means_no_step(trainer):
    weights = {k: v.clone() for k, v in trainer.named_tensors().items()}
    stats = train_iteration(trainer, make_batch(uniform=(0, 1, 2, 3)), TrainConfig(tau=0.1, lr=1e-3), random.Random(0))
    assert stats == {"num_train_groups": 0, "num_skipped_groups": 4, "num_steps": 0, "lr": 1e-3}
    assert all(torch.equal(weights[k], v) for k, v in trainer.named_tensors().items())
    stats = train_iteration(trainer, make_batch(uniform=(1,)), TrainConfig(tau=0.1, lr=1e-3), random.Random(0))
    assert stats["num_train_groups"] == 3 and stats["num_skipped_groups"] == 1 and stats["num_steps"] == 1
