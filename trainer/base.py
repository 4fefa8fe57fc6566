"""What every training backend shares: the ``Trainer`` protocol the RL loop codes against,
``TrainerConfig``, the optimizer recipe and its steps (``OptimizerSteps``), the batch padding and
the HF-directory helpers (the source's dtypes, ``save_hf_dir``).

The backends build on this module: ``trainer.hf.HFTrainer`` (transformers, in this process) and
``trainer.megatron.trainer.MegatronTrainer`` (megatron-core); ``trainer.factory.make_trainer``
picks one. Weights are trained in float32; a backend's ``named_tensors`` and ``save`` cast them back
to the dtypes the source directory stored (``disk_dtypes``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import torch

from ckpt_common.validate import check_literals

# Files of a model directory that are not weights; save() copies them from the source.
_NON_WEIGHT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "added_tokens.json",
)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Optimizer and runtime settings of a trainer."""

    lr: float = 1e-3
    optimizer: Literal["adamw", "sgd"] = "adamw"  # "sgd": plain SGD (the RL loop resets it anyway)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    num_threads: int | None = None  # None: every CPU of the process's affinity (capped at those anyway)
    seed: int = 0
    # "bfloat16" runs the forward under CPU autocast (fast only with native bf16: AVX512-BF16/AMX/ARM
    # BF16); "auto" picks it only where it is (trainer.cpu; the SFT and RL jobs default to it).
    # Weights, optimizer state and returned log-probs stay float32.
    autocast_dtype: Literal["auto", "float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        check_literals(self)
        for name in ("lr", "grad_clip", "eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in [0, 1)")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads={self.num_threads!r} must be a positive int")


@runtime_checkable
class Trainer(Protocol):
    """What the RL loop needs from a training backend."""

    def sequence_logprobs(
        self,
        prompt_ids_list: Sequence[Sequence[int]],
        response_ids_list: Sequence[Sequence[int]],
        response_masks: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, loss: torch.Tensor | None = None) -> dict[str, float]: ...

    def reset_optimizer(self) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    def named_tensors(self, copy: bool = False) -> dict[str, torch.Tensor]: ...

    def release_device_memory(self) -> dict[str, float | int]: ...

    def reclaim_device_memory(self) -> dict[str, float | int]: ...

    def load_hf_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def save(self, out_dir: str | pathlib.Path) -> pathlib.Path: ...


def disk_dtypes(model_dir: str | pathlib.Path) -> dict[str, torch.dtype]:
    """{tensor name: dtype} as the model directory's safetensors store them."""
    from ckpt_common.hf_dir import tensor_dtypes

    return tensor_dtypes(model_dir)


def make_optimizer(model: torch.nn.Module, config: TrainerConfig, lr: float) -> torch.optim.Optimizer:
    """AdamW (or SGD) with weight decay on matrices only: the one optimizer recipe of every backend."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr, betas=(config.beta1, config.beta2), eps=config.eps)


def save_hf_dir(
    source_dir: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    named_tensors: dict[str, torch.Tensor],
    config: TrainerConfig,
    extra: dict | None = None,
) -> pathlib.Path:
    """Write a HF model directory: non-weight files copied from ``source_dir``, ``named_tensors``."""
    from ckpt_common.hf_dir import write_safetensors

    source, out = pathlib.Path(source_dir), pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for file_name in _NON_WEIGHT_FILES:
        src = source / file_name
        if src.exists() and src.resolve() != (out / file_name).resolve():
            shutil.copyfile(src, out / file_name)
    write_safetensors(out, named_tensors)
    (out / "trainer_config.json").write_text(json.dumps({**dataclasses.asdict(config), **(extra or {})}, indent=2))
    return out


def pad_sequences(
    prompt_ids_list: Sequence[Sequence[int]],
    response_ids_list: Sequence[Sequence[int]],
    response_masks: Sequence[Sequence[int]] | None,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + response`` ids, attention mask, and the loss mask of targets.

    The loss mask is aligned with ``ids[:, 1:]`` (the next-token targets): 1 where the target is
    a response token that counts.
    """
    if len(prompt_ids_list) != len(response_ids_list):
        raise ValueError(f"{len(prompt_ids_list)} prompts but {len(response_ids_list)} responses")
    if response_masks is not None and len(response_masks) != len(response_ids_list):
        raise ValueError(f"{len(response_masks)} response_masks for {len(response_ids_list)} responses")
    if not prompt_ids_list:
        raise ValueError("empty batch")
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids_list, response_ids_list)]
    batch, seq = len(lengths), max(lengths)
    ids = torch.full((batch, seq), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, seq), dtype=torch.long)
    loss_mask = torch.zeros((batch, seq - 1), dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompt_ids_list, response_ids_list)):
        if not prompt:
            raise ValueError(f"prompt {i} is empty (it needs at least a bos token)")
        ids[i, : lengths[i]] = torch.tensor(list(prompt) + list(response), dtype=torch.long)
        attention[i, : lengths[i]] = 1
        mask = [1.0] * len(response) if response_masks is None else [float(m) for m in response_masks[i]]
        if len(mask) != len(response):
            raise ValueError(f"response_masks[{i}] has {len(mask)} entries for {len(response)} tokens")
        loss_mask[i, len(prompt) - 1 : lengths[i] - 1] = torch.tensor(mask)
    return ids, attention, loss_mask


class OptimizerSteps:
    """backward/step shared by every backend; a backend overrides ``_clip_grad_norm`` when its
    parameters are sharded (megatron at TP > 1). Needs ``model``, ``optimizer``, ``config``, ``_lr``."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of ``loss`` (for micro-batches); ``step()`` applies them."""
        if loss.dim() != 0:
            raise ValueError(f"loss must be a scalar, got shape {tuple(loss.shape)}")
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss.item()!r}")
        loss.backward()

    def step(self, loss: torch.Tensor | None = None) -> dict[str, float]:
        """Backward ``loss`` (if given), clip gradients, take an optimizer step, zero gradients."""
        if loss is not None:
            self.backward(loss)
        grad_norm = self._clip_grad_norm()
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise RuntimeError(f"non-finite gradient norm {grad_norm.item()!r}; step skipped")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "lr": self._lr}

    def _clip_grad_norm(self) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)

    def release_device_memory(self) -> dict[str, float | int]:
        """Colocated: the model, gradients and optimizer state to pinned host memory, the device's
        cache emptied, so the engines get the GPU (`trainer.offload`); {} on CPU."""
        return self._device_offload().release().record("trainer_release")

    def reclaim_device_memory(self) -> dict[str, float | int]:
        """Undo `release_device_memory` before the next training step; {} when nothing was released."""
        return self._device_offload().reclaim().record("trainer_reclaim")

    def _device_offload(self):
        from trainer.offload import DeviceOffload

        if getattr(self, "_offload", None) is None:
            self._offload = DeviceOffload(self.model, lambda: self.optimizer)
        return self._offload
