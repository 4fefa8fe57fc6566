"""k1.5 policy loss: autograd gradient == eq. (3) computed by hand, on tiny real models."""

from __future__ import annotations

import copy

import pytest
import torch

from trainer.loss import (
    LossConfig,
    group_advantages,
    k15_policy_loss,
    k15_policy_loss_with_stats,
    sequence_logprobs,
)

VOCAB = 11


class TinyCausalLM(torch.nn.Module):
    """Embedding -> causal running mean -> tanh MLP -> logits: a real autoregressive policy."""

    def __init__(self, vocab: int = VOCAB, dim: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.hidden = torch.nn.Linear(2 * dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(ids)
        steps = torch.arange(1, ids.shape[1] + 1, dtype=e.dtype).view(1, -1, 1)
        context = e.cumsum(dim=1) / steps
        return self.head(torch.tanh(self.hidden(torch.cat([e, context], dim=-1))))


def _batch(num_prompts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded token ids [P*k, T] and a response-token mask (prompt/padding are 0)."""
    g = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    max_len = 12
    for _ in range(num_prompts):
        prompt = torch.randint(0, VOCAB, (3,), generator=g)
        for _ in range(k):
            resp_len = int(torch.randint(1, max_len - 3 + 1, (1,), generator=g))
            resp = torch.randint(0, VOCAB, (resp_len,), generator=g)
            ids = torch.cat([prompt, resp, torch.zeros(max_len - 3 - resp_len, dtype=torch.long)])
            mask = torch.cat([torch.zeros(3), torch.ones(resp_len), torch.zeros(max_len - 3 - resp_len)])
            rows.append(ids)
            masks.append(mask)
    return torch.stack(rows), torch.stack(masks).double()


def _seq_logp(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, num_prompts: int) -> torch.Tensor:
    logits = model(ids[:, :-1])
    if not isinstance(logits, torch.Tensor):  # transformers output
        logits = logits.logits
    return sequence_logprobs(logits, ids[:, 1:], mask[:, 1:]).view(num_prompts, -1)


def _hand_eq3(model, ids, mask, num_prompts, logp_ref, rewards, tau) -> list[torch.Tensor]:
    """Eq. (3) by hand: per-response grad log pi from separate autograd calls, combined by formula."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    k = rewards.shape[1]
    logp = _seq_logp(model, ids, mask, num_prompts)
    for i in range(num_prompts):
        mean_r = sum(float(r) for r in rewards[i]) / k
        for j in range(k):
            grads = torch.autograd.grad(logp[i, j], params, retain_graph=True)
            coeff = (float(rewards[i, j]) - mean_r) - tau * (float(logp[i, j].detach()) - float(logp_ref[i, j]))
            for acc, g in zip(total, grads):
                acc += coeff * g / (k * num_prompts)
    return total


def _autograd_ascent(model, ids, mask, num_prompts, logp_ref, rewards, tau) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    loss = k15_policy_loss(_seq_logp(model, ids, mask, num_prompts), logp_ref, rewards, tau)
    return [-g for g in torch.autograd.grad(loss, params)]


def _assert_close(a: list[torch.Tensor], b: list[torch.Tensor], rel: float = 1e-6) -> None:
    flat_a = torch.cat([x.flatten() for x in a])
    flat_b = torch.cat([x.flatten() for x in b])
    assert flat_b.norm() > 0
    err = float((flat_a - flat_b).norm() / flat_b.norm())
    assert err <= rel, f"relative error {err:.3e} > {rel}"


def _moved_copy(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The model after some training: every parameter perturbed, so logp != logp_ref."""
    moved = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return moved


@pytest.mark.parametrize(
    ("num_prompts", "k", "tau", "seed"),
    [(1, 2, 0.1, 0), (2, 4, 0.5, 1), (3, 3, 2.0, 2), (2, 8, 0.01, 3)],
)
def test_autograd_gradient_equals_eq3_by_hand(num_prompts, k, tau, seed):
    torch.manual_seed(seed)
    ref_model = TinyCausalLM().double()
    model = _moved_copy(ref_model, seed + 100)
    ids, mask = _batch(num_prompts, k, seed)
    with torch.no_grad():
        logp_ref = _seq_logp(ref_model, ids, mask, num_prompts)
    rewards = torch.randint(0, 2, (num_prompts, k), generator=torch.Generator().manual_seed(seed)).double()
    rewards[:, 0] = 1.0 - rewards[:, 1]  # every group has reward variance
    got = _autograd_ascent(model, ids, mask, num_prompts, logp_ref, rewards, tau)
    want = _hand_eq3(model, ids, mask, num_prompts, logp_ref, rewards, tau)
    _assert_close(got, want)


def test_reference_logprobs_come_from_iteration_start_weights():
    """At the iteration start logp == logp_ref: the tau term vanishes. After an optimizer step the
    gradient must use the start weights' log-probs (a reference from current weights differs)."""
    torch.manual_seed(7)
    num_prompts, k, tau = 2, 4, 1.0
    model = TinyCausalLM().double()
    start = copy.deepcopy(model)  # iteration start: the weights that sampled the responses
    ids, mask = _batch(num_prompts, k, 7)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.5]], dtype=torch.float64)
    with torch.no_grad():
        logp_ref = _seq_logp(start, ids, mask, num_prompts)

    at_start_small_tau = _autograd_ascent(model, ids, mask, num_prompts, logp_ref, rewards, 1e-3)
    at_start_big_tau = _autograd_ascent(model, ids, mask, num_prompts, logp_ref, rewards, 10.0)
    _assert_close(at_start_small_tau, at_start_big_tau, rel=1e-12)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    optimizer.zero_grad()
    k15_policy_loss(_seq_logp(model, ids, mask, num_prompts), logp_ref, rewards, tau).backward()
    optimizer.step()

    got = _autograd_ascent(model, ids, mask, num_prompts, logp_ref, rewards, tau)
    _assert_close(got, _hand_eq3(model, ids, mask, num_prompts, logp_ref, rewards, tau))
    with torch.no_grad():
        logp_now = _seq_logp(model, ids, mask, num_prompts)
    assert float((logp_now - logp_ref).abs().max()) > 1e-3
    wrong = _hand_eq3(model, ids, mask, num_prompts, logp_now, rewards, tau)
    diff = torch.cat([(a - b).flatten() for a, b in zip(got, wrong)]).norm()
    assert float(diff) > 1e-4 * float(torch.cat([g.flatten() for g in got]).norm())


def test_autograd_gradient_equals_eq3_on_tiny_qwen2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    ref_model = transformers.Qwen2ForCausalLM(config).double().eval()
    model = _moved_copy(ref_model, 5)
    num_prompts, k, tau = 2, 3, 0.3
    ids, mask = _batch(num_prompts, k, 11)
    with torch.no_grad():
        logp_ref = _seq_logp(ref_model, ids, mask, num_prompts)
    rewards = torch.tensor([[1.0, 0.0, 0.25], [0.0, 1.0, 1.0]], dtype=torch.float64)
    got = _autograd_ascent(model, ids, mask, num_prompts, logp_ref, rewards, tau)
    _assert_close(got, _hand_eq3(model, ids, mask, num_prompts, logp_ref, rewards, tau))


@pytest.mark.parametrize(
    ("logp", "logp_ref", "rewards", "tau", "want_loss"),
    [
        # A = [0.5, -0.5]; loss = -mean(-1*0.5, -2*-0.5) = -0.25
        ([[-1.0, -2.0]], [[-1.0, -2.0]], [[1.0, 0.0]], 0.1, -0.25),
        # same rewards => zero advantage; loss = tau/2 * mean((logp-ref)^2) = 0.5/2 * mean(1, 4) = 0.625
        ([[-1.0, -2.0]], [[-2.0, 0.0]], [[1.0, 1.0]], 0.5, 0.625),
        # two prompts: A = [[1,-1],[0,0]]; policy term mean(-3*1, -1*-1, 0, 0) = -0.5; reg 0
        ([[-3.0, -1.0], [-1.0, -1.0]], [[-3.0, -1.0], [-1.0, -1.0]], [[2.0, 0.0], [5.0, 5.0]], 1.0, 0.5),
    ],
)
def test_loss_value_table(logp, logp_ref, rewards, tau, want_loss):
    loss, stats = k15_policy_loss_with_stats(torch.tensor(logp), torch.tensor(logp_ref), torch.tensor(rewards), tau)
    assert float(loss) == pytest.approx(want_loss, abs=1e-6)
    assert stats.loss == pytest.approx(want_loss, abs=1e-6)
    assert stats.num_prompts == len(logp)
    assert stats.mean_reward == pytest.approx(float(torch.tensor(rewards).mean()))


def test_stats_diagnostics():
    logp = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    _, stats = k15_policy_loss_with_stats(logp, torch.tensor([[-2.0, -2.0]]), torch.tensor([[1.0, 0.0]]), 0.2)
    assert stats.mean_abs_advantage == pytest.approx(0.5)
    assert stats.mean_log_ratio == pytest.approx(0.0)
    assert stats.mean_half_sq_log_ratio == pytest.approx(0.5)


def test_no_gradient_flows_into_reference_or_rewards():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    logp_ref = torch.tensor([[-1.5, -1.0]], requires_grad=True)
    rewards = torch.tensor([[1.0, 0.0]], requires_grad=True)
    k15_policy_loss(logp, logp_ref, rewards, 0.5).backward()
    assert logp_ref.grad is None and rewards.grad is None
    # d(-L)/dlogp_j = (A_j - tau*(logp_j - ref_j)) / 2
    want = torch.tensor([[(0.5 - 0.5 * 0.5) / 2, (-0.5 - 0.5 * -1.0) / 2]])
    torch.testing.assert_close(-logp.grad, want)


def test_group_advantages_table():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize(
    ("shapes", "tau", "match"),
    [
        (((2, 3), (2, 3), (2, 3)), 0.0, "tau"),
        (((2, 3), (2, 3), (2, 3)), -1.0, "tau"),
        (((2, 3), (3, 2), (2, 3)), 0.1, "logp_ref"),
        (((2, 3), (2, 3), (2, 2)), 0.1, "rewards"),
        (((6,), (6,), (6,)), 0.1, "num_prompts"),
        (((0, 3), (0, 3), (0, 3)), 0.1, "non-empty"),
    ],
)
def test_loss_rejects_bad_inputs(shapes, tau, match):
    logp, ref, rew = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        k15_policy_loss(logp, ref, rew, tau)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tau": 0.0}, "tau"),
        ({"tau": -0.5}, "tau"),
        ({"num_responses_per_prompt": 1}, "num_responses_per_prompt"),
        ({"num_responses_per_prompt": 2.0}, "num_responses_per_prompt"),
    ],
)
def test_loss_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


def test_loss_config_defaults_valid():
    cfg = LossConfig(tau=0.05, num_responses_per_prompt=4)
    assert cfg.tau == 0.05 and cfg.num_responses_per_prompt == 4


def test_sequence_logprobs_matches_loop():
    torch.manual_seed(3)
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    targets = torch.randint(0, 5, (2, 4))
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    want = torch.zeros(2, dtype=torch.float64)
    for b in range(2):
        for t in range(4):
            want[b] += mask[b, t] * torch.log_softmax(logits[b, t], -1)[targets[b, t]]
    torch.testing.assert_close(sequence_logprobs(logits, targets, mask), want)
    with pytest.raises(ValueError, match="loss_mask"):
        sequence_logprobs(logits, targets, mask[:, :2])
