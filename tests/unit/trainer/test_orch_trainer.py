"""Unit tests for the HF trainer (tiny 2-layer model, CPU, seconds)."""

import json
import pathlib

import pytest
import torch

from demo import task
from demo import tiny_model as tm
from tests.unit.trainer.tiny import SMALL, one_layer_bf16
from trainer import sft
from trainer.base import Trainer, TrainerConfig, pad_sequences
from trainer.hf import HFTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.make_tiny_model(tmp_path_factory.mktemp("trainer"), SMALL, seed=1)


@pytest.fixture
def trainer(model_dir):
    return HFTrainer(model_dir, TrainerConfig(lr=3e-3, num_threads=1))


@pytest.mark.parametrize(
    "field, value",
    [
        ("lr", 0.0),
        ("grad_clip", -1.0),
        ("weight_decay", -0.1),
        ("beta2", 1.0),
        ("num_threads", 0),
        ("autocast_dtype", "float16"),
    ],
)
def test_config_rejects_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainerConfig(**{field: value})


@pytest.mark.parametrize(
    "prompts, responses, masks, ids, loss_mask",
    [
        ([[1, 5]], [[6, 7]], None, [[1, 5, 6, 7]], [[0, 1, 1]]),
        ([[1], [1, 5, 5]], [[6], [7, 8]], None, [[1, 6, 0, 0, 0], [1, 5, 5, 7, 8]], [[1, 0, 0, 0], [0, 0, 1, 1]]),
        ([[1, 5]], [[6, 7, 8]], [[1, 0, 1]], [[1, 5, 6, 7, 8]], [[0, 1, 0, 1]]),
        ([[1, 5]], [[]], None, [[1, 5]], [[0]]),
    ],
)
def test_pad_sequences(prompts, responses, masks, ids, loss_mask):
    got_ids, attention, got_mask = pad_sequences(prompts, responses, masks, pad_id=0)
    assert got_ids.tolist() == ids
    assert got_mask.tolist() == loss_mask
    assert attention.sum(1).tolist() == [len(p) + len(r) for p, r in zip(prompts, responses)]


@pytest.mark.parametrize(
    "prompts, responses, masks, match",
    [
        ([[1]], [[2], [3]], None, "responses"),
        ([[]], [[2]], None, "empty"),
        ([[1]], [[2, 3]], [[1]], "response_masks"),
        ([], [], None, "empty batch"),
    ],
)
def test_pad_sequences_rejects(prompts, responses, masks, match):
    with pytest.raises(ValueError, match=match):
        pad_sequences(prompts, responses, masks, pad_id=0)


def test_is_a_trainer(trainer):
    assert isinstance(trainer, Trainer)


def test_sequence_logprobs_matches_per_token_computation(trainer):
    prompts = [[tm.BOS_ID, 7, 8], [tm.BOS_ID, 9]]
    responses = [[10, 11, tm.EOS_ID], [12, 13, 14, 15, tm.EOS_ID]]
    masks = [[1, 1, 1], [1, 0, 1, 1, 0]]
    got = trainer.sequence_logprobs(prompts, responses, masks)
    assert got.shape == (2,) and got.requires_grad and got.dtype == torch.float32
    with torch.no_grad():
        for i, (prompt, response, mask) in enumerate(zip(prompts, responses, masks)):
            ids = torch.tensor([prompt + response])
            logp = torch.log_softmax(trainer.model(input_ids=ids).logits[0].float(), -1)
            expected = sum(logp[len(prompt) - 1 + t, tok].item() for t, (tok, m) in enumerate(zip(response, mask)) if m)
            assert got[i].item() == pytest.approx(expected, abs=1e-4)
    unmasked = trainer.sequence_logprobs(prompts, responses)
    assert unmasked[0].item() == pytest.approx(got[0].item(), abs=1e-5)
    assert unmasked[1].item() < got[1].item()


def test_reset_optimizer_empties_state(trainer):
    loss = -trainer.sequence_logprobs([[tm.BOS_ID, 7]], [[8, tm.EOS_ID]]).sum()
    stats = trainer.step(loss)
    assert stats["grad_norm"] > 0 and stats["lr"] == 3e-3
    assert len(trainer.optimizer.state) > 0
    trainer.set_lr(1e-4)
    trainer.reset_optimizer()
    assert len(trainer.optimizer.state) == 0
    assert all(group["lr"] == 1e-4 for group in trainer.optimizer.param_groups)
    assert all(p.grad is None for p in trainer.model.parameters())


def test_step_clips_and_changes_weights(trainer):
    before = trainer.named_tensors(copy=True)
    trainer.step(-trainer.sequence_logprobs([[tm.BOS_ID, 7]], [[8, 9]]).sum() * 1e6)
    after = trainer.named_tensors()
    delta = max((after[k] - before[k]).abs().max().item() for k in before)
    assert 0 < delta < 0.05  # one Adam step moves each weight by about lr, whatever the loss scale


def test_backward_accumulates_then_step_applies(trainer):
    batch = ([[tm.BOS_ID, 7]], [[8, 9]])
    trainer.backward(-trainer.sequence_logprobs(*batch).sum())
    first = trainer.model.lm_head.weight.grad.clone()
    trainer.backward(-trainer.sequence_logprobs(*batch).sum())
    assert torch.allclose(trainer.model.lm_head.weight.grad, 2 * first, atol=1e-6)
    trainer.step()
    with pytest.raises(ValueError, match="scalar"):
        trainer.backward(trainer.sequence_logprobs(*batch))


def test_named_tensors_round_trip_into_fresh_model(trainer, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer.step(-trainer.sequence_logprobs([[tm.BOS_ID, 7]], [[8, 9]]).sum())
    named = trainer.named_tensors(copy=True)
    assert set(named) == set(tm.load_state_dict_from_dir(model_dir))
    assert all(not t.requires_grad for t in named.values())
    fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([[tm.BOS_ID, 7, 8, 9, 10]])
    with torch.no_grad():
        assert not torch.allclose(fresh(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
        fresh.load_state_dict(named, strict=True)
        assert torch.equal(fresh(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
    saved = trainer.save(tmp_path / "saved")
    reloaded = tm.load_state_dict_from_dir(saved)
    assert all(torch.equal(reloaded[k], named[k]) for k in named)
    assert json.loads((saved / "config.json").read_text()) == json.loads((model_dir / "config.json").read_text())
    assert (saved / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_named_tensors_keep_bf16_dtypes(tmp_path):
    config = one_layer_bf16(tie_word_embeddings=True)
    directory = tm.make_tiny_model(tmp_path, config)
    trainer = HFTrainer(directory, TrainerConfig(num_threads=1))
    named = trainer.named_tensors()
    assert "lm_head.weight" not in named
    assert {t.dtype for t in named.values()} == {torch.bfloat16}
    assert next(trainer.model.parameters()).dtype == torch.float32
    on_disk = tm.load_state_dict_from_dir(directory)
    assert all(torch.equal(named[k], on_disk[k]) for k in on_disk)


def test_a_few_sft_steps_lower_the_loss(trainer):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trainer.source_dir)
    problems = task.training_problems(0, 16, [1])
    prompts, responses = sft.encode_examples(tokenizer, problems)
    assert all(r[-1] == tm.EOS_ID for r in responses)
    num_tokens = sum(len(r) for r in responses)
    losses = []
    for _ in range(12):
        loss = -trainer.sequence_logprobs(prompts, responses).sum() / num_tokens
        trainer.step(loss)
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


# --- SFT warm-up (trainer.sft) -------------------------------------------------------------

TOY_SFT = sft.SFTConfig(
    num_steps=3,
    batch_size=4,
    num_layers=1,
    hidden_size=64,
    warmup_steps=1,
    eval_levels=(1, 2),
    num_eval_problems_per_level=2,
    autocast_dtype="float32",
)


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_steps", 0),
        ("batch_size", -1),
        ("levels", ()),
        ("levels", (99,)),
        ("level_weights", (1.0,)),
        ("lr", 0.0),
        ("min_lr_ratio", 2.0),
        ("autocast_dtype", "int8"),
        ("eval_levels", (0,)),
    ],
)
def test_sft_config_rejects_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        sft.SFTConfig(**{field: value})


@pytest.mark.parametrize("step, expected", [(0, 0.25e-3), (3, 1e-3), (4, 1e-3), (14, 0.1e-3), (99, 0.1e-3)])
def test_lr_schedule(step, expected):
    config = sft.SFTConfig(lr=1e-3, warmup_steps=4, num_steps=15, min_lr_ratio=0.1, level_weights=None)
    assert sft.lr_at(step, config) == pytest.approx(expected)


def test_cache_key_ignores_eval_settings_only():
    base = sft.SFTConfig()
    assert base.cache_key() == sft.SFTConfig(eval_levels=(1,), heldout_seed=3).cache_key()
    # threads and dtype change reduction order, and so the trained weights
    assert sft.SFTConfig(num_threads=1).cache_key() != sft.SFTConfig(num_threads=2).cache_key()
    assert sft.SFTConfig(autocast_dtype="float32").cache_key() != sft.SFTConfig(autocast_dtype="bfloat16").cache_key()
    assert base.cache_key() != sft.SFTConfig(num_steps=601).cache_key()


def test_batches_hold_one_level_each():
    config = sft.SFTConfig(batch_size=8)
    batches = sft.iter_batches(config)
    levels = [{p.level for p in next(batches)} for _ in range(40)]
    assert all(len(s) == 1 for s in levels)
    assert {next(iter(s)) for s in levels} == set(config.levels)
    assert not any(task.is_heldout(p) for _ in range(5) for p in next(batches))


def test_run_sft_writes_a_model_and_then_hits_the_cache(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model_dir = sft.run_sft(TOY_SFT, tmp_path)
    assert model_dir == tmp_path / f"sft-{TOY_SFT.resolved().cache_key()}" / "model"
    records = [json.loads(line) for line in (model_dir.parent / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and all(r["loss"] > 0 for r in records)
    assert (model_dir.parent / "loss.png").stat().st_size > 0
    summary = sft.sft_summary(model_dir)
    assert set(summary["heldout_accuracy_by_level"]) == {"1", "2"}
    assert summary["config"]["num_steps"] == 3
    AutoModelForCausalLM.from_pretrained(model_dir)
    entry = model_dir.parent.name
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry, f"{entry}.lock"]  # no temp dirs left

    def must_not_train(*args, **kwargs):
        raise AssertionError("cache miss")

    monkeypatch.setattr(sft, "_train", must_not_train)
    assert sft.run_sft(TOY_SFT, tmp_path) == model_dir


def test_concurrent_run_sft_trains_once_and_waits_under_a_deadline(tmp_path, monkeypatch):
    import threading

    real_train, calls = sft._train, []
    training, go = threading.Event(), threading.Event()

    def gated_train(*args, **kwargs):
        calls.append(1)
        training.set()
        assert go.wait(60)
        return real_train(*args, **kwargs)

    monkeypatch.setattr(sft, "_train", gated_train)
    results: dict[str, pathlib.Path] = {}
    first = threading.Thread(target=lambda: results.update(first=sft.run_sft(TOY_SFT, tmp_path)))
    first.start()
    assert training.wait(60)
    with pytest.raises(TimeoutError, match=r"\.lock is still held after 0 s: another process is training this SFT"):
        sft.run_sft(TOY_SFT, tmp_path, wait_s=0.2)
    second = threading.Thread(target=lambda: results.update(second=sft.run_sft(TOY_SFT, tmp_path, wait_s=60)))
    second.start()
    second.join(1.5)
    assert second.is_alive()  # waiting for the first trainer, not training its own copy
    go.set()
    first.join(120)
    second.join(60)
    assert results["first"] == results["second"] and (results["first"].parent / sft.DONE_FILE).exists()
    assert len(calls) == 1


def test_sft_help_is_instant():
    import subprocess
    import sys
    import time

    root = pathlib.Path(__file__).resolve().parents[3]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.sft", "--help"], capture_output=True, text=True, timeout=60, cwd=root
    )
    assert proc.returncode == 0 and "--num-steps" in proc.stdout
    assert time.monotonic() - start < 10
    probe = "import sys, trainer.sft; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
