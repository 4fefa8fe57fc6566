"""Which part of each checkpoint tensor this engine rank consumes, learned from its own weight loaders.

    [(name, dtype, shape)] --stand-ins--> model.load_weights under RecordCopies(skip=True)
        each recorded copy_'s source is a view of one stand-in --slices_of_view--> SourceSlice
        a stand-in no loader copied from                     --> () (this rank does not need it)
        a stand-in another op read, or a view no single slice describes --> the whole tensor

Under tensor parallelism vLLM's loaders narrow the checkpoint tensor to the rank's shard before they
copy it (column- and row-parallel linears, fused q/k/v and gate/up, the vocab-parallel embedding and
head, expert subsets under expert parallelism); replicated tensors are copied whole. Recording those
copies, without running them, gives each rank's slices with no per-architecture table: a new model
whose loaders vLLM knows is planned as it loads. The plan is conservative: anything the recording
cannot describe as rows of one dim asks for the whole tensor, which is always correct (the rank keeps
what it needs), only larger. `checkpoint_engine.sharding.shard_plan` plans the same from model shapes; the two
are compared slice by slice in the tests.

Stand-ins are `torch.empty` (never written, never read: the pages of a large one are never touched),
as in `placement.SlotProbe`, whose recorder this reuses.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from checkpoint_engine.sharding.slices import SourceSlice
from vllm_ext.placement import LoadFn, RangeSet, RecordCopies, byte_range


def slice_of_view(name: str, base: torch.Tensor, view: torch.Tensor) -> SourceSlice:
    """The rows of contiguous `base` that `view` (a view of the same storage) covers, as one slice;
    the whole tensor when the covered region is not a range along a single dim (a box cut in two
    dims, a reinterpreted dtype, a view that skips rows)."""
    whole = SourceSlice(name)
    if view.dtype != base.dtype or not base.is_contiguous() or view.numel() == 0:
        return whole
    # Each of the view's dims must step like one of base's dims (a narrow, a transpose, a select).
    strides = base.stride()
    offset = view.storage_offset() - base.storage_offset()
    extent = {}  # base dim -> number of indices the view spans along it
    for size, stride in zip(view.shape, view.stride(), strict=True):
        if size == 1:
            continue
        dims = [d for d in range(base.dim()) if strides[d] == stride and base.shape[d] > 1]
        if len(dims) != 1 or dims[0] in extent:
            return whole
        extent[dims[0]] = size
    # The offset decomposes into a start index per base dim (row-major: largest stride first).
    starts = []
    for d in range(base.dim()):
        starts.append(offset // strides[d] if base.shape[d] > 1 else 0)
        offset -= starts[-1] * strides[d] if base.shape[d] > 1 else 0
    if offset != 0:
        return whole
    cut = [d for d in range(base.dim()) if (starts[d], starts[d] + extent.get(d, 1)) != (0, base.shape[d])]
    if not cut:
        return whole
    if len(cut) > 1:
        return whole
    d = cut[0]
    stop = starts[d] + extent.get(d, 1)
    if stop > base.shape[d]:
        return whole
    return SourceSlice(name, d, starts[d], stop)


def merge_slices(name: str, slices: Iterable[SourceSlice]) -> tuple[SourceSlice, ...]:
    """Several reads of one tensor as the fewest slices: any whole read makes it whole; rows of one
    dim merge where they touch or overlap; rows of different dims make it whole."""
    slices = list(slices)
    if not slices:
        return ()
    if any(s.whole for s in slices) or len({s.dim for s in slices}) > 1:
        return (SourceSlice(name),)
    out: list[SourceSlice] = []
    for s in sorted(slices):
        if out and s.start <= out[-1].stop:
            last = out.pop()
            s = SourceSlice(name, s.dim, last.start, max(last.stop, s.stop))
        out.append(s)
    return tuple(out)


class ShardProbe:
    """The slices of each checkpoint tensor that `load_fn` (this rank's `model.load_weights`) reads."""

    def __init__(self, load_fn: LoadFn):
        self._load_fn = load_fn

    def __call__(self, items: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, tuple[SourceSlice, ...]]:
        """For each (name, dtype, shape): the slices this rank consumes, () when it consumes none.
        A loader that refuses the stand-ins makes every tensor whole (the plan is then broadcast's)."""
        stand_ins = [(n, torch.empty(s, dtype=d)) for n, d, s in items]
        by_storage = {t.untyped_storage().data_ptr(): (n, t) for n, t in stand_ins if t.numel()}
        record = RecordCopies(skip=True)
        try:
            with record, torch.no_grad():
                self._load_fn(iter(stand_ins))
        except Exception:  # noqa: BLE001 - conservative: every rank takes every tensor
            return {n: (SourceSlice(n),) for n, _, _ in items}
        reads: dict[str, list[SourceSlice]] = {n: [] for n, _, _ in items}
        for _, src in record.copies:
            hit = by_storage.get(src.untyped_storage().data_ptr())
            if hit is not None:
                name, base = hit
                reads[name].append(slice_of_view(name, base, src))
        # Another op that read a stand-in's bytes (a statistic, a cast before the copy) used data the
        # copies do not account for: that tensor is needed whole.
        touched = RangeSet(record.touched)
        out: dict[str, tuple[SourceSlice, ...]] = {}
        for name, t in stand_ins:
            if touched.meets(byte_range(t)):
                out[name] = (SourceSlice(name),)
            elif t.numel() == 0:
                out[name] = (SourceSlice(name),) if reads[name] else ()
            else:
                out[name] = merge_slices(name, reads[name])
        return out


def meta_model_probe(vllm_config) -> ShardProbe:
    """A ShardProbe over a second copy of this worker's model built on the meta device: its loaders
    narrow exactly as the serving model's do (same config, same TP/EP rank), it costs no memory, and
    the serving model, repacked for the CPU after loading, is never touched. Built on first use.

    Building a model registers its attention layers in the compilation config's forward context;
    the copy's go into a throwaway dict, so the serving model's context is left as it was."""
    state: dict[str, ShardProbe] = {}

    def load(weights):
        if "probe" not in state:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.utils import initialize_model

            compilation = vllm_config.compilation_config
            context = compilation.static_forward_context
            compilation.static_forward_context = {}
            try:
                with set_current_vllm_config(vllm_config), torch.device("meta"):
                    model = initialize_model(vllm_config=vllm_config)
            finally:
                compilation.static_forward_context = context
            state["probe"] = model.load_weights
        state["probe"](weights)

    return ShardProbe(load)
