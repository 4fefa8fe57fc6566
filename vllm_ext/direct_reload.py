"""Direct in-place reload for vLLM's CPU backend (unquantized models, one tensor-parallel rank).

vLLM's own `reload_weights` (its "layerwise reload") does, for every layer: put the layer's tensors
back on the meta device, buffer every weight-loader call (running each loader once more on meta
tensors just to count elements), materialise fresh tensors, replay the loaders into them, run
`process_weights_after_loading` (on CPU: pack linear weights into oneDNN's layout and drop the
plain weight), then copy the results into the original tensors. The packing is the work that
matters; the rest is bookkeeping, allocation and copies. This module does the packing and skips
the rest:

    setup, once:  for each linear layer whose weight vLLM's CPU path dropped after packing, a
                  staging parameter in model format (vLLM's own parameter class and weight loader,
                  rebuilt from the metadata vLLM records for reloading), allocated once and kept
    per update:   staging parameters go back on their layers; `model.load_weights(iterator)` runs
                  vLLM's own name mapping and loaders (q/k/v -> qkv_proj, shards, biases), writing
                  straight into staging (linear weights) or the live tensors (norms, embeddings,
                  biases); a layer with a quant method is processed (packed) the moment all its
                  elements arrived; layers that arrived incompletely (a padded vocabulary, or an
                  update that ended early) after the iterator ends; untouched layers keep their
                  packed weights.

The staging tensors keep the last version loaded (host memory: the size of the model's linear
weights); because of that, a layer that an aborted update only partly wrote is packed with the
previous values for the parts it did not get.

Staging doubles as the receiver's weight cache: on the first update the reloader records, for each
checkpoint tensor whose loader is a plain copy into a slice of a staging weight (q_proj.weight ->
rows of qkv_proj's staging; o_proj.weight -> all of it), that slice (`cache_slots()`); the receiver
then keeps its checkpoint-format copy of that tensor in the slice itself. From then on a bucket's
tensor is copied once, straight into staging, and its loader call is skipped (the source already
is the destination): one copy and the packing per update, and no second host copy of the model.

Whether a model qualifies is decided by `plan_direct_reload`, a pure function of facts about the
platform and the model's modules (table-tested); `auto` in the receiver falls back to vLLM's
reload, and says why, for anything else (GPU, quantization, LoRA, tensor parallelism, unknown
quant methods).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from checkpoint_engine.transport.prefault import prefault
from vllm_ext.placement import RangeSet, RecordCopies, plain_slot, same_memory

logger = logging.getLogger(__name__)

MethodKind = Literal["none", "linear", "embedding", "other"]


@dataclass(frozen=True)
class ModuleFacts:
    """What the planner needs to know about one module of the model."""

    name: str
    method: MethodKind  # its quant method: none, unquantized linear/embedding, or anything else
    num_param_elements: int  # elements of its own parameters (not its children's)
    weight_removed: bool = False  # linear weight emptied by the CPU packing (needs a staging tensor)
    has_restore_meta: bool = False  # vLLM recorded the model-format weight (needed to build staging)


@dataclass(frozen=True)
class DirectPlan:
    supported: bool
    reason: str | None = None  # why not, naming the first obstacle
    staged: tuple[str, ...] = ()  # modules that get a staging weight
    processed: tuple[str, ...] = ()  # modules re-processed (packed) after loading


def plan_direct_reload(
    *, platform: str, quantization: str | None, lora: bool, tp_size: int, modules: Iterable[ModuleFacts]
) -> DirectPlan:
    """Decide whether the direct reload can stand in for vLLM's, and what it touches."""
    if platform != "cpu":
        return DirectPlan(False, f"platform {platform!r}: the direct reload is written for vLLM's CPU backend")
    if quantization is not None:
        return DirectPlan(False, f"quantized model ({quantization}): its processing is left to vLLM's reload")
    if lora:
        return DirectPlan(False, "LoRA is enabled: left to vLLM's reload")
    if tp_size != 1:
        return DirectPlan(False, f"tensor parallel size {tp_size}: completion is counted per unsharded tensor")
    staged, processed = [], []
    for m in modules:
        if m.method == "other":
            if m.num_param_elements > 0:
                return DirectPlan(
                    False, f"module {m.name!r} has parameters and a quant method the direct reload does not know"
                )
            continue  # e.g. attention: no checkpoint weights, nothing to redo
        if m.method == "none":
            continue  # plain parameters (norms): loaded in place, nothing to redo
        if m.weight_removed:
            if not m.has_restore_meta:
                return DirectPlan(
                    False, f"module {m.name!r}: packed weight without the metadata vLLM records for reloading"
                )
            staged.append(m.name)
        processed.append(m.name)
    return DirectPlan(True, None, tuple(staged), tuple(processed))


def model_facts(model: torch.nn.Module) -> list[ModuleFacts]:
    """Facts about a live vLLM model's modules (vLLM imports stay inside)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    facts = []
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        kind: MethodKind = (
            "none"
            if qm is None
            else "linear"
            if isinstance(qm, UnquantizedLinearMethod)
            else "embedding"
            if isinstance(qm, UnquantizedEmbeddingMethod)
            else "other"
        )
        own = [p for p in m._parameters.values() if p is not None]
        weight = m._parameters.get("weight")
        removed = kind == "linear" and weight is not None and weight.numel() == 0
        info = LAYERWISE_INFO.get(m)
        has_meta = info is not None and "weight" in info.restore_metadata[0]
        facts.append(ModuleFacts(name, kind, sum(p.numel() for p in own), removed, has_meta))
    return facts


def _original_loader(loader: Callable) -> Callable:
    """vLLM's layerwise reload wraps loaders (and leaves the wrapper in its recorded metadata)."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _staging_weight(module: torch.nn.Module) -> torch.nn.Parameter:
    """A model-format weight for `module`, built from the metadata vLLM recorded at load time."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    meta = LAYERWISE_INFO[module].restore_metadata[0]["weight"]
    staging = materialize_meta_tensor(meta)  # copies the attribute dict: the metadata stays untouched
    if "_weight_loader" in staging.__dict__:
        staging.__dict__["_weight_loader"] = _original_loader(staging.__dict__["_weight_loader"])
    return restore_layer_refs(staging, module)  # loaders bound to the module again


@dataclass
class DirectReloadStats:
    num_modules_processed: int = 0
    num_tensors: int = 0
    num_in_place: int = 0  # tensors that arrived in their staging slice (receiver cache = staging)
    process_s: float = 0.0  # packing (process_weights_after_loading)
    total_s: float = 0.0
    staging_allocated: bool = False
    late_modules: list[str] = field(default_factory=list)  # packed after the iterator ended (incomplete then)


class DirectReloader:
    """Callable `(iterator of (name, tensor)) -> None` reloading a vLLM model in place (see module doc)."""

    def __init__(self, model: torch.nn.Module, plan: DirectPlan):
        if not plan.supported:
            raise ValueError(f"the direct reload does not apply: {plan.reason}")
        self.model = model
        self.plan = plan
        modules = dict(model.named_modules())
        self._staged_modules = [modules[n] for n in plan.staged]
        self._processed = [(n, modules[n]) for n in plan.processed]
        self._staging: dict[torch.nn.Module, torch.nn.Parameter] = {}
        self._slots: dict[str, torch.Tensor] = {}  # checkpoint name -> the staging slice its loader fills
        self._slot_by_ptr: dict[int, torch.Tensor] = {}
        self._tried: set[str] = set()  # names whose loader was watched once (slot learned or not)
        self._current: tuple[str, torch.Tensor] | None = None  # the pair load_weights is handling
        self.last_stats: DirectReloadStats | None = None

    def cache_slots(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> staging slice that holds exactly that tensor (learned on the first update)."""
        return dict(self._slots)

    def reference_weights(self) -> dict[torch.nn.Module, torch.Tensor]:
        """Module -> its model-format weight as last loaded (the staging weights), for
        `vllm_ext.kernel_check` to compare each packed kernel with."""
        return dict(self._staging)

    def _learn_slot(self, loaded_weight: torch.Tensor, capture: RecordCopies) -> None:
        """Keep the loader's destination as the name's slot when the loader was one plain copy of it
        (`placement.plain_slot`: a tensor found in its slot later skips its loader)."""
        if self._current is None:
            return
        name, yielded = self._current
        dst = plain_slot(capture.copies, loaded_weight, RangeSet(capture.touched))
        if dst is not None and same_memory(loaded_weight, yielded):
            self._slots[name] = dst
            self._slot_by_ptr[dst.data_ptr()] = dst

    def _ensure_staging(self) -> bool:
        if self._staging:
            return False
        for m in self._staged_modules:
            self._staging[m] = _staging_weight(m)
        prefault(self._staging.values())  # map their pages in bulk, not a fault per page while loading
        return True

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        stats = DirectReloadStats(staging_allocated=self._ensure_staging())
        loaded = {m: 0 for _, m in self._processed}
        totals = {m: sum(p.numel() for p in m._parameters.values() if p is not None) for _, m in self._processed}
        done: set[torch.nn.Module] = set()
        placeholders = {}
        for m, staging in self._staging.items():  # the emptied weight goes back if the layer is untouched
            placeholders[m] = m._parameters["weight"]
            m._parameters["weight"] = staging
            totals[m] += staging.numel() - placeholders[m].numel()

        def process(m: torch.nn.Module) -> None:
            tp = time.perf_counter()
            m.quant_method.process_weights_after_loading(m)
            if hasattr(m, "update_param_tp_status"):
                m.update_param_tp_status()
            stats.process_s += time.perf_counter() - tp
            stats.num_modules_processed += 1
            done.add(m)

        wrapped: list[tuple[torch.Tensor, Callable | None]] = []

        def wrap(m: torch.nn.Module, param: torch.Tensor) -> None:
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader

            had = getattr(param, "weight_loader", None)
            inner = had or default_weight_loader

            staged = m in self._staging

            def counting_loader(p, loaded_weight, *args, **kwargs):
                slot = self._slot_by_ptr.get(loaded_weight.data_ptr()) if staged else None
                if slot is not None and same_memory(slot, loaded_weight):
                    out = None  # the tensor already sits where its loader would copy it
                    stats.num_in_place += 1
                elif staged and self._current is not None and self._current[0] not in self._tried:
                    with RecordCopies() as capture:
                        out = inner(p, loaded_weight, *args, **kwargs)
                    self._tried.add(self._current[0])
                    self._learn_slot(loaded_weight, capture)
                else:
                    out = inner(p, loaded_weight, *args, **kwargs)
                loaded[m] += loaded_weight.numel()
                done.discard(m)  # loaded again after packing (a checkpoint naming it twice): pack again
                if loaded[m] >= totals[m]:
                    process(m)
                return out

            param.weight_loader = counting_loader
            wrapped.append((param, had))

        try:
            for _, m in self._processed:
                for p in list(m._parameters.values()):
                    if p is not None:
                        wrap(m, p)
            self.model.load_weights(self._counted(weights, stats))
        finally:
            self._current = None
            for param, had in wrapped:
                if had is None:
                    del param.weight_loader
                else:
                    param.weight_loader = had
            for name, m in self._processed:
                if loaded[m] > 0 and m not in done:  # incomplete: pack what it holds (staging keeps old parts)
                    stats.late_modules.append(name)
                    process(m)
            for m, placeholder in placeholders.items():
                if m._parameters.get("weight") is self._staging[m]:  # untouched: keep its packed weight
                    m._parameters["weight"] = placeholder
            stats.total_s = time.perf_counter() - t0
            self.last_stats = stats

    def _counted(self, weights: Iterable[tuple[str, torch.Tensor]], stats: DirectReloadStats) -> Iterator:
        for pair in weights:
            stats.num_tensors += 1
            self._current = pair
            yield pair


def build_direct_reloader(model: torch.nn.Module, vllm_config) -> tuple[DirectReloader | None, str | None]:
    """The reloader for this model, or None and the reason it does not apply."""
    from vllm.platforms import current_platform

    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        tp_size = get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError, RuntimeError):
        tp_size = 1
    platform = "cpu" if current_platform.is_cpu() else str(getattr(current_platform, "device_type", "other"))
    try:
        facts = model_facts(model)
    except ImportError as e:  # a vLLM without the layerwise reload metadata
        return None, f"this vLLM lacks what the direct reload needs ({e})"
    plan = plan_direct_reload(
        platform=platform,
        quantization=vllm_config.model_config.quantization,
        lora=vllm_config.lora_config is not None,
        tp_size=tp_size,
        modules=facts,
    )
    if not plan.supported:
        return None, plan.reason
    return DirectReloader(model, plan), None
