"""Weights one module shares with another (tied embeddings, a draft model's head), kept right by a reload.

A model with `tie_word_embeddings` has one parameter under two modules: `lm_head.weight` is
`model.embed_tokens.weight`, and the checkpoint holds only the embedding. vLLM's layerwise reload
(`reload_weights`, what a tensor-parallel worker runs) loads and processes a layer when its checkpoint
tensors arrive, so the embedding is refilled and processed, while the head, which gets no tensor of
its own, only has its old tensors put back. On vLLM's CPU backend processing is where a linear layer
packs its weight for the GEMM kernel (`dispatch_cpu_unquantized_gemm`: a packed copy kept by the
layer's `cpu_linear`, the plain weight left in place for the embedding method), so the head's kernel
kept computing with the packed copy of the weights it was started with (dummy ones: every logprob
-ln(vocab)) while its parameter held the new values. The same holds for any module whose parameter
is another module's, e.g. a draft model's head tied to the target's embedding.

    after every reload: facts about each module (its parameters' storages, its quant method)
      └▶ plan_reprocess (pure): modules with a quant method that share a parameter's storage with
         another module ─▶ process_weights_after_loading again on each (re-packs from the shared,
         now current, values); shared modules whose processing would drop the weight are named, not run

Sharing a whole module (one object under two names) needs nothing: it is processed once, with its
own tensors. `vllm_ext.kernel_check` then checks what each kernel computes against its weight.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger(__name__)

MethodKind = Literal["none", "embedding", "linear", "other"]
# quant methods whose processing keeps the plain weight in place, so running it again is safe
REPROCESSABLE: tuple[MethodKind, ...] = ("embedding",)


@dataclass(frozen=True)
class ParamFacts:
    """One parameter of one module: where its values live, and the module's quant method."""

    module: str
    param: str
    storage: int  # the data pointer of its storage (0: empty, meta or without storage)
    method: MethodKind


@dataclass(frozen=True)
class ReprocessPlan:
    reprocess: tuple[str, ...] = ()  # modules to process again, in model order
    refused: tuple[str, ...] = ()  # shared modules whose processing is not known to keep the weight
    groups: tuple[tuple[str, ...], ...] = ()  # the "module.param" names of each shared storage


def plan_reprocess(facts: Iterable[ParamFacts]) -> ReprocessPlan:
    """Which modules must be processed again because a parameter of theirs belongs to another module too."""
    by_storage: dict[int, list[ParamFacts]] = {}
    order: list[str] = []
    for f in facts:
        if f.module not in order:
            order.append(f.module)
        if f.storage:
            by_storage.setdefault(f.storage, []).append(f)
    shared: dict[str, MethodKind] = {}
    groups = []
    for members in by_storage.values():
        if len({m.module for m in members}) < 2:
            continue
        groups.append(tuple(f"{m.module}.{m.param}" for m in members))
        for m in members:
            shared[m.module] = m.method
    reprocess = tuple(m for m in order if shared.get(m) in REPROCESSABLE)
    refused = tuple(m for m in order if shared.get(m) in ("linear", "other"))
    return ReprocessPlan(reprocess, refused, tuple(groups))


def method_kind(module: torch.nn.Module) -> MethodKind:
    qm = getattr(module, "quant_method", None)
    if qm is None:
        return "none"
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if isinstance(qm, UnquantizedEmbeddingMethod):
        return "embedding"
    if isinstance(qm, UnquantizedLinearMethod):
        return "linear"
    return "other"


def _storage(t: torch.Tensor) -> int:
    if t.is_meta or t.numel() == 0:
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor subclass without storage
        return 0


def model_param_facts(models: Sequence[tuple[str, torch.nn.Module]]) -> tuple[list[ParamFacts], dict]:
    """Facts over every (prefix, model) given (the target and, when there is one, its draft model), and
    the modules by their prefixed names. A module object under two names counts once."""
    facts, modules, seen = [], {}, set()
    for prefix, model in models:
        for name, m in model.named_modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            full = f"{prefix}{name}" if name else prefix.rstrip(".") or "<model>"
            modules[full] = m
            kind = method_kind(m)
            for pname, p in m._parameters.items():
                if p is not None:
                    facts.append(ParamFacts(full, pname, _storage(p), kind))
    return facts, modules


def reprocess_shared(models: Sequence[tuple[str, torch.nn.Module]]) -> ReprocessPlan:
    """Run the plan on live models after a reload; returns it (the log names what was done)."""
    facts, modules = model_param_facts(models)
    plan = plan_reprocess(facts)
    for name in plan.reprocess:
        m = modules[name]
        m.quant_method.process_weights_after_loading(m)
    if plan.refused:
        logger.warning(
            "modules %s share weights with another module but their processing may drop the weight: "
            "not processed again (the kernel check tells whether they compute with current values)",
            list(plan.refused),
        )
    if plan.reprocess:
        logger.debug("processed again for shared weights: %s", list(plan.reprocess))
    return plan
