"""A tiny Qwen2-style model the project builds itself (nothing is downloaded).

Used by tests, benchmarks and demos: a char-level tokenizer with a fixed vocabulary
and a Hugging Face model directory with random weights, deterministic from a seed.

    TinyModelConfig ──▶ random_state_dict(config, seed) ──▶ {HF name: tensor}
          │                                                      │
          └──────────────▶ make_tiny_model(out_dir) ◀────────────┘
                              config.json, generation_config.json,
                              tokenizer.json (+ config, special tokens map),
                              model.safetensors | model-0000i-of-0000n.safetensors + index

The directory loads with ``transformers`` (``AutoModelForCausalLM``/``AutoTokenizer``)
and with vLLM (``LLM(model=dir)``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import string
import typing
from typing import Literal

import torch

from ckpt_common.dtypes import dtype_from_name
from ckpt_common.hf_dir import DEFAULT_MAX_SHARD_SIZE_BYTES, read_tensors, write_safetensors
from ckpt_common.validate import check_int

logger = logging.getLogger(__name__)

DType = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = typing.get_args(DType)

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
VOCAB_SIZE = 128
# Every printable ASCII character (space included), plus newline and tab.
CHARACTERS: tuple[str, ...] = ("\n", "\t") + tuple(c for c in string.printable if c not in "\n\t\r\x0b\x0c")
_HIDDEN_SIZE_LADDER = (256, 512, 1024, 2048, 4096)
_HEAD_DIM = 64


def vocabulary() -> list[str]:
    """The fixed token list: specials, characters, then reserved fillers up to VOCAB_SIZE."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    assert len(tokens) <= VOCAB_SIZE and len(set(tokens)) == len(tokens)
    tokens += [f"<reserved_{i}>" for i in range(VOCAB_SIZE - len(tokens))]
    return tokens


def token_id(token: str) -> int:
    """Id of one vocabulary entry (a special token or a single character)."""
    try:
        return vocabulary().index(token)
    except ValueError:
        raise ValueError(f"token={token!r} is not in the tiny vocabulary") from None


PAD_ID = token_id(PAD_TOKEN)
BOS_ID = token_id(BOS_TOKEN)
EOS_ID = token_id(EOS_TOKEN)


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    """Shape of a Qwen2ForCausalLM with the tiny char vocabulary."""

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 1024
    max_position_embeddings: int = 512
    dtype: DType = "float32"
    tie_word_embeddings: bool = False
    seed: int = 0
    init_std: float = 0.02
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            check_int(name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        if not (self.init_std > 0 and math.isfinite(self.init_std)):
            raise ValueError(f"init_std={self.init_std!r} must be a positive finite float")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r} must be positive")

    @classmethod
    def tiny(cls, **overrides) -> TinyModelConfig:
        """The RL policy: 4 layers, 256 wide, 4 heads of 64, 2 KV heads (4.0M params)."""
        return cls(**overrides)

    @classmethod
    def for_size_bytes(cls, size_bytes: int, dtype: DType = "bfloat16", **overrides) -> TinyModelConfig:
        """A config whose safetensors payload is about ``size_bytes`` (within a few %).

        Keeps the vocabulary tiny; picks the widest hidden size that still allows 8 layers,
        then the layer count, then fits the MLP width to the remaining budget.
        """
        if size_bytes < 1:
            raise ValueError(f"size_bytes={size_bytes!r} must be positive")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
        num_params = size_bytes // dtype_from_name(dtype).itemsize
        hidden = _HIDDEN_SIZE_LADDER[0]
        for candidate in _HIDDEN_SIZE_LADDER:
            if 8 * _layer_params(candidate, 4 * candidate) <= num_params:
                hidden = candidate
        fixed = 2 * VOCAB_SIZE * hidden + hidden
        per_layer = _layer_params(hidden, 4 * hidden)
        num_layers = max(1, round((num_params - fixed) / per_layer))
        budget = (num_params - fixed) / num_layers - _layer_params(hidden, 0)
        intermediate = max(64, int(round(budget / (3 * hidden) / 64)) * 64)
        heads = hidden // _HEAD_DIM
        fields = dict(
            num_layers=num_layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4),
            intermediate_size=intermediate,
            dtype=dtype,
        )
        fields.update(overrides)
        return cls(**fields)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in param_shapes(self).values())

    def size_bytes(self) -> int:
        return self.num_params() * self.torch_dtype.itemsize

    def hf_config(self) -> dict:
        """The ``config.json`` contents for Qwen2ForCausalLM."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_layers,
            "layer_types": ["full_attention"] * self.num_layers,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "attention_dropout": 0.0,
            "initializer_range": self.init_std,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": True,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "torch_dtype": self.dtype,
            "dtype": self.dtype,
        }


def _layer_params(hidden: int, intermediate: int) -> int:
    heads = hidden // _HEAD_DIM
    kv_dim = max(1, heads // 4) * _HEAD_DIM
    attention = 2 * hidden * hidden + 2 * hidden * kv_dim + hidden + 2 * kv_dim
    return attention + 3 * hidden * intermediate + 2 * hidden


def param_shapes(config: TinyModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of the model, in the order HF lists them."""
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB_SIZE, h)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.q_proj.bias": (h,),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (VOCAB_SIZE, h)
    return shapes


def random_state_dict(config: TinyModelConfig, seed: int | None = None) -> dict[str, torch.Tensor]:
    """Random weights with HF names, in ``config.dtype``; deterministic from ``seed``.

    Matrices are N(0, init_std), biases zero, norm weights one. Each tensor has its own
    generator seeded from (seed, index), so the values do not depend on thread count.
    ``seed=None`` uses ``config.seed``.
    """
    base_seed = config.seed if seed is None else seed
    out: dict[str, torch.Tensor] = {}
    for index, (name, shape) in enumerate(param_shapes(config).items()):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=config.torch_dtype)
        elif name.endswith(".bias"):
            tensor = torch.zeros(shape, dtype=config.torch_dtype)
        else:
            gen = torch.Generator().manual_seed(base_seed * 1_000_003 + index)
            tensor = torch.empty(shape, dtype=torch.float32).normal_(0.0, config.init_std, generator=gen)
            tensor = tensor.to(config.torch_dtype)
        out[name] = tensor
    return out


def _byte_level_char(char: str) -> str:
    """The byte-level (GPT-2 style) symbol of one ASCII character: ' ' -> 'Ġ', '\\n' -> 'Ċ'."""
    code = ord(char)
    assert code < 128, char
    return char if 33 <= code <= 126 else chr(256 + code)


# Qwen2's split regex: transformers rebuilds every model_type="qwen2" tokenizer as a
# byte-level BPE with this pre-tokenizer, whatever tokenizer.json says. Our tokenizer.json
# uses the same pipeline (BPE without merges = one token per character), so transformers,
# vLLM and the raw `tokenizers` file all agree.
_QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer():
    """The char-level ``tokenizers.Tokenizer`` (prepends ``<bos>`` when special tokens are added).

    A byte-level BPE with no merges over the fixed vocabulary: every ASCII character is one
    token; characters outside the vocabulary (non-ASCII) are dropped. The reserved filler
    tokens are special, so ``decode(..., skip_special_tokens=True)`` drops them.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {}
    for index, token in enumerate(vocabulary()):
        is_char = token in CHARACTERS
        vocab[_byte_level_char(token) if is_char else token] = index
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    specials = [t for t in vocabulary() if t not in CHARACTERS]  # reserved fillers included
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def save_tokenizer(out_dir: str | pathlib.Path, max_length: int = 512) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN}
    tok_config = dict(
        specials,
        tokenizer_class="Qwen2Tokenizer",
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
        add_bos_token=True,
        add_eos_token=False,
        padding_side="left",
    )
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_json(out / "special_tokens_map.json", specials)


def write_model_dir(
    out_dir: str | pathlib.Path,
    config: TinyModelConfig,
    state_dict: dict[str, torch.Tensor],
    *,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
) -> pathlib.Path:
    """Write config, generation config, tokenizer and (sharded) safetensors for ``state_dict``."""
    out = write_model_files(out_dir, config)
    write_safetensors(out, state_dict, max_shard_size_bytes=max_shard_size_bytes)
    return out


def write_model_files(out_dir: str | pathlib.Path, config: TinyModelConfig) -> pathlib.Path:
    """Write config, generation config and tokenizer, no weights: what an engine started with dummy
    weights needs (its weights come from the checkpoint engine)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config.hf_config())
    _write_json(
        out / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    )
    save_tokenizer(out, max_length=config.max_position_embeddings)
    return out


def make_tiny_model(
    out_dir: str | pathlib.Path,
    config: TinyModelConfig | None = None,
    *,
    seed: int | None = None,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
) -> pathlib.Path:
    """Write a HF model directory with random weights (deterministic from ``seed``).

    ``seed=None`` uses ``config.seed`` (0 by default). Returns the directory path.
    """
    config = TinyModelConfig.tiny() if config is None else config
    state = random_state_dict(config, seed)
    out = write_model_dir(out_dir, config, state, max_shard_size_bytes=max_shard_size_bytes)
    logger.info(
        "wrote tiny model (%d params, %.1f MiB %s) to %s",
        config.num_params(),
        config.size_bytes() / 2**20,
        config.dtype,
        out,
    )
    return out


def _write_json(path: pathlib.Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def load_state_dict_from_dir(model_dir: str | pathlib.Path) -> dict[str, torch.Tensor]:
    """All tensors of a model directory's safetensors files (single or sharded)."""
    return read_tensors(model_dir)
