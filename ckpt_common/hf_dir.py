"""Weights of a Hugging Face model directory: list, read and write its safetensors files.

    model_dir/ model.safetensors                                   (one file)
             | model-0000i-of-0000n.safetensors + model.safetensors.index.json   (sharded)

    safetensors_files(dir)    ──▶ [paths]          index order when sharded
    read_tensors(dir, names)  ──▶ {name: tensor}   every tensor, or the named ones
    tensor_dtypes(dir)        ──▶ {name: dtype}    from the headers, nothing read
    write_safetensors(dir, state_dict, max_shard_size_bytes) ──▶ [paths written]

The one place for this I/O (the launcher, the tiny model, the trainers and the benchmarks use it).
`safetensors` is imported on first use.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Mapping

import torch

from ckpt_common.dtypes import torch_dtype_from_safetensors

DEFAULT_MAX_SHARD_SIZE_BYTES = 256 * 1024**2
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def safetensors_files(model_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """The model directory's safetensors files: the index's order when sharded, else
    ``model.safetensors``, else every ``*.safetensors`` sorted by name."""
    directory = pathlib.Path(model_dir)
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in dict.fromkeys(weight_map.values())]
    single = directory / SINGLE_FILE
    if single.exists():
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} holds no .safetensors file")
    return files


def read_tensors(model_dir: str | pathlib.Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of the directory's safetensors files: all of them, or those in `names` (ValueError
    names any that no file holds)."""
    from safetensors import safe_open

    wanted = None if names is None else set(names)
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if wanted is None or name in wanted:
                    out[name] = f.get_tensor(name)
    missing = sorted(wanted - set(out)) if wanted is not None else []
    if missing:
        raise ValueError(f"model directory {str(model_dir)!r} lacks tensors {missing[:5]} ({len(missing)} missing)")
    return out


def tensor_dtypes(model_dir: str | pathlib.Path) -> dict[str, torch.dtype]:
    """Each tensor's dtype as stored (read from the headers; ValueError for a dtype we do not know)."""
    from safetensors import safe_open

    out: dict[str, torch.dtype] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                out[name] = torch_dtype_from_safetensors(f.get_slice(name).get_dtype())
    return out


def plan_shards(sizes_bytes: Mapping[str, int], max_shard_size_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most ``max_shard_size_bytes`` each.

    A single tensor larger than the limit gets a shard of its own.
    """
    if max_shard_size_bytes < 1:
        raise ValueError(f"max_shard_size_bytes={max_shard_size_bytes!r} must be positive")
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes_bytes.items():
        if shards[-1] and used + size > max_shard_size_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_safetensors(
    out_dir: str | pathlib.Path,
    state_dict: Mapping[str, torch.Tensor],
    *,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
) -> list[pathlib.Path]:
    """Write ``model.safetensors``, or shards plus ``model.safetensors.index.json`` when larger.

    Removes weight files a previous write left in ``out_dir``. Returns the files written.
    """
    from safetensors.torch import save_file

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + list(out.glob(INDEX_FILE)):
        stale.unlink()
    shards = plan_shards({k: v.numel() * v.element_size() for k, v in state_dict.items()}, max_shard_size_bytes)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(_contiguous(state_dict, shards[0]), str(out / SINGLE_FILE), metadata=metadata)
        return [out / SINGLE_FILE]
    weight_map, files = {}, []
    for index, names in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(_contiguous(state_dict, names), str(out / file_name), metadata=metadata)
        weight_map.update(dict.fromkeys(names, file_name))
        files.append(out / file_name)
    total = sum(v.numel() * v.element_size() for v in state_dict.values())
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return files


def _contiguous(state_dict: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    return {name: state_dict[name].detach().contiguous() for name in names}
