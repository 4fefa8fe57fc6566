"""CUDA path: pinned host chunks, H2D into a device double buffer, CUDA IPC to an engine process.

Run on a machine with a GPU: `pytest -m gpu tests/integration/gpu`. With one GPU only world size 1 runs (NCCL
needs one device per rank); with two or more GPUs the two-rank NCCL broadcast runs too.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.dist.harness import Engine, run_scenario

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_pinned_host_chunks_and_cuda_buffer():
    from checkpoint_engine.transport.devices import CudaTransport

    t = CudaTransport(0)
    chunk = t.alloc_host(1 << 20)
    assert chunk.tensor.is_pinned() and chunk.handle is None
    buf, handle = t.shared_buffer(1 << 20)
    assert buf.is_cuda and handle.kind == "cuda" and handle.size_bytes == 1 << 20
    src = torch.arange(256, dtype=torch.uint8).repeat(4096)
    chunk.tensor.copy_(src)
    t.copy_in(buf, chunk.tensor)
    t.synchronize()
    assert torch.equal(buf.cpu(), src)
    t.release_shared()


@pytest.mark.parametrize("world", [1, 2])
def test_cuda_update_bit_exact(tmp_path, world):
    if world > torch.cuda.device_count():
        pytest.skip(f"needs {world} GPUs")
    engines = [Engine(device=f"cuda:{r}") for r in range(world)]
    try:
        res = run_scenario(
            engines,
            tmp_path,
            *("--transport", "cuda", "--mode", "auto", "--bucket-size", "24576"),
            steps="A1,B2,A3",
            timeout_s=300,
        )
        for rank, (rc, out) in enumerate(res):
            assert rc == 0, f"rank {rank}:\n{out}"
            assert out.count("STEP_OK") == 3
    finally:
        assert [e.stop() for e in engines] == [0] * world


def test_cuda_engine_failure_reports_incomplete(tmp_path):
    engines = [Engine("--fail-on-bucket", "2", device="cuda:0")]
    try:
        res = run_scenario(engines, tmp_path, "--transport", "cuda", "--bucket-size", "24576", timeout_s=300)
        assert res[0][0] == 3 and "engine failed on bucket 2" in res[0][1], res[0][1]
        assert engines[0].state()["status"] == "incomplete"
    finally:
        engines[0].stop()
