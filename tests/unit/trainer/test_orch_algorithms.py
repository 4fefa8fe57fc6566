"""rl.algorithm baselines (GRPO, REINFORCE) and DPO: losses against hand-computed values, the pair and
rejection-sampling rules of long2short, the objective factory, and one real step of each on a tiny model."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from demo import tiny_model as tm
from orchestrator.config import RLConfig, load_config
from trainer import dpo, policy
from trainer.base import TrainerConfig
from trainer.hf import HFTrainer
from trainer.loss import (
    dpo_loss,
    grpo_policy_loss,
    grpo_policy_loss_with_stats,
    normalized_group_advantages,
    reinforce_policy_loss,
)
from trainer.policy import TrainConfig, make_objective, reference_logprobs, token_logprobs, train_iteration

# -- GRPO advantage --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rewards, eps, expected",
    [
        # mean 0.5, population std 0.5: (r - 0.5) / (0.5 + 1e-4) = +-0.5 / 0.5001
        ([[1.0, 0.0, 0.0, 1.0]], 1e-4, [[0.5 / 0.5001, -0.5 / 0.5001, -0.5 / 0.5001, 0.5 / 0.5001]]),
        # mean 2, std 1: +-1 / (1 + 1e-4)
        ([[3.0, 1.0]], 1e-4, [[1 / 1.0001, -1 / 1.0001]]),
        # all equal: centred rewards are 0, std 0 -> 0 / eps = 0
        ([[2.0, 2.0, 2.0]], 1e-4, [[0.0, 0.0, 0.0]]),
        # two groups are normalised separately: [0, 3] -> mean 1.5, std 1.5 -> +-1 (eps 1e-12)
        ([[0.0, 3.0], [5.0, 7.0]], 1e-12, [[-1.0, 1.0], [-1.0, 1.0]]),
    ],
)
def test_normalized_group_advantages(rewards, eps, expected):
    got = normalized_group_advantages(torch.tensor(rewards, dtype=torch.float64), eps)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), atol=1e-9)


# -- REINFORCE -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logp, rewards, loss, grad",
    [
        # A = [0.5, -0.5]; L = -mean(-1 * 0.5, -2 * -0.5) = -mean(-0.5, 1.0) = -0.25; dL/dlogp = -A / 2
        ([[-1.0, -2.0]], [[1.0, 0.0]], -0.25, [[-0.25, 0.25]]),
        # second group uniform (A = 0): L = -(-0.5 + 1.0 + 0 + 0) / 4 = -0.125; dL/dlogp = -A / 4
        ([[-1.0, -2.0], [-3.0, -4.0]], [[1.0, 0.0], [2.0, 2.0]], -0.125, [[-0.125, 0.125], [0.0, 0.0]]),
        # A = [1, -0.5, -0.5] (mean 1); L = -(-1*1 + -1*-0.5 + -4*-0.5)/3 = -(1.5)/3 = -0.5
        ([[-1.0, -1.0, -4.0]], [[2.0, 0.5, 0.5]], -0.5, [[-1 / 3, 0.5 / 3, 0.5 / 3]]),
    ],
)
def test_reinforce_loss_table(logp, rewards, loss, grad):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    value = reinforce_policy_loss(logp, torch.tensor(rewards, dtype=torch.float64))
    value.backward()
    assert value.item() == pytest.approx(loss)
    assert torch.allclose(logp.grad, torch.tensor(grad, dtype=torch.float64))


# -- GRPO loss -------------------------------------------------------------------------------------


def _grpo_case(ratios, init_minus_logp, mask, rewards):
    """logp_old = -1 everywhere; logp = logp_old + ln(ratio); logp_init = logp + init_minus_logp."""
    old = torch.full((1, 2, 2), -1.0, dtype=torch.float64)
    logp = (old + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_(True)
    init = logp.detach() + torch.tensor(init_minus_logp, dtype=torch.float64)
    return logp, old, init, torch.tensor(mask, dtype=torch.float64), torch.tensor(rewards, dtype=torch.float64)


LN2 = math.log(2.0)
K3_LN2 = 2.0 - LN2 - 1.0  # k3 at log(init/pi) = ln 2: e^d - d - 1 = 0.3068528...


@pytest.mark.parametrize(
    "ratios, init_minus_logp, mask, rewards, kl_coef, loss, grad, clip_fraction",
    [
        # rewards [3, 1] -> A = [+1, -1] (eps 1e-12); clip_eps 0.2; no KL.
        # response 0 (A=+1): ratios [1.5, 0.9] -> min(1.5, 1.2) = 1.2 (clipped: no grad), min(0.9, 0.9) = 0.9
        #   -> per-response mean 1.05
        # response 1 (A=-1): ratios [1.5, 0.5] -> min(-1.5, -1.2) = -1.5 (grad), min(-0.5, -0.8) = -0.8
        #   (clipped: no grad) -> mean -1.15
        # L = -(1.05 - 1.15) / 2 = 0.05; dL/dlogp_t = -ratio_t * A / (2 responses * 2 tokens) where unclipped:
        #   [0, -0.9/4], [+1.5/4, 0]; clipped tokens: 2 of 4
        (
            [[[1.5, 0.9], [1.5, 0.5]]],
            [[[0, 0], [0, 0]]],
            [[[1, 1], [1, 1]]],
            [[3.0, 1.0]],
            0.0,
            0.05,
            [[[0.0, -0.225], [0.375, 0.0]]],
            0.5,
        ),
        # the same with response 0's second token masked (a stale segment): response 0's mean is 1.2 over
        # its one counted token (clipped: no grad); L = -(1.2 - 1.15) / 2 = -0.025; response 1 unchanged
        # (dL/dlogp = 1.5 / (2 responses * 2 tokens)); clipped: 2 of 3 counted tokens
        (
            [[[1.5, 0.9], [1.5, 0.5]]],
            [[[0, 0], [0, 0]]],
            [[[1, 0], [1, 1]]],
            [[3.0, 1.0]],
            0.0,
            -0.025,
            [[[0.0, 0.0], [0.375, 0.0]]],
            2 / 3,
        ),
        # equal rewards (A = 0), ratio 1, only the KL: response 0 token 0 has log(init/pi) = ln 2 -> k3 = 0.30685
        # L = -(-0.1 * 0.30685 / 2 + 0) / 2 = 0.1 * 0.30685 / 4 = 0.0076713
        # d k3 / d logp = 1 - e^d = -1 -> dL/dlogp = 0.1 * (-1) / 4 = -0.025 (raise logp toward the initial policy)
        (
            [[[1.0, 1.0], [1.0, 1.0]]],
            [[[LN2, 0], [0, 0]]],
            [[[1, 1], [1, 1]]],
            [[1.0, 1.0]],
            0.1,
            0.1 * K3_LN2 / 4,
            [[[-0.025, 0.0], [0.0, 0.0]]],
            0.0,
        ),
    ],
)
def test_grpo_loss_table(ratios, init_minus_logp, mask, rewards, kl_coef, loss, grad, clip_fraction):
    logp, old, init, mask, rewards = _grpo_case(ratios, init_minus_logp, mask, rewards)
    value, stats = grpo_policy_loss_with_stats(
        logp, old, init, mask, rewards, clip_eps=0.2, kl_coef=kl_coef, adv_eps=1e-12
    )
    value.backward()
    assert value.item() == pytest.approx(loss, abs=1e-9)
    assert torch.allclose(logp.grad, torch.tensor(grad, dtype=torch.float64), atol=1e-9)
    assert stats.clip_fraction == pytest.approx(clip_fraction)


def test_grpo_masked_garbage_and_no_reference():
    logp, old, _, mask, rewards = _grpo_case(
        [[[1.5, 0.9], [1.5, 0.5]]], [[[0, 0], [0, 0]]], [[[1, 0], [1, 1]]], [[3.0, 1.0]]
    )
    with torch.no_grad():
        logp[0, 0, 1] = 500.0  # a padding/stale position: exp(500 - (-1)) would overflow if it reached exp()
    value = grpo_policy_loss(logp, old, None, mask, rewards, clip_eps=0.2, kl_coef=0.0, adv_eps=1e-12)
    assert value.item() == pytest.approx(-0.025)
    with pytest.raises(ValueError, match="logp_init"):
        grpo_policy_loss(logp, old, None, mask, rewards, kl_coef=0.1)
    with pytest.raises(ValueError, match="clip_eps"):
        grpo_policy_loss(logp, old, None, mask, rewards, clip_eps=1.0, kl_coef=0.0)


def test_grpo_at_the_rollout_policy_is_the_normalised_policy_gradient():
    """ratio 1, no KL: dL/dlogp_t = -A_i / (num_responses * num_counted_tokens_i)."""
    torch.manual_seed(0)
    logp = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.4, 0.9]], dtype=torch.float64)
    mask = torch.ones_like(logp)
    mask[1, 2, 3] = 0
    grpo_policy_loss(logp, logp.detach(), None, mask, rewards, kl_coef=0.0).backward()
    adv = normalized_group_advantages(rewards).unsqueeze(-1)
    expected = -adv / (6 * mask.sum(-1, keepdim=True)) * mask
    assert torch.allclose(logp.grad, expected)


# -- DPO -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pi_w, pi_l, ref_w, ref_l, beta, loss",
    [
        # margin (pi_w - ref_w) - (pi_l - ref_l) = 2 - (-3) = 5; beta * 5 = 0.5; -log sigmoid(0.5) = log(1 + e^-0.5)
        ([-3.0], [-8.0], [-5.0], [-5.0], 0.1, math.log(1 + math.exp(-0.5))),  # 0.474077
        # margin 0: log 2
        ([-4.0], [-4.0], [-4.0], [-4.0], 0.1, math.log(2.0)),  # 0.693147
        # both pairs: the mean, (0.474077 + 0.693147) / 2 = 0.583612
        (
            [-3.0, -4.0],
            [-8.0, -4.0],
            [-5.0, -4.0],
            [-5.0, -4.0],
            0.1,
            (math.log(1 + math.exp(-0.5)) + math.log(2.0)) / 2,
        ),
        # margin -2 with beta 1: log(1 + e^2) = 2.126928
        ([-6.0], [-4.0], [-5.0], [-5.0], 1.0, math.log(1 + math.exp(2.0))),
    ],
)
def test_dpo_loss_table(pi_w, pi_l, ref_w, ref_l, beta, loss):
    t = lambda v: torch.tensor(v, dtype=torch.float64)
    pi_w_t = t(pi_w).requires_grad_(True)
    value = dpo_loss(pi_w_t, t(pi_l), t(ref_w), t(ref_l), beta)
    value.backward()
    assert value.item() == pytest.approx(loss)
    # dL/dpi_w = -beta * sigmoid(-beta * margin) / num_pairs: pushes the chosen response up
    margin = (t(pi_w) - t(ref_w)) - (t(pi_l) - t(ref_l))
    assert torch.allclose(pi_w_t.grad, -beta * torch.sigmoid(-beta * margin) / len(pi_w))


def test_dpo_loss_rejects_bad_input():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="num_pairs"):
        dpo_loss(x, torch.zeros(3), x, x)


GROUP = [("a", True, 10), ("b", False, 5), ("c", True, 15), ("d", True, 14), ("e", True, 10)]


@pytest.mark.parametrize(
    "group, ratio, expected",
    [
        # shortest correct: a (10 tokens; e ties and loses to the earlier sample). Negatives: b (wrong, even
        # though shorter), c (15 >= 1.5 * 10); d (14 < 15) and e (10) are neither
        (GROUP, 1.5, [("a", "b", "wrong"), ("a", "c", "long")]),
        # ratio 1.4: 14 >= 14 makes d a negative too
        (GROUP, 1.4, [("a", "b", "wrong"), ("a", "c", "long"), ("a", "d", "long")]),
        ([("x", False, 3), ("y", False, 9)], 1.5, []),  # no correct response: no pairs
        ([("x", True, 7), ("y", True, 8)], 1.5, []),  # all correct and of similar length: nothing to prefer
        ([("x", True, 20), ("y", True, 8), ("z", False, 1)], 1.5, [("y", "x", "long"), ("y", "z", "wrong")]),
    ],
)
def test_build_dpo_pairs(group, ratio, expected):
    pairs = dpo.build_dpo_pairs(group, length_ratio=ratio)
    assert [(p.chosen, p.rejected, p.reason) for p in pairs] == expected


@pytest.mark.parametrize(
    "groups, expected",
    [
        # prompt p1: shortest correct of 8 samples is "s3" (4 tokens); p2: none correct -> no SFT example;
        # p3: tie at 6 tokens -> the first one
        (
            [
                ("p1", [(f"s{i}", i % 2 == 1, 10 - 2 * i if i < 4 else 3 + i) for i in range(8)]),
                ("p2", [("w", False, 2), ("v", False, 1)]),
                ("p3", [("t1", True, 6), ("t2", True, 6), ("t3", False, 1)]),
            ],
            [("p1", "s3"), ("p3", "t1")],
        ),
        ([], []),
    ],
)
def test_shortest_rejection_sampling(groups, expected):
    # p1's lengths: s0 10, s1 8, s2 6, s3 4, s4 7, s5 8, s6 9, s7 10; correct: s1, s3, s5, s7 -> s3
    assert dpo.shortest_rejection_sampling(groups) == expected


def test_bad_samples_are_rejected():
    with pytest.raises(ValueError, match="num_tokens"):
        dpo.shortest_correct([("a", True, -1)])
    with pytest.raises(ValueError, match="length_ratio"):
        dpo.build_dpo_pairs([("a", True, 1)], length_ratio=0.5)


# -- config and the factory ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"algorithm": "ppo"}, "rl.algorithm"),
        ({"clip_eps": 0.0}, "clip_eps"),
        ({"clip_eps": 1.0}, "clip_eps"),
        ({"kl_coef": -0.1}, "kl_coef"),
    ],
)
def test_rl_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RLConfig(**kwargs)


def test_rl_config_algorithm_override():
    config = load_config(None, ["rl.algorithm=grpo", "rl.kl_coef=0", "rl.clip_eps=0.1"]).rl
    assert (config.algorithm, config.kl_coef, config.clip_eps) == ("grpo", 0.0, 0.1)
    assert RLConfig().algorithm == "k15"


@pytest.mark.parametrize(
    "algorithm, cls",
    [("k15", policy.K15Objective), ("grpo", policy.GrpoObjective), ("reinforce", policy.ReinforceObjective)],
)
def test_make_objective(algorithm, cls):
    assert isinstance(make_objective(TrainConfig(tau=0.1, lr=1e-3, algorithm=algorithm)), cls)


def test_make_objective_rejects():
    with pytest.raises(ValueError, match="algorithm"):
        make_objective(TrainConfig(tau=0.1, lr=1e-3, algorithm="ppo"))
    with pytest.raises(ValueError, match="initial policy"):
        make_objective(TrainConfig(tau=0.1, lr=1e-3, algorithm="grpo", kl_coef=0.1))


# -- one real iteration on a tiny HF model ---------------------------------------------------------

SMALL = tm.TinyModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128, init_std=0.1
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.make_tiny_model(tmp_path_factory.mktemp("algorithms"), SMALL, seed=3)


def _trainer(model_dir):
    return HFTrainer(model_dir, TrainerConfig(lr=1e-3, num_threads=1))


def _batch(num_groups=2, k=4, seed=0):
    rng = random.Random(seed)
    prompts, responses, masks, rewards = [], [], [], []
    for _ in range(num_groups):
        prompt = (1,) + tuple(rng.randrange(3, 60) for _ in range(rng.randint(2, 5)))
        for _ in range(k):
            response = tuple(rng.randrange(3, 60) for _ in range(rng.randint(3, 8)))
            prompts.append(prompt)
            responses.append(response)
            masks.append((0,) + (1,) * (len(response) - 1))  # a stale first token
        rewards.append(tuple(float(j % 2) for j in range(k)))
    return policy.TrainBatch(tuple(prompts), tuple(responses), tuple(masks), tuple(rewards))


def test_token_logprobs_sum_to_the_trainers_sequence_logprobs(model_dir):
    trainer, batch = _trainer(model_dir), _batch()
    rows = list(range(batch.num_groups * batch.k))
    width = max(len(r) for r in batch.response_ids) + 2
    with torch.no_grad():
        tokens = token_logprobs(trainer, batch, rows, width)
        sequences = reference_logprobs(trainer, batch).view(-1)
    assert tokens.shape == (len(rows), width)
    assert torch.allclose(tokens.sum(-1), sequences, atol=1e-5)
    for i, response in enumerate(batch.response_ids):  # zero where masked and past the end
        assert (
            tokens[i, 0] == 0 and (tokens[i, len(response) :] == 0).all() and (tokens[i, 1 : len(response)] < 0).all()
        )


@pytest.mark.parametrize("algorithm", ["grpo", "reinforce"])
def test_baselines_move_probability_toward_rewarded_responses(model_dir, algorithm):
    trainer, batch = _trainer(model_dir), _batch()
    initial = _trainer(model_dir) if algorithm == "grpo" else None
    before = reference_logprobs(trainer, batch)
    stats = train_iteration(
        trainer,
        batch,
        TrainConfig(tau=0.01, lr=3e-3, num_epochs=4, algorithm=algorithm, kl_coef=0.04 if initial else 0.0),
        random.Random(0),
        initial_policy=initial,
    )
    assert stats["num_steps"] == 4 and math.isfinite(stats["loss"])
    if algorithm == "grpo":
        assert 0 <= stats["clip_fraction"] <= 1 and stats["kl_to_initial"] >= 0 and stats["clip_fraction"] > 0
    delta = reference_logprobs(trainer, batch) - before
    assert delta[:, 1::2].mean() > delta[:, 0::2].mean() + 0.1  # reward 1 at odd positions


def test_dpo_train_prefers_the_chosen_responses(model_dir):
    trainer, reference = _trainer(model_dir), _trainer(model_dir)
    pairs = [dpo.TokenPair((1, 5, 6), (7, 8), (9, 10, 11, 12)), dpo.TokenPair((1, 20), (21,), (22, 23, 24))]

    def margin():
        with torch.no_grad():
            w, l = dpo._pair_logprobs(trainer, pairs)
            rw, rl = dpo._pair_logprobs(reference, pairs)
        return ((w - rw) - (l - rl)).mean().item()

    assert margin() == pytest.approx(0.0, abs=1e-5)
    stats = dpo.dpo_train(trainer, reference, pairs, beta=0.1, lr=3e-3, num_epochs=3, pairs_per_step=2)
    assert stats["num_steps"] == 3 and stats["first_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert margin() > 1.0 and stats["last_loss"] < stats["first_loss"]


# -- the benchmark's bookkeeping (no runs) ---------------------------------------------------------


def _bench():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "bench_algorithms.py"
    spec = importlib.util.spec_from_file_location("bench_algorithms", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_summary_and_command(tmp_path):
    bench = _bench()
    # medians: k15 0.60, grpo 0.55, reinforce 0.50 -> k15 - best baseline (grpo) = 5 points
    result = bench.summarize({"k15": [0.6, 0.7, 0.5], "grpo": [0.55, 0.4, 0.6], "reinforce": [0.5, 0.5, 0.5]})
    assert result["final_heldout_accuracy"] == {"k15": 0.6, "grpo": 0.55, "reinforce": 0.5}
    assert result["final_heldout_accuracy_min"]["grpo"] == 0.4 and result["final_heldout_accuracy_max"]["k15"] == 0.7
    assert result["k15_minus_best_baseline_points"] == pytest.approx(5.0) and result["best_baseline"] == "grpo"
    assert bench.summarize({"k15": [0.5]})["k15_minus_best_baseline_points"] is None
    args = bench.parse_args(["--seeds", "2", "--iterations", "4", "--set", "rl.kl_coef=0.01"])
    cmd = bench.job_command(args, "grpo", 1, tmp_path)
    sets = [cmd[i + 1] for i, part in enumerate(cmd) if part == "--set"]
    assert {
        "rl.algorithm=grpo",
        "rl.num_iterations=4",
        "rl.seed=1",
        "sampling.seed=1",
        "engine.seed=1",
        "eval.num_sampled_problems=0",
    } <= set(sets) and sets[-1] == "rl.kl_coef=0.01"
    load_config(args.config, sets)  # every override is a valid config key
    (tmp_path / "summary.json").write_text(json.dumps({"heldout_accuracy_before": 0.3, "num_iterations": 2}))
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"iteration": 1, "evaluated": False, "heldout_accuracy": 0.3},
                {"iteration": 2, "evaluated": True, "heldout_accuracy": 0.4},
            ]
        )
    )
    assert bench.accuracy_curve(tmp_path) == [(0, 0.3), (2, 0.4)]
    bench.plot({"k15": [[(0, 0.3), (2, 0.4)]], "grpo": [[(0, 0.3), (2, 0.35)]]}, tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


# -- the loop passes the algorithm through ---------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["grpo", "reinforce"])
def test_the_rl_job_runs_each_baseline(algorithm, tmp_path, monkeypatch):
    from orchestrator.loop import run_job
    from tests.unit.orchestrator.test_orch_loop_job import ScriptedEngine

    model = tm.make_tiny_model(tmp_path / "model", SMALL, seed=5)
    seen = []
    real = policy.train_iteration

    def spy(trainer, batch, config, rng, initial_policy=None):
        seen.append((config.algorithm, config.kl_coef, initial_policy))
        return real(trainer, batch, config, rng, initial_policy=initial_policy)

    monkeypatch.setattr(policy, "train_iteration", spy)
    config = load_config(
        None,
        [
            f"init_model_dir={model}",
            "rl.num_iterations=2",
            "rl.num_responses_per_prompt=2",
            "rl.num_threads=1",
            "data.train_levels=[2,4]",
            "data.num_train_problems=64",
            "data.heldout_levels=[2]",
            "data.num_heldout_per_level=4",
            "rollout.iteration_token_budget=256",
            "rollout.segment_max_tokens=64",
            "rollout.max_response_tokens=64",
            "eval.num_sampled_problems=0",
            f"rl.algorithm={algorithm}",
            "rl.kl_coef=0.05",
        ],
    )
    summary = run_job(config, tmp_path / "run", progress_bar=False, engine_factory=lambda c, p: ScriptedEngine(p))
    assert summary["num_iterations"] == 2 and seen and all(a == algorithm and k == 0.05 for a, k, _ in seen)
    if algorithm == "grpo":  # the frozen initial policy is the model RL started from
        initial = seen[0][2]
        start = tm.load_state_dict_from_dir(model)
        assert all(torch.equal(initial.named_tensors()[k], start[k]) for k in start)
    else:
        assert all(i is None for _, _, i in seen)
