"""``MegatronTrainer``: the orchestrator's ``Trainer`` protocol on a megatron-core GPTModel.

::

    SFT HF model dir ──load_state_dict_from_dir──▶ convert.hf_to_megatron (this rank) ──▶ GPTModel
        (model.build_gpt_model: local spec + CPU redirects on CPU, TE spec on GPU where installed)
    sequence_logprobs / token_logprobs ── GPTModel forward (causal mask, right padding) ──▶ [batch]
    backward / step ── torch AdamW (or SGD) over the GPTModel's parameters, clip, zero grad
    reset_optimizer / set_lr ── as HFTrainer (k1.5 resets the optimizer every iteration)
    named_tensors() ── every TP rank: convert.write_rank_slices(its shard) ──▶ ONE shared HF-layout
                       buffer (memfd made by TP rank 0, mapped by the others), barrier ──▶ TP rank 0:
                       {HF name: view}; the ParameterServer adopts them (no copy, no gather)
    save(dir) / load_hf_weights(state) ── HF layout on disk, like HFTrainer (resume works unchanged)

Runs in the caller's process at TP=1 (a gloo world of one on CPU, made by ``model.init_parallel``
unless a process group already exists). The optimizer is plain torch (not megatron's distributed
optimizer): at TP=1 every parameter is whole, so clipping and AdamW equal HFTrainer's.
TP > 1 needs the ranks of a torchrun job (see the package docstring and docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Mapping, Sequence

import torch

from ckpt_common.layout.pieces import hf_sources
from ckpt_common.layout.shapes import ModelShape, hf_param_shapes
from trainer.base import OptimizerSteps, TrainerConfig, disk_dtypes, make_optimizer, pad_sequences, save_hf_dir
from trainer.cpu import num_threads_for, resolve_autocast_dtype
from trainer.loss import sequence_logprobs as _masked_sequence_logprobs
from trainer.loss import token_logprobs as _masked_token_logprobs
from trainer.megatron.convert import write_rank_slices
from trainer.megatron.model import MegatronModelConfig

logger = logging.getLogger(__name__)


class MegatronTrainer(OptimizerSteps):
    """Trains a megatron-core GPTModel initialized from a HF (Qwen2) model directory."""

    def __init__(
        self,
        model_dir: str | pathlib.Path,
        config: TrainerConfig | None = None,
        megatron: MegatronModelConfig | None = None,
    ) -> None:
        import torch.distributed as dist

        from demo.tiny_model import load_state_dict_from_dir
        from trainer.megatron import model as mg_model

        self.config = TrainerConfig() if config is None else config
        self.megatron = MegatronModelConfig() if megatron is None else megatron
        if self.megatron.tp_size * self.megatron.pp_size != 1 and not dist.is_initialized():
            raise ValueError(
                f"tp_size={self.megatron.tp_size}, pp_size={self.megatron.pp_size}: model "
                "parallelism needs the ranks of a torchrun job; in-process the trainer runs at TP=1"
            )
        if self.megatron.pp_size != 1:
            raise NotImplementedError("MegatronTrainer trains without pipeline parallelism (pp_size=1)")
        self.source_dir = pathlib.Path(model_dir)
        self.num_threads = num_threads_for(self.config.num_threads)
        torch.set_num_threads(self.num_threads)
        if self.config.autocast_dtype == "bfloat16":
            raise ValueError(
                "autocast_dtype='bfloat16': megatron-core's linear layers are custom autograd "
                "functions that CPU autocast does not cast (float32 and bfloat16 meet in one matmul); "
                "the Megatron trainer runs float32 ('auto' resolves to it)"
            )
        # "auto" -> float32: see above (a bf16 Megatron would set MegatronModelConfig.params_dtype instead)
        self.dtype_choice = resolve_autocast_dtype("float32")
        self._autocast_bf16 = False
        torch.manual_seed(self.config.seed)
        self.hf_config = json.loads((self.source_dir / "config.json").read_text())
        self.shape = ModelShape.from_hf_config(self.hf_config)
        self._owns_parallel = not dist.is_initialized()
        mg_model.init_parallel(self.megatron.tp_size, self.megatron.pp_size)
        state = load_state_dict_from_dir(self.source_dir)
        self._disk_dtypes = disk_dtypes(self.source_dir)
        self.model, self.norm_style = mg_model.build_gpt_model(self.hf_config, self.megatron)
        self.model.train()
        self.load_hf_weights(state)
        pad = self.hf_config.get("pad_token_id")
        self.pad_id = int(pad if pad is not None else 0)
        self._lr = self.config.lr
        self.optimizer = make_optimizer(self.model, self.config, self._lr)
        self._buffers: list = []  # TP rank 0: SharedTensorBuffers in HF layout (named_tensors), kept
        self._mapped: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}  # other TP ranks: their views

    # -- forward ----------------------------------------------------------------------------------
    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq, vocab] float32 logits; right padding needs no mask beyond the causal one."""
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        device = next(self.model.parameters()).device
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self._autocast_bf16):
            logits = self.model(ids.to(device), positions.to(device), None)
        return logits.float().cpu() if logits.device.type != "cpu" else logits.float()

    def sequence_logprobs(
        self,
        prompt_ids_list: Sequence[Sequence[int]],
        response_ids_list: Sequence[Sequence[int]],
        response_masks: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Sum of the response tokens' log-probs per sequence ([batch], float32, with grad)."""
        ids, _, loss_mask = pad_sequences(prompt_ids_list, response_ids_list, response_masks, self.pad_id)
        logits = self._logits(ids)
        return _masked_sequence_logprobs(logits[:, :-1], ids[:, 1:], loss_mask)

    def token_logprobs(
        self,
        prompt_ids_list: Sequence[Sequence[int]],
        response_ids_list: Sequence[Sequence[int]],
        response_masks: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """[batch, longest response] per-token log-probs, response-aligned, zero past each end (GRPO)."""
        ids, _, loss_mask = pad_sequences(prompt_ids_list, response_ids_list, response_masks, self.pad_id)
        per_token = _masked_token_logprobs(self._logits(ids)[:, :-1], ids[:, 1:], loss_mask)
        width = max(1, max(len(r) for r in response_ids_list))
        starts = torch.tensor([len(p) - 1 for p in prompt_ids_list]).unsqueeze(1)
        index = (starts + torch.arange(width).unsqueeze(0)).clamp(max=per_token.shape[1] - 1)
        inside = torch.arange(width).unsqueeze(0) < torch.tensor([len(r) for r in response_ids_list]).unsqueeze(1)
        return per_token.gather(1, index) * inside

    # -- optimization -----------------------------------------------------------------------------
    def _clip_grad_norm(self) -> torch.Tensor:
        """Clip by the whole model's gradient norm (torch's rule). At TP > 1 a rank holds slices of the
        split parameters and a copy of the replicated ones: their squares are summed over the TP group,
        each replicated parameter counted once; every rank then scales by the same coefficient."""
        if self.megatron.tp_size == 1:
            return super()._clip_grad_norm()
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

        grads = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        square = torch.zeros((), dtype=torch.float64)
        for param, grad in grads:
            if param_is_not_tensor_parallel_duplicate(param):
                square += grad.detach().double().pow(2).sum().cpu()
        dist.all_reduce(square, group=parallel_state.get_tensor_model_parallel_group())
        total = square.sqrt().float()
        coef = torch.clamp(self.config.grad_clip / (total + 1e-6), max=1.0)
        for _, grad in grads:
            grad.detach().mul_(coef.to(grad.device))
        return total

    def reset_optimizer(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer = make_optimizer(self.model, self.config, self._lr)

    def set_lr(self, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"lr={lr!r} must be > 0")
        self._lr = float(lr)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr

    # -- weights in HF layout ---------------------------------------------------------------------
    def megatron_state(self) -> dict[str, torch.Tensor]:
        from trainer.megatron.model import megatron_state

        return megatron_state(self.model)

    def _hf_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """The HF checkpoint this trainer hands out: names in HF order, the source dir's dtypes."""
        from ckpt_common.dtypes import dtype_name

        param_dtype = next(self.model.parameters()).dtype
        names = hf_sources(self.shape, self.megatron.parallelism, self.norm_style)
        return [
            (name, dtype_name(self._disk_dtypes.get(name, param_dtype)), dims)
            for name, dims in hf_param_shapes(self.shape).items()
            if name in names
        ]

    def _shared_hf_views(self, leader: bool, group) -> dict[str, torch.Tensor]:
        """The HF-layout views of the shared buffer this sync writes: TP rank 0 (the parameter
        server's process) picks a buffer no registered checkpoint holds, or makes one, and sends its
        (pid, fd, size) to the other TP ranks, which map it through /proc/<pid>/fd/<fd> (same host)."""
        import torch.distributed as dist

        from checkpoint_engine.host_memory import SharedTensorBuffer

        ref = None
        if leader:
            buffer = next((b for b in self._buffers if b.adopted_by is None), None)
            if buffer is None:  # all busy (registered, being served): one more
                buffer = SharedTensorBuffer(self._hf_specs(), tag="megatron-hf")
                self._buffers.append(buffer)
            ref = buffer.ref
            views = buffer.tensors
        if group is None:
            return views
        box = torch.tensor([ref.pid, ref.fd, ref.size_bytes] if leader else [0, 0, 0], dtype=torch.int64)
        dist.broadcast(box, src=dist.get_process_group_ranks(group)[0], group=group)
        if leader:
            return views
        key = tuple(int(v) for v in box)
        if key not in self._mapped:  # buffers live as long as the trainer: one mapping each
            from checkpoint_engine.buckets import layout_tensors
            from checkpoint_engine.transport import shm

            layout = layout_tensors(self._hf_specs())
            if layout.chunk_sizes_bytes[0] != key[2]:
                raise RuntimeError(
                    f"shared HF buffer has {key[2]} bytes, this rank's layout {layout.chunk_sizes_bytes}"
                )
            raw = shm.map_writable(shm.SegmentRef(*key))
            self._mapped[key] = SharedTensorBuffer.views(raw, layout)
        return self._mapped[key]

    def named_tensors(self, copy: bool = False) -> dict[str, torch.Tensor]:
        """The weights in HF layout under the source directory's names and dtypes, in shared memory.

        Every TP rank writes its own slices (``convert.write_rank_slices``: one copy, cast to the
        disk dtype on the way) into ONE shared HF-layout buffer made by TP rank 0; a barrier; TP rank
        0 returns views of it, which ``ParameterServer.register_checkpoint`` adopts without a copy
        (``checkpoint_engine.host_memory.SharedTensorBuffer``). No shard travels over gloo.
        Collective at TP > 1 (the other TP ranks return {}). The views are overwritten by the next
        call unless ``copy`` is set or a checkpoint registered them (then the next call writes
        another buffer)."""
        from trainer.megatron import model as mg_model

        group = None
        leader = True
        if self.megatron.tp_size > 1:
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
            leader = mg_model.this_rank()[1] == 0
        views = self._shared_hf_views(leader, group)
        with torch.no_grad():
            write_rank_slices(
                self.megatron_state(),
                views,
                self.shape,
                self.megatron.parallelism,
                mg_model.this_rank(),
                self.norm_style,
            )
        if group is not None:
            import torch.distributed as dist

            dist.barrier(group=group)
        if not leader:
            return {}
        return {name: t.clone() for name, t in views.items()} if copy else dict(views)

    @torch.no_grad()
    def load_hf_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy a HF state dict (e.g. a saved checkpoint) into the GPTModel (this rank's share)."""
        from trainer.megatron import model as mg_model

        param = next(self.model.parameters())
        state = {name: tensor.to(device=param.device, dtype=param.dtype) for name, tensor in state_dict.items()}
        mg_model.load_hf_weights(self.model, state, self.hf_config, self.megatron, self.norm_style)

    def save(self, out_dir: str | pathlib.Path) -> pathlib.Path:
        """A HF model directory (config and tokenizer from the source, the converted weights)."""
        return save_hf_dir(
            self.source_dir,
            out_dir,
            self.named_tensors(),
            self.config,
            extra={"backend": "megatron", "tp_size": self.megatron.tp_size},
        )

    def close(self) -> None:
        """Free the shared HF buffers (one a registered checkpoint holds: when it is unregistered) and
        tear down the process group if this trainer made it (tests build several trainers)."""
        for buffer in self._buffers:
            buffer.close()
        self._buffers = []
        self._mapped = {}
        if self._owns_parallel:
            from trainer.megatron import model as mg_model
            from trainer.megatron.cpu_compat import remove_cpu_redirects

            mg_model.close_parallel()
            remove_cpu_redirects()
            self._owns_parallel = False
