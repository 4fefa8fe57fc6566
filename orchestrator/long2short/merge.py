"""long2short ``merge``: ``alpha * long + (1 - alpha) * short``, tensor by tensor, into a new HF model dir.

Also where every long2short command records what made a model directory (``INFO_FILE``).
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

WEIGHT_FILE_SUFFIXES = (".safetensors",)
WEIGHT_INDEX_FILE = "model.safetensors.index.json"
INFO_FILE = "long2short.json"  # what made a model directory (written next to its weights)
DEFAULT_ALPHA = 0.5  # merge: weight of the long-CoT model


def merge_state_dicts(long: Mapping[str, Any], short: Mapping[str, Any], alpha: float) -> dict[str, Any]:
    """``alpha * long + (1 - alpha) * short`` per tensor, computed in float32 and cast back (dtype kept).

    Names, shapes and dtypes must match (ValueError naming the first few that do not). Non-float tensors
    must be equal and are copied.
    """
    import torch

    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} must be in [0, 1]")
    only_long, only_short = sorted(set(long) - set(short)), sorted(set(short) - set(long))
    if only_long or only_short:
        raise ValueError(f"tensor names differ: only in long {only_long[:5]}, only in short {only_short[:5]}")
    bad_shape = [n for n in sorted(long) if tuple(long[n].shape) != tuple(short[n].shape)]
    if bad_shape:
        n = bad_shape[0]
        raise ValueError(
            f"tensor shapes differ for {bad_shape[:5]} ({len(bad_shape)} in all), "
            f"e.g. {n}: {tuple(long[n].shape)} vs {tuple(short[n].shape)}"
        )
    bad_dtype = [n for n in sorted(long) if long[n].dtype != short[n].dtype]
    if bad_dtype:
        n = bad_dtype[0]
        raise ValueError(f"tensor dtypes differ for {bad_dtype[:5]}, e.g. {n}: {long[n].dtype} vs {short[n].dtype}")
    out = {}
    for name, a in long.items():
        b = short[name]
        if not a.dtype.is_floating_point:
            if not torch.equal(a, b):
                raise ValueError(f"non-float tensor {name} ({a.dtype}) differs between the models")
            out[name] = a.clone()
            continue
        mixed = alpha * a.detach().to(torch.float32) + (1.0 - alpha) * b.detach().to(torch.float32)
        out[name] = mixed.to(a.dtype)
    return out


def merge_model_dirs(
    long_dir: str | pathlib.Path,
    short_dir: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    alpha: float = DEFAULT_ALPHA,
) -> pathlib.Path:
    """Weight-average two HF model directories into ``out_dir`` (config and tokenizer from ``short_dir``)."""
    from ckpt_common.hf_dir import read_tensors, write_safetensors

    merged = merge_state_dicts(read_tensors(long_dir), read_tensors(short_dir), alpha)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in pathlib.Path(short_dir).iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_FILE_SUFFIXES) and path.name != WEIGHT_INDEX_FILE:
            shutil.copy2(path, out / path.name)
    write_safetensors(out, merged)
    write_info(out, {"method": "merge", "long": str(long_dir), "short": str(short_dir), "alpha": alpha})
    return out


def write_info(model_dir: pathlib.Path, info: dict) -> None:
    (model_dir / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
