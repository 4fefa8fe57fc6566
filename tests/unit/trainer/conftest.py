"""Fixtures of the trainer tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def parallel():
    """megatron-core's model-parallel state at world size 1 in this process (CPU redirects where no CUDA)."""
    from trainer.megatron import cpu_compat
    from trainer.megatron import model as mg_model

    if torch.distributed.is_initialized():
        pytest.skip("a default process group is already initialized in this pytest process")
    mg_model.init_parallel(1)
    try:
        yield
    finally:
        mg_model.close_parallel()
        cpu_compat.remove_cpu_redirects()
