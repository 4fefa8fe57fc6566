"""SFT warm-up from a JSONL file (trainer.sft_file, sft.data_path): records checked line by line, the
loss mask on the response tokens only, a tiny fine-tune that lowers the response loss and writes a
loadable HF dir, the cache, and the job config's rule that it needs init_model_dir."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import pytest
import torch

from ckpt_common.records import ProblemFileError
from trainer import sft
from trainer import sft_file as sf

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PAIR = {"prompt": "2+3=", "response": "5"}
CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "7*6?"},
        {"role": "assistant", "content": "42"},
    ]
}


def _write(path: pathlib.Path, *records) -> pathlib.Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# -- reading and checking ---------------------------------------------------------------------------

# (name, lines, line of the first error, its field, text in it)
BAD_RECORDS = [
    ("bad json", ["{", PAIR], 1, None, "invalid JSON"),
    ("not an object", ["[1]"], 1, None, "expected a JSON object"),
    ("missing response", [PAIR, {"prompt": "x"}], 2, "response", "missing, expected a non-empty string"),
    ("missing all", [{}], 1, "prompt", 'missing: expected "prompt" and "response"'),
    ("response not a string", [{"prompt": "x", "response": 5}], 1, "response", "expected a non-empty string, got 5"),
    ("empty prompt", [{"prompt": " ", "response": "y"}], 1, "prompt", "expected a non-empty string"),
    ("unknown field", [{**PAIR, "answer": "5"}], 1, "answer", "unknown field(s) ['answer']"),
    ("both kinds", [{**CHAT, "prompt": "x"}], 1, "prompt", 'either "prompt" and "response", or "messages"'),
    ("field twice", ['{"prompt": "a", "prompt": "b", "response": "c"}'], 1, None, 'field "prompt" appears twice'),
    (
        "no final assistant turn",
        [{"messages": [{"role": "user", "content": "hi"}]}],
        1,
        "messages[0].role",
        'expected the last message to be from "assistant", got "user"',
    ),
    (
        "only the assistant",
        [{"messages": [{"role": "assistant", "content": "hi"}]}],
        1,
        "messages",
        "the conversation before the final assistant message",
    ),
    ("messages not a list", [{"messages": "hi"}], 1, "messages", "expected a non-empty list"),
    (
        "bad role",
        [{"messages": [{"role": "bot", "content": "a"}, {"role": "assistant", "content": "b"}]}],
        1,
        "messages[0].role",
        "expected one of",
    ),
    ("empty file", [], None, None, "no examples: the file is empty"),
    ("blank lines only", ["", "  "], None, None, "no examples: the file is empty"),
]


@pytest.mark.parametrize("lines, line, field, text", [c[1:] for c in BAD_RECORDS], ids=[c[0] for c in BAD_RECORDS])
def test_a_bad_sft_file_is_refused_naming_file_line_and_field(tmp_path, lines, line, field, text):
    path = _write(tmp_path / "sft.jsonl", *lines)
    with pytest.raises(ProblemFileError) as e:
        sf.read_sft_examples(path)
    assert (e.value.path, e.value.line, e.value.field) == (str(path), line, field)
    first = e.value.errors[0]
    assert first.startswith(f"{path}:{line}: " if line else f"{path}: ") and text in first, first


def test_every_bad_line_is_listed_and_a_missing_file_names_the_setting(tmp_path):
    path = _write(tmp_path / "sft.jsonl", PAIR, "{", {"prompt": "x"}, CHAT)
    with pytest.raises(ProblemFileError) as e:
        sf.read_sft_examples(path)
    assert e.value.num_errors == 2 and [i.line for i in e.value.issues] == [2, 3]
    with pytest.raises(ProblemFileError, match=r"nope.jsonl: no such file or folder: check sft.data_path"):
        sf.read_sft_examples(tmp_path / "nope.jsonl")


def test_records_of_both_kinds_are_read_in_file_order(tmp_path):
    examples = sf.read_sft_examples(_write(tmp_path / "sft.jsonl", PAIR, "", CHAT))
    assert examples == [
        sf.SFTExample("5", prompt="2+3=", line=1),
        sf.SFTExample("42", messages=tuple(CHAT["messages"][:2]), line=3),
    ]


# -- tokens -------------------------------------------------------------------------------------------


class CharTokenizer:
    """One id per character (ord), a BOS 1 unless told not to, eos 2; a chat template if given one."""

    eos_token_id = 2
    name_or_path = "char"

    def __init__(self, chat_template: str | None = "x") -> None:
        self.chat_template = chat_template

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


# (record, prompt text, BOS, response text)
ENCODE = [
    (PAIR, "2+3=", True, "5"),
    (CHAT, "<system>Be brief.<user>7*6?<assistant>", False, "42"),  # the template writes the specials
]


@pytest.mark.parametrize("record, prompt, bos, response", ENCODE)
def test_the_loss_mask_covers_exactly_the_response_and_eos(tmp_path, record, prompt, bos, response):
    (example,) = sf.read_sft_examples(_write(tmp_path / "sft.jsonl", record))
    encoded = sf.encode_example(example, CharTokenizer())
    prompt_ids, response_ids = [1] * bos + [ord(c) for c in prompt], [ord(c) for c in response] + [2]
    assert encoded.input_ids == prompt_ids + response_ids
    assert encoded.loss_mask == [0] * len(prompt_ids) + [1] * len(response_ids)
    assert [t for t, m in zip(encoded.input_ids, encoded.loss_mask) if m] == response_ids


@pytest.mark.parametrize(
    "style, prompt, bos",
    [
        (sf.PromptStyle(), "2+3=", True),  # as written
        (sf.PromptStyle("Q: {prompt}"), "Q: 2+3=", True),  # the job's data.prompt_template
        (sf.PromptStyle("Q: {prompt}", chat_template=True), "<user>Q: 2+3=<assistant>", False),  # one user turn
    ],
)
def test_a_prompt_record_is_rendered_as_the_job_renders_its_problems(tmp_path, style, prompt, bos):
    (example, chat) = sf.read_sft_examples(_write(tmp_path / "sft.jsonl", PAIR, CHAT))
    encoded = sf.encode_example(example, CharTokenizer(), style)
    assert encoded.prompt_ids == tuple([1] * bos + [ord(c) for c in prompt])
    # messages are the conversation as given, whatever the style
    assert sf.encode_example(chat, CharTokenizer(), style) == sf.encode_example(chat, CharTokenizer())


def test_a_chat_style_needs_the_models_chat_template(tmp_path):
    examples = sf.read_sft_examples(_write(tmp_path / "sft.jsonl", PAIR))
    with pytest.raises(ProblemFileError) as e:
        sf.check_encodable(
            examples, CharTokenizer(chat_template=None), 48, "sft.jsonl", sf.PromptStyle(chat_template=True)
        )
    assert e.value.errors == (
        (
            'sft.jsonl:1: field "prompt": data.chat_template=true renders prompts through the model\'s chat '
            "template, but its tokenizer (char) has none: set data.chat_template=false, or add one to its "
            "tokenizer_config.json"
        ),
    )


def test_examples_the_model_cannot_take_are_refused_by_line(tmp_path):
    examples = sf.read_sft_examples(_write(tmp_path / "sft.jsonl", PAIR, CHAT, {"prompt": "x" * 50, "response": "y"}))
    sf.check_encodable(examples[:2], CharTokenizer(), 48, "sft.jsonl")
    with pytest.raises(ProblemFileError) as e:
        sf.check_encodable(examples, CharTokenizer(chat_template=None), 48, "sft.jsonl")
    assert e.value.errors == (
        (
            'sft.jsonl:2: field "messages": the model\'s tokenizer (char) has no chat template to render them: give '
            '"prompt" and "response", or add one to its tokenizer_config.json'
        ),
        "sft.jsonl:3: 53 tokens, longer than the model's context (48)",
    )


def test_batches_are_seeded_passes_over_the_file():
    first = sf.iter_batches(5, 3, seed=0)
    drawn = [next(first) for _ in range(5)]  # 15 draws: three whole passes
    assert all(sorted(sum(drawn, [])[i : i + 5]) == list(range(5)) for i in (0, 5, 10))
    again = sf.iter_batches(5, 3, seed=0)
    assert [next(again) for _ in range(5)] == drawn
    other = sf.iter_batches(5, 3, seed=1)
    assert [next(other) for _ in range(5)] != drawn


# -- the cache key ------------------------------------------------------------------------------------


def test_the_demos_sft_key_is_unchanged_by_the_field():
    default = sft.SFTConfig()
    fields = {k: v for k, v in dataclasses.asdict(default).items() if k not in sft._NOT_IN_CACHE_KEY}
    del fields["solution_style"], fields["data_path"], fields["data_fields"], fields["data_split"]
    payload = json.dumps({"recipe": sft.SFT_RECIPE_VERSION, **fields}, sort_keys=True)
    assert default.cache_key() == hashlib.sha256(payload.encode()).hexdigest()[:16]
    assert sft.SFTConfig(data_path="sft.jsonl").cache_key() != default.cache_key()
    with pytest.raises(ValueError, match="data_path=''"):
        sft.SFTConfig(data_path="")
    with pytest.raises(ValueError, match="an SFT file fine-tunes your model"):
        sft.run_sft(sft.SFTConfig(data_path="sft.jsonl"), "unused")


def test_the_file_key_follows_data_model_and_hyperparameters():
    config = sft.SFTConfig(data_path="a.jsonl")
    key = sf.cache_key(config, "d", "m")
    assert key == sf.cache_key(dataclasses.replace(config, data_path="b.jsonl", levels=(1,), eval_levels=()), "d", "m")
    assert len({key, sf.cache_key(config, "d2", "m"), sf.cache_key(config, "d", "m2")}) == 3
    assert sf.cache_key(config, "d", "m", sf.PromptStyle()) == key  # the default style: as written
    chat, template = sf.PromptStyle(chat_template=True), sf.PromptStyle("Q: {prompt}")
    assert len({key, sf.cache_key(config, "d", "m", chat), sf.cache_key(config, "d", "m", template)}) == 3
    for name, value in [("lr", 1e-4), ("num_steps", 7), ("batch_size", 3), ("seed", 5), ("warmup_steps", 1)]:
        assert sf.cache_key(dataclasses.replace(config, **{name: value}), "d", "m") != key, name


def test_the_model_identity_changes_with_its_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    big = tmp_path / "model.safetensors"
    big.write_bytes(b"\0" * (sf._HASHED_WHOLE_BYTES + 1))
    first = sf.model_dir_identity(tmp_path)
    assert sf.model_dir_identity(tmp_path) == first
    (tmp_path / "config.json").write_text('{"a": 1}')
    second = sf.model_dir_identity(tmp_path)
    assert second != first
    big.write_bytes(b"\0" * (sf._HASHED_WHOLE_BYTES + 2))
    assert sf.model_dir_identity(tmp_path) != second


# -- a tiny fine-tune ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> pathlib.Path:
    """A random 1-layer Qwen2 (the demo's char tokenizer) with a chat template."""
    from demo.tiny_model import TinyModelConfig, make_tiny_model

    shape = TinyModelConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=128,
        init_std=0.1,
    )
    out = make_tiny_model(tmp_path_factory.mktemp("init") / "model", shape, seed=0)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": CHAT_TEMPLATE}))
    return out


def _response_loss(model_dir: pathlib.Path, examples) -> float:
    """Mean negative log-likelihood per response token (eos included) of a model dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            encoded = sf.encode_example(example, tokenizer)
            ids = torch.tensor([encoded.input_ids])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
            token_logprobs = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(encoded.loss_mask[1:], dtype=torch.bool)
            total -= token_logprobs[mask].sum().item()
            count += int(mask.sum())
    return total / count


def test_a_tiny_fine_tune_lowers_the_response_loss_writes_a_model_and_is_cached(tmp_path, tiny_model_dir, monkeypatch):
    torch.set_num_threads(1)
    data = _write(
        tmp_path / "sft.jsonl",
        {"prompt": "1+1=", "response": "2"},
        {"prompt": "2+2=", "response": "4"},
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    )
    config = sft.SFTConfig(data_path=str(data), num_steps=25, batch_size=4, lr=1e-2, warmup_steps=2)
    cache = tmp_path / "cache"
    model_dir = sf.run_file_sft(config, tiny_model_dir, cache)
    assert model_dir.parent.parent == cache and model_dir.parent.name.startswith("sft-file-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).exists(), name
    examples = sf.read_sft_examples(data)
    before, after = _response_loss(tiny_model_dir, examples), _response_loss(model_dir, examples)
    assert after < 0.5 * before, (before, after)
    summary = sft.sft_summary(model_dir)
    assert summary["num_examples"] == 4 and summary["last_loss"] < summary["first_loss"]
    assert summary["config"]["num_steps"] == 25 and summary["model_dir"] == str(model_dir)
    assert len((model_dir.parent / "metrics.jsonl").read_text().splitlines()) == 25
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(model_dir).chat_template == CHAT_TEMPLATE  # vLLM renders prompts alike
    assert not [p for p in cache.iterdir() if p.name.startswith(".sft-file-tmp-")]

    def no_training(*args, **kwargs):
        raise AssertionError("trained again instead of using the cache")

    monkeypatch.setattr(sf, "_train", no_training)
    assert sf.run_file_sft(config, tiny_model_dir, cache) == model_dir  # a cache hit
    with pytest.raises(AssertionError, match="trained again"):
        sf.run_file_sft(dataclasses.replace(config, lr=5e-3), tiny_model_dir, cache)  # another key
    with pytest.raises(ProblemFileError, match="invalid JSON"):  # checked before the cache is looked at
        sf.run_file_sft(
            dataclasses.replace(config, data_path=str(_write(tmp_path / "bad.jsonl", "{"))), tiny_model_dir, cache
        )


# -- the job config -----------------------------------------------------------------------------------


def test_the_job_needs_init_model_dir_for_an_sft_file_and_checks_the_file_first(tmp_path):
    from orchestrator.config import load_config
    from orchestrator.tasks.factory import check_data_files

    with pytest.raises(ValueError, match="sft.data_path is set but init_model_dir is not"):
        load_config(None, ["sft.data_path=sft.jsonl"])
    bad = _write(tmp_path / "sft.jsonl", PAIR, {"prompt": "x"})
    config = load_config(None, [f"sft.data_path={bad}", f"init_model_dir={tmp_path}"])
    with pytest.raises(ProblemFileError, match=r'sft.jsonl:2: field "response": missing'):
        check_data_files(config)
    check_data_files(load_config(None, [f"sft.data_path={_write(bad, PAIR)}", f"init_model_dir={tmp_path}"]))


def test_the_job_starts_rl_from_the_fine_tuned_model(tmp_path, monkeypatch):
    """RLJob._setup with sft.data_path: init_model_dir fine-tuned on the file first (run_file_sft, stubbed
    here) in the job's prompt style, and the trainers built from its output; without sft.data_path, from
    init_model_dir itself."""
    from orchestrator import loop
    from orchestrator.config import load_config

    class Built(Exception):
        pass

    entry = tmp_path / "cache" / "sft-file-x"
    (entry / "model").mkdir(parents=True)
    (entry / sft.DONE_FILE).write_text(json.dumps({"last_loss": 0.1}))
    calls = []

    def fake_sft(config, init_model_dir, cache_dir, style):
        calls.append((config.data_path, pathlib.Path(init_model_dir), cache_dir, style))
        return entry / "model"

    def fake_trainers(config, model_dir):
        raise Built(model_dir)

    monkeypatch.setattr(sf, "run_file_sft", fake_sft)
    monkeypatch.setattr(loop, "make_trainers", fake_trainers)
    data, init = _write(tmp_path / "sft.jsonl", PAIR), tmp_path / "init"
    common = [f"init_model_dir={init}", f"sft_cache_dir={tmp_path / 'cache'}", "data.num_train_problems=8"]
    job = loop.RLJob(load_config(None, [f"sft.data_path={data}", *common]), tmp_path / "run")
    with pytest.raises(Built) as e:
        job._setup()
    assert calls == [(str(data), init, str(tmp_path / "cache"), sf.PromptStyle())]  # the job's: as written
    assert e.value.args[0] == entry / "model" and job.sft_summary == {"last_loss": 0.1}
    job = loop.RLJob(load_config(None, common), tmp_path / "run2")
    with pytest.raises(Built) as e:
        job._setup()
    assert e.value.args[0] == init and len(calls) == 1
