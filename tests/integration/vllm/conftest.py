"""Fixtures shared by the vLLM-side tests that drive the receiver in process (no vLLM engine)."""

from __future__ import annotations

import pytest


@pytest.fixture
def ps():
    """A one-rank CPU ParameterServer with 16 KiB buckets (many buckets per update) and 20 s engine deadlines."""
    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.ps import ParameterServer

    cfg = ParameterServerConfig(
        transport="cpu",
        update=UpdateConfig(bucket_size_bytes=16 * 1024, engine_timeout_s=20, engine_connect_timeout_s=20),
    )
    server = ParameterServer(rank=0, world_size=1, config=cfg)
    yield server
    server.close()
