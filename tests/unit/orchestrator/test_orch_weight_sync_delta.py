"""The RL job's weight sync with `sync.delta`: an in-process ParameterServer pushing bf16 versions
after optimizer steps into a plain engine (its receive loop on a thread of this process). The first
version goes whole, the next ones as deltas that land exactly; an engine whose copy is not the base
refuses the delta and the same version follows whole; the config refuses delta where it cannot go."""

from __future__ import annotations

import logging

import pytest
import torch

from checkpoint_engine.checksum import tensor_checksum
from checkpoint_engine.engines.plain import PlainEngine
from orchestrator.config import EngineConfig, JobConfig, SyncConfig
from orchestrator.engines.weight_sync import WeightSync
from testing.weight_versions import adamw_bf16_versions


def versions(num: int, lr: float = 1e-5) -> list[dict[str, torch.Tensor]]:
    """bf16 casts of float32 weights after AdamW steps on random gradients (the engine's dtype)."""
    g = torch.Generator().manual_seed(0)
    master = {f"layers.{i}.w": torch.randn(128, 64, generator=g).requires_grad_(True) for i in range(4)}
    return adamw_bf16_versions(master, num, lr, g)


def digest(weights):
    return {n: tensor_checksum(t) for n, t in weights.items()}


@pytest.fixture
def engine():
    return PlainEngine(timeout_s=20)


def make_sync(engine: PlainEngine, **kw) -> WeightSync:
    def req_func(paths):
        ((device_id, address),) = paths
        engine.update_weights_from_ipc({device_id: address})

    return WeightSync(SyncConfig(timeout_s=20, **kw), req_func)


def test_versions_after_the_first_go_as_deltas_and_land_exactly(engine):
    sync = make_sync(engine, delta=True)
    vs = versions(3)
    try:
        first = sync.push(vs[0], version=0)
        assert first.kind == "full" and "no version" in first.reason
        for i in (1, 2):
            got = sync.push(vs[i], version=i)
            assert got.kind == "delta", got.reason
            assert got.total_bytes < 0.5 * first.total_bytes
            assert digest(engine.weights) == digest(vs[i])
            assert engine.weights_state()["checkpoint"] == f"policy-v{i}"
        assert list(sync.ps.checkpoints()) == ["policy-v2"]  # only the newest is kept registered
    finally:
        sync.close()


def test_a_refused_delta_is_sent_whole_and_says_why(engine, caplog):
    sync = make_sync(engine, delta=True)
    vs = versions(2)
    try:
        sync.push(vs[0], version=0)
        engine.weights["layers.1.w"].view(-1)[0] += 1  # the engine's copy no longer is the base
        with caplog.at_level(logging.WARNING, logger="orchestrator.engines.weight_sync"):
            got = sync.push(vs[1], version=1)
        assert got.kind == "full" and "refused the delta" in got.reason and "layers.1.w" in got.reason
        assert "refused the delta" in caplog.text
        assert digest(engine.weights) == digest(vs[1])
        assert list(sync.ps.checkpoints()) == ["policy-v1"]
    finally:
        sync.close()


def test_without_delta_every_version_goes_whole(engine):
    sync = make_sync(engine)
    vs = versions(2)
    try:
        assert [sync.push(v, version=i).kind for i, v in enumerate(vs)] == ["full", "full"]
        assert digest(engine.weights) == digest(vs[1])
    finally:
        sync.close()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"delta": 1}, "sync.delta=1 must be true or false"),
        ({"delta_max_ratio": 0}, r"sync.delta_max_ratio=0 must be in \(0, 1\]"),
        ({"delta_max_ratio": "half"}, "sync.delta_max_ratio='half' must be a number"),
    ],
)
def test_sync_config_names_the_bad_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SyncConfig(**kw)


@pytest.mark.parametrize("engine_kw", [{"type": "daemon", "endpoint": "http://127.0.0.1:1"}, {"num_engines": 2}])
def test_delta_is_refused_where_the_job_does_not_update_one_engine_itself(engine_kw):
    with pytest.raises(ValueError, match="sync.delta=true sends deltas to one engine"):
        JobConfig(engine=EngineConfig(**engine_kw), sync=SyncConfig(delta=True))
