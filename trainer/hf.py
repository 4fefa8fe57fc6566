"""The Hugging Face backend: a transformers causal LM trained in one CPU process (torch, AdamW).

::

    model dir ──▶ HFTrainer ──sequence_logprobs(prompts, responses, masks)──▶ [batch] log p (grad)
                     │  ▲                                                        │
                     │  └──── step(loss) / backward(loss) + step() ◀── loss ─────┘
                     ├──▶ named_tensors()  {HF name: tensor}  ──▶ checkpoint engine register
                     └──▶ save(dir)        HF dir (config, tokenizer, safetensors) ──▶ vLLM

It implements ``trainer.base.Trainer``; ``trainer.factory.make_trainer("hf", ...)`` builds it.
Weights are trained in float32; ``named_tensors`` and ``save`` cast them back to the dtypes the
source directory stored.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import torch

from trainer.base import OptimizerSteps, TrainerConfig, disk_dtypes, make_optimizer, pad_sequences, save_hf_dir
from trainer.cpu import num_threads_for, resolve_autocast_dtype
from trainer.loss import sequence_logprobs as _masked_sequence_logprobs


class HFTrainer(OptimizerSteps):
    """Trains a ``transformers`` causal LM loaded from a model directory (float32 on CPU)."""

    def __init__(self, model_dir: str | pathlib.Path, config: TrainerConfig | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.config = TrainerConfig() if config is None else config
        self.source_dir = pathlib.Path(model_dir)
        self.num_threads = num_threads_for(self.config.num_threads)
        torch.set_num_threads(self.num_threads)
        self.dtype_choice = resolve_autocast_dtype(self.config.autocast_dtype)
        self._autocast_bf16 = self.dtype_choice.chosen == "bfloat16"
        torch.manual_seed(self.config.seed)
        self.model = AutoModelForCausalLM.from_pretrained(self.source_dir, dtype=torch.float32)
        self.model.train()
        self._disk_dtypes = disk_dtypes(self.source_dir)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        missing = sorted(set(self._disk_dtypes) - set(params))
        if missing:
            raise RuntimeError(f"model dir tensors {missing[:5]} are not parameters of the model")
        self._params = {name: params[name] for name in self._disk_dtypes}
        self.pad_id = int(self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0)
        self._lr = self.config.lr
        self.optimizer = self._new_optimizer()

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return make_optimizer(self.model, self.config, self._lr)

    def sequence_logprobs(
        self,
        prompt_ids_list: Sequence[Sequence[int]],
        response_ids_list: Sequence[Sequence[int]],
        response_masks: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Sum of the response tokens' log-probs per sequence ([batch], float32, with grad).

        Prompts must include any bos token; ``response_masks[i][t] = 0`` drops token t of
        response i from the sum (e.g. stale segments of a partial rollout).
        """
        ids, attention, loss_mask = pad_sequences(prompt_ids_list, response_ids_list, response_masks, self.pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self._autocast_bf16):
            logits = self.model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        return _masked_sequence_logprobs(logits[:, :-1], ids[:, 1:], loss_mask)

    def reset_optimizer(self) -> None:
        """A fresh AdamW (empty moment estimates); gradients are cleared."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer = self._new_optimizer()

    def set_lr(self, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"lr={lr!r} must be > 0")
        self._lr = float(lr)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr

    def named_tensors(self, copy: bool = False) -> dict[str, torch.Tensor]:
        """Detached weights under the source directory's names and dtypes.

        Tensors whose stored dtype is float32 share memory with the live parameters unless
        ``copy`` is set (they change on the next ``step``); others are fresh casts.
        """
        out = {}
        for name, param in self._params.items():
            tensor = param.detach().to(self._disk_dtypes[name])
            out[name] = tensor.clone() if copy and tensor.data_ptr() == param.data_ptr() else tensor
        return out

    @torch.no_grad()
    def load_hf_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a checkpoint's weights (names as HF saved them) into the model."""
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if unexpected or [m for m in missing if m not in ("lm_head.weight",)]:
            raise RuntimeError(
                f"checkpoint does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )

    def save(self, out_dir: str | pathlib.Path) -> pathlib.Path:
        """Write a HF model directory (config and tokenizer copied from the source, new weights)."""
        return save_hf_dir(self.source_dir, out_dir, self.named_tensors(), self.config)
