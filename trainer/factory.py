"""The one factory of training backends: ``make_trainer("hf" | "megatron", model_dir, config, tp_size=...)``.

``"hf"``: ``trainer.hf.HFTrainer`` (transformers, in this process); ``"megatron"``:
``trainer.megatron.trainer.MegatronTrainer`` (a megatron-core GPTModel whose ``named_tensors`` are
converted to HF layout for the weight sync), or at ``tp_size > 1`` ``trainer.megatron.tp.TPMegatronTrainer``
(this process is TP rank 0 and starts the other ranks). The backends are imported on demand, so
picking one never imports the other.
"""

from __future__ import annotations

import pathlib
from typing import Literal

from trainer.base import Trainer, TrainerConfig

TrainerBackend = Literal["hf", "megatron"]


def make_trainer(
    backend: TrainerBackend, model_dir: str | pathlib.Path, config: TrainerConfig | None = None, *, tp_size: int = 1
) -> Trainer:
    """The one factory of training backends: ``"hf"`` (transformers) or ``"megatron"`` (megatron-core)."""
    if backend == "hf":
        if tp_size != 1:
            raise ValueError(f"the hf trainer has no tensor parallelism (tp_size={tp_size})")
        from trainer.hf import HFTrainer

        return HFTrainer(model_dir, config)
    if backend == "megatron":
        from trainer.megatron.model import MegatronModelConfig
        from trainer.megatron.trainer import MegatronTrainer

        if tp_size > 1:  # this process is TP rank 0; it starts the other ranks (trainer.megatron.tp)
            from trainer.megatron.tp import TPMegatronTrainer

            return TPMegatronTrainer(model_dir, config, tp_size=tp_size)
        return MegatronTrainer(model_dir, config, MegatronModelConfig(tp_size=tp_size))
    raise ValueError(f"trainer backend {backend!r} must be 'hf' or 'megatron'")
