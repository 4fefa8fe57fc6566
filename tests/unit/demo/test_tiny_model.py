"""Unit tests for the tiny model fixture (no vLLM)."""

import json
import random

import pytest
import torch

from ckpt_common import hf_dir
from demo import tiny_model as tm
from tests.unit.trainer.tiny import one_layer_bf16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.make_tiny_model(tmp_path_factory.mktemp("tiny"), tm.TinyModelConfig.tiny(), seed=3)


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_layers", 0),
        ("hidden_size", -1),
        ("num_attention_heads", 0),
        ("num_key_value_heads", 3),
        ("intermediate_size", 1.5),
        ("max_position_embeddings", 0),
        ("dtype", "int8"),
        ("init_std", 0.0),
        ("hidden_size", 250),
    ],
)
def test_config_rejects_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        tm.TinyModelConfig(**{field: value})


def test_tiny_preset_shape():
    config = tm.TinyModelConfig.tiny()
    assert (config.num_layers, config.hidden_size, config.head_dim) == (4, 256, 64)
    assert config.num_params() == 4_002_048


@pytest.mark.parametrize(
    "size_bytes, dtype",
    [
        (10 * 2**20, "bfloat16"),
        (100 * 2**20, "float32"),
        (2**29, "bfloat16"),
        (2**30, "float16"),
    ],
)
def test_for_size_bytes_is_close(size_bytes, dtype):
    config = tm.TinyModelConfig.for_size_bytes(size_bytes, dtype=dtype)
    assert config.dtype == dtype
    assert abs(config.size_bytes() / size_bytes - 1) < 0.03
    assert config.num_layers >= 4


def test_for_size_bytes_rejects_nonpositive():
    with pytest.raises(ValueError, match="size_bytes"):
        tm.TinyModelConfig.for_size_bytes(0)


@pytest.mark.parametrize(
    "sizes, limit, expected",
    [
        ({"a": 4, "b": 4, "c": 4}, 8, [["a", "b"], ["c"]]),
        ({"a": 10, "b": 1}, 8, [["a"], ["b"]]),
        ({"a": 1, "b": 10, "c": 1}, 8, [["a"], ["b"], ["c"]]),
        ({"a": 3, "b": 3}, 100, [["a", "b"]]),
    ],
)
def test_plan_shards(sizes, limit, expected):
    assert hf_dir.plan_shards(sizes, limit) == expected


@pytest.mark.parametrize("tie", [False, True])
def test_param_shapes_match_transformers(tie):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = tm.TinyModelConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        tie_word_embeddings=tie,
    )
    hf = Qwen2ForCausalLM(Qwen2Config(**config.hf_config()))
    expected = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    if tie:
        expected.pop("lm_head.weight")
    assert tm.param_shapes(config) == expected


def test_random_state_dict_is_deterministic():
    config = one_layer_bf16()  # hidden 64
    a, b, c = (tm.random_state_dict(config, seed) for seed in (1, 1, 2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert {t.dtype for t in a.values()} == {torch.bfloat16}
    assert torch.equal(a["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))


def test_model_dir_loads_in_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    names = {p.name for p in model_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "model.safetensors",
    } <= names
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    on_disk = tm.load_state_dict_from_dir(model_dir)
    expected = tm.random_state_dict(tm.TinyModelConfig.tiny(), seed=3)
    assert set(on_disk) == set(expected) == set(model.state_dict())
    assert all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)


def test_sharded_dir_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM

    config = tm.TinyModelConfig(
        num_layers=2, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256
    )
    out = tm.make_tiny_model(tmp_path, config, seed=5, max_shard_size_bytes=300_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = hf_dir.safetensors_files(out)
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == config.size_bytes()
    loaded = tm.load_state_dict_from_dir(out)
    expected = tm.random_state_dict(config, seed=5)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected) and set(loaded) == set(expected)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(model.state_dict()["lm_head.weight"], expected["lm_head.weight"])


def test_rewriting_a_dir_removes_stale_shards(tmp_path):
    config = tm.TinyModelConfig(
        num_layers=1, hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=64
    )
    tm.make_tiny_model(tmp_path, config, max_shard_size_bytes=20_000)
    tm.make_tiny_model(tmp_path, config)
    assert hf_dir.safetensors_files(tmp_path) == [tmp_path / "model.safetensors"]
    assert not list(tmp_path.glob("model-*"))


def test_tokenizer_is_char_level_everywhere(model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    raw = tm.build_tokenizer()
    rng = random.Random(0)
    texts = ["Q: 12+34=?\nA:  46\t", "it's 'll\n\n  x"] + [
        "".join(rng.choice(tm.CHARACTERS) for _ in range(40)) for _ in range(50)
    ]
    for text in texts:
        ids = hf(text)["input_ids"]
        assert ids == raw.encode(text).ids
        assert ids[0] == tm.BOS_ID and len(ids) == len(text) + 1
        assert ids[1:] == [tm.token_id(c) for c in text]
        assert hf.decode(ids, skip_special_tokens=True) == text
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (tm.EOS_ID, tm.PAD_ID, tm.BOS_ID)
    assert len(hf) == tm.VOCAB_SIZE
    assert hf.decode([tm.token_id("7"), 120, tm.EOS_ID], skip_special_tokens=True) == "7"


def test_token_id_rejects_unknown():
    with pytest.raises(ValueError, match="token"):
        tm.token_id("é")
