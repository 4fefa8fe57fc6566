"""Zero-copy registration: a SharedTensorBuffer's views are adopted by register_checkpoint (no copy).

- adopted: the checkpoint's one chunk is the buffer's segment (same address, same fd), bytes equal;
- an update (local and collective mode) delivers the adopted bytes bit-exactly to an engine;
- a second registration of the same views (buffer busy), a partial view, foreign tensors, files or
  the shared pool: copied as before; unregister releases the buffer; close() waits for the release;
- another mapping of the segment through /proc/<pid>/fd (shm.map_writable) writes into the buffer.
"""

import pytest
import torch

from checkpoint_engine.checksum import tensor_checksum
from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
from checkpoint_engine.host_memory import SharedTensorBuffer
from checkpoint_engine.ps import ParameterServer
from checkpoint_engine.transport import shm
from tests.unit.checkpoint_engine.test_ce_inprocess import ThreadEngine

SPECS = [("a", "bfloat16", (17, 3)), ("b", "float32", (5,)), ("c", "int8", (7,)), ("d", "float16", (4, 4))]


def _fill(buf: SharedTensorBuffer, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for t in buf.tensors.values():
        if t.dtype == torch.int8:
            t.copy_(torch.randint(-100, 100, t.shape, generator=g, dtype=torch.int8))
        else:
            t.copy_(torch.randn(t.shape, generator=g))
    return {n: t.clone() for n, t in buf.tensors.items()}


@pytest.fixture
def ps():
    cfg = ParameterServerConfig(transport="cpu", update=UpdateConfig(bucket_size_bytes=256, engine_timeout_s=10))
    p = ParameterServer(rank=0, world_size=1, config=cfg)
    yield p
    p.close()


@pytest.mark.parametrize("mode", ["local", "collective"])
def test_views_are_adopted_without_a_copy_and_update_bit_exact(mode):
    cfg = ParameterServerConfig(transport="cpu", update=UpdateConfig(bucket_size_bytes=256, mode=mode))
    ps = ParameterServer(rank=0, world_size=1, config=cfg)
    buf = SharedTensorBuffer(SPECS)
    try:
        want = _fill(buf, 0)
        ps.register_checkpoint("v1", named_tensors=dict(buf.tensors))
        ckpt = ps._checkpoints["v1"]
        assert ckpt.adopted and buf.adopted_by == "v1" and len(ckpt.chunks) == 1
        chunk = ckpt.chunks[0]
        assert chunk.tensor.data_ptr() == buf.tensors["a"].data_ptr() - ckpt.layout.metas[0].offset_bytes
        assert (chunk.handle.pid, chunk.handle.fd) == (buf.ref.pid, buf.ref.fd)
        assert all(torch.equal(ckpt.view(m), want[m.name]) for m in ckpt.layout.metas)
        ps.gather_metas("v1")
        eng = ThreadEngine()
        assert ps.update("v1", eng.req_func).mode == mode
        assert {k: tensor_checksum(v) for k, v in eng.weights.items()} == {
            k: tensor_checksum(v) for k, v in want.items()
        }
        ps.unregister_checkpoint("v1")
        assert buf.adopted_by is None and buf.tensors  # released, still usable
    finally:
        buf.close()
        ps.close()


def test_busy_partial_or_foreign_tensors_are_copied(ps, tmp_path):
    buf = SharedTensorBuffer(SPECS)
    try:
        want = _fill(buf, 1)
        ps.register_checkpoint("v1", named_tensors=buf.tensors)
        ps.register_checkpoint("v2", named_tensors=buf.tensors)  # buffer busy: copied
        assert ps._checkpoints["v1"].adopted and not ps._checkpoints["v2"].adopted
        ps.register_checkpoint("part", named_tensors={"a": buf.tensors["a"][1:]})  # not the buffer's view
        ps.register_checkpoint("mixed", named_tensors={"x": torch.zeros(3), "b": buf.tensors["b"]})
        ps.register_checkpoint("pool", named_tensors={"b": buf.tensors["b"]}, use_shared_memory_pool=True)
        assert not any(ps._checkpoints[n].adopted for n in ("part", "mixed", "pool"))
        buf.tensors["b"].zero_()  # the copies keep the registered bytes
        assert torch.equal(ps._checkpoints["v2"].view(ps._checkpoints["v2"].layout.metas[1]), want["b"])
        ps.unregister_checkpoint("v1")
        ps.register_checkpoint("sub", named_tensors={"b": buf.tensors["b"], "d": buf.tensors["d"]})
        sub = ps._checkpoints["sub"]
        assert sub.adopted and [m.name for m in sub.layout.metas] == ["b", "d"]
    finally:
        buf.close()


def test_close_while_adopted_waits_for_unregister(ps):
    buf = SharedTensorBuffer(SPECS)
    want = _fill(buf, 2)
    ps.register_checkpoint("v1", named_tensors=buf.tensors)
    buf.close()
    ckpt = ps._checkpoints["v1"]
    assert all(torch.equal(ckpt.view(m), want[m.name]) for m in ckpt.layout.metas)
    shm.map_readonly(buf.ref)  # the segment is still open for engines
    ps.unregister_checkpoint("v1")
    with pytest.raises(RuntimeError, match="is gone"):
        shm.map_readonly(buf.ref)


def test_a_second_mapping_writes_into_the_buffer():
    buf = SharedTensorBuffer(SPECS)
    try:
        other = SharedTensorBuffer.views(shm.map_writable(buf.ref), buf.layout)  # what a trainer rank maps
        other["b"].copy_(torch.arange(5.0))
        assert torch.equal(buf.tensors["b"], torch.arange(5.0))
    finally:
        buf.close()
