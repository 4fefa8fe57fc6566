"""Sharded transfer on vLLM's own Qwen2 model at tensor parallel 2, built in this process as rank r of 2
(the TP and PP groups stubbed; no engine, no workers):

- the slices learned from the model's `load_weights` (ShardProbe) equal the shape planner's;
- a pull read over Mooncake (TCP loopback) with those slices reads at most 0.55 of the model per rank,
  counted by the reader, and loading what it read gives the rank's parameters bit for bit as loading
  the whole tensors does."""

from __future__ import annotations

import json
import types

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

from checkpoint_engine import protocol as P
from checkpoint_engine.sharding.shard_plan import plan_hf
from checkpoint_engine.sharding.slices import EngineLayout
from checkpoint_engine.transport.engine_reads import EngineReads
from checkpoint_engine.transport.mooncake import P2PConfig, P2PStore
from ckpt_common.dtypes import dtype_name
from ckpt_common.layout.shapes import ModelShape
from vllm_ext.shard_probe import ShardProbe

TP = 2


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's model directory, its state dict, and a builder of vLLM's model as TP rank r of 2."""
    from demo.tiny_model import load_state_dict_from_dir, make_tiny_model

    model_dir = make_tiny_model(tmp_path_factory.mktemp("model"))
    state = load_state_dict_from_dir(model_dir)
    import vllm.distributed.parallel_state as ps
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    config = EngineArgs(
        model=str(model_dir), dtype="bfloat16", enforce_eager=True, load_format="dummy", max_model_len=128
    ).create_engine_config()
    patch = pytest.MonkeyPatch()

    def build(rank: int):
        patch.setattr(ps, "_TP", types.SimpleNamespace(rank_in_group=rank, world_size=TP))
        patch.setattr(
            ps, "_PP", types.SimpleNamespace(rank_in_group=0, world_size=1, is_first_rank=True, is_last_rank=True)
        )
        config.compilation_config.static_forward_context.clear()  # each model registers its attention layers
        with set_current_vllm_config(config), torch.device("cpu"):
            return initialize_model(vllm_config=config)

    build.config = config
    yield model_dir, state, build
    patch.undo()


@pytest.fixture(scope="module")
def stores():
    owner, reader = P2PStore(P2PConfig()), P2PStore(P2PConfig())
    yield owner, reader
    owner.close()
    reader.close()


@pytest.mark.parametrize("rank", range(TP))
def test_sharded_pull_into_vllms_tp2_qwen2_reads_half_and_loads_the_same(demo, stores, rank):
    model_dir, state, build = demo
    items = [(n, t.dtype, tuple(t.shape)) for n, t in state.items()]

    # the plan, learned from the model's loaders, is the shape planner's
    sharded_model = build(rank)
    learned = ShardProbe(sharded_model.load_weights)(items)
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    planned = plan_hf(shape, EngineLayout(tp_size=TP)).slices((rank, 0))
    assert {s for slices in learned.values() for s in slices} == set(planned)

    # the owner's chunk: every tensor, 256-byte aligned; the rank reads it with the learned slices
    owner, reader = stores
    wire, offset = [], 0
    for name, t in state.items():
        wire.append(P.WireTensor(name, dtype_name(t.dtype), tuple(t.shape), 0, offset))
        offset = -(-(offset + t.numel() * t.element_size()) // 256) * 256
    chunk = torch.zeros(offset, dtype=torch.uint8)
    for w, t in zip(wire, state.values(), strict=True):
        chunk[w.offset_bytes : w.offset_bytes + t.numel() * t.element_size()] = (
            t.contiguous().view(-1).view(torch.uint8)
        )
    owner.register(chunk.data_ptr(), chunk.numel())
    handles = (P.BufferHandle(kind="remote", size_bytes=chunk.numel(), peer=owner.addr, ptr=chunk.data_ptr()),)
    reads = EngineReads(store_factory=lambda cfg: reader)
    reads.set_slices(lambda asked: learned)
    try:
        reads.begin(handles, "127.0.0.1", tuple(wire))
        got = reads.start(handles, wire).finish()
        full_bytes = sum(t.numel() * t.element_size() for t in state.values())
        read_share = reads.stats.scratch_bytes / full_bytes
        assert reads.stats.scratch_bytes + reads.stats.sliced_out_bytes == full_bytes
        assert 0.45 < read_share <= 0.55, read_share

        # loading what was read gives the parameters loading the whole tensors gives
        sharded_model.load_weights(iter(got))
    finally:
        reads.end()
        owner.unregister(chunk.data_ptr())
    whole_model = build(rank)
    whole_model.load_weights(iter(state.items()))
    sharded, whole = dict(sharded_model.named_parameters()), dict(whole_model.named_parameters())
    assert sharded.keys() == whole.keys()
    for name, param in whole.items():
        assert torch.equal(sharded[name], param), name


def test_the_workers_probe_on_a_meta_copy_of_the_model_learns_the_same_and_leaves_the_engine_be(demo):
    """What a TP worker sets on its pulls (`meta_model_probe`): a copy of the model on the meta device,
    its forward context kept apart from the serving model's."""
    from vllm_ext.shard_probe import meta_model_probe

    model_dir, state, build = demo
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    items = [(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
    for rank in range(TP):
        build(rank)  # the "serving" model of this rank (sets the TP stub to rank r)
        context = build.config.compilation_config.static_forward_context
        before = dict(context)
        learned = meta_model_probe(build.config)(items)
        assert {s for slices in learned.values() for s in slices} == set(
            plan_hf(shape, EngineLayout(tp_size=TP)).slices((rank, 0))
        )
        assert build.config.compilation_config.static_forward_context is context and context == before
