"""The RL job's weight sync with `sync.delta`: an in-process ParameterServer pushing bf16 versions
after optimizer steps into a plain engine (its receive loop on a thread of this process). The first
version goes whole, the next ones as deltas that land exactly; an engine whose copy is not the base
refuses the delta and the same version follows whole; the same through a pool of plain engines
(each engine that refuses takes the full version; a restarted one is brought up whole); the config
refuses delta for colocated daemon engines (they start for each version, without the base)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from checkpoint_engine.checksum import tensor_checksum
from checkpoint_engine.engines.plain import PlainEngine
from orchestrator.config import EngineConfig, JobConfig, SyncConfig
from orchestrator.engine_pool.weight_sync import WeightSync
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
        with caplog.at_level(logging.WARNING, logger="orchestrator.engine_pool.weight_sync"):
            got = sync.push(vs[1], version=1)
        assert got.kind == "full" and "refused the delta" in got.reason and "layers.1.w" in got.reason
        assert "refused the delta" in caplog.text
        assert digest(engine.weights) == digest(vs[1])
        assert list(sync.ps.checkpoints()) == ["policy-v1"]
    finally:
        sync.close()


def test_an_anchor_every_two_versions_and_uncompressed_deltas(engine):
    sync = make_sync(engine, delta=True, delta_anchor_every=2, delta_compress=False)
    vs = versions(4)
    try:
        got = [sync.push(v, version=i) for i, v in enumerate(vs)]
        assert [g.kind for g in got] == ["full", "delta", "full", "delta"], [g.reason for g in got]
        assert "anchor" in got[2].reason
        assert digest(engine.weights) == digest(vs[3])
        assert sync.delta.compress is False and sync.delta.anchor_every == 2
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
        ({"delta_anchor_every": 0}, "sync.delta_anchor_every=0 must be an int >= 1"),
        ({"delta_anchor_every": 2.5}, "sync.delta_anchor_every=2.5 must be an int >= 1"),
        ({"delta_compress": "yes"}, "sync.delta_compress='yes' must be true or false"),
    ],
)
def test_sync_config_names_the_bad_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SyncConfig(**kw)


def test_delta_is_refused_for_colocated_daemon_engines_and_allowed_for_a_pool_and_disaggregated_ones():
    daemon = EngineConfig(type="daemon", endpoint="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="colocated engines start .or wake. for each version"):
        JobConfig(engine=dataclasses.replace(daemon, colocated=True), sync=SyncConfig(delta=True))
    assert JobConfig(engine=daemon, sync=SyncConfig(delta=True)).sync.delta
    assert JobConfig(engine=EngineConfig(num_engines=2), sync=SyncConfig(delta=True)).sync.delta


# -- a pool of plain engines (orchestrator.engine_pool.pool_sync) ----------------------------------------
class PlainMember:
    """A pool member's engine: its weight updates go to a plain engine on a thread of this process."""

    def __init__(self) -> None:
        self.engine = PlainEngine(timeout_s=20)

    def weight_req_func(self, timeout_s, weight_version=None):
        def req_func(paths):
            ((device_id, address),) = paths
            self.engine.update_weights_from_ipc({device_id: address})

        return req_func


@pytest.fixture
def pool_sync():
    from orchestrator.engine_pool.pool import EnginePool
    from orchestrator.engine_pool.pool_members import Member
    from orchestrator.engine_pool.pool_sync import PoolWeightSync

    made = []

    def make(num: int, **kw):
        members = [PlainMember() for _ in range(num)]
        pool = EnginePool([Member(i, engine=m) for i, m in enumerate(members)], watch_interval_s=0.05)
        sync = PoolWeightSync(SyncConfig(timeout_s=20, delta=True, **kw), pool)
        made.append(sync)
        return sync, pool, [m.engine for m in members]

    yield make
    for sync in made:
        sync.close()
        sync.pool.close()


def test_a_pool_takes_deltas_and_an_engine_that_refuses_takes_the_full_version(pool_sync):
    sync, pool, engines = pool_sync(3)
    vs = versions(4)
    first = sync.push(vs[0], version=0)
    assert first.kind == "full" and first.engine_kind == dict.fromkeys(["engine0", "engine1", "engine2"], "full")
    got = sync.push(vs[1], version=1)
    assert got.kind == "delta" and got.total_bytes < 0.5 * first.total_bytes, got
    assert all(digest(e.weights) == digest(vs[1]) for e in engines)

    engines[1].weights["layers.2.w"].view(-1)[3] += 1  # engine1's copy no longer is the base
    got = sync.push(vs[2], version=2)
    assert got.kind == "mixed" and got.engine_kind == {"engine0": "delta", "engine2": "delta", "engine1": "full"}
    assert "1 of 3 engines refused the delta" in got.reason
    assert all(digest(e.weights) == digest(vs[2]) for e in engines)
    assert [e.weights_state()["checkpoint"] for e in engines] == ["policy-v2"] * 3
    assert {(m.state, m.version) for m in pool.members} == {("serving", 2)}

    got = sync.push(vs[3], version=3)  # every engine holds v2 again: all deltas
    assert got.kind == "delta" and set(got.engine_kind.values()) == {"delta"}
    assert all(digest(e.weights) == digest(vs[3]) for e in engines)
    assert list(sync.ps.checkpoints()) == ["policy-v3"]


def test_a_restarted_engine_is_brought_up_with_the_full_version_after_a_delta(pool_sync):
    sync, pool, engines = pool_sync(2)
    vs = versions(2)
    sync.push(vs[0], version=0)
    assert sync.push(vs[1], version=1).kind == "delta"
    fresh = PlainMember()  # a restarted engine: no weights at all
    pool.members[1].engine = fresh
    sync.bring_up(pool.members[1])
    assert digest(fresh.engine.weights) == digest(vs[1])
    assert fresh.engine.weights_state()["checkpoint"] == "policy-v1"
    assert digest(engines[0].weights) == digest(vs[1])  # untouched by the swap
    assert list(sync.ps.checkpoints()) == ["policy-v1"]


def test_every_engine_refusing_the_delta_is_a_full_update(pool_sync):
    sync, _, engines = pool_sync(2)
    vs = versions(2)
    sync.push(vs[0], version=0)
    for e in engines:
        e.weights["layers.0.w"].view(-1)[0] -= 1
    got = sync.push(vs[1], version=1)
    assert got.kind == "full" and got.reason == "2 of 2 engines refused the delta"
    assert all(digest(e.weights) == digest(vs[1]) for e in engines)


def test_daemon_deltas_are_cut_along_the_slices_of_its_tensor_parallel_engines(tmp_path):
    """A daemon engine of two ranks (vLLM TP 2, each worker pulls only its slices) takes a delta only
    as entries of its slices: DaemonWeightSync cuts deltas along them, from the engines' config.json;
    one-rank engines get whole tensors; a config it cannot plan for leaves them whole, logged."""
    import json

    from checkpoint_engine.sharding.delta_slices import tp_delta_slices
    from demo.tiny_model import TinyModelConfig, make_tiny_model, random_state_dict
    from orchestrator.engine_pool.daemon import MODEL_DIR, DaemonWeightSync
    from orchestrator.engine_pool.weight_sync import delta_sender

    cfg = TinyModelConfig.tiny()
    model = make_tiny_model(tmp_path / MODEL_DIR, cfg, seed=0)
    names = random_state_dict(cfg, 0).keys()
    sync = object.__new__(DaemonWeightSync)  # only what the cut reads: the handoff dir, the sender
    sync.handoff, sync.delta, sync._delta_tp_size = tmp_path, delta_sender(SyncConfig(delta=True)), 1
    sync._cut_deltas_for([{"ranks": [0]}, {"ranks": [1]}], names)
    assert sync.delta.slices is None
    sync._cut_deltas_for([{"ranks": [0, 1]}], names)
    expected = tp_delta_slices(json.loads((model / "config.json").read_text()), 2, names)
    assert sync.delta.slices == expected
    split = [n for n, s in expected.items() if len(s) == 2]  # a column- or row-parallel weight: two halves
    assert any("q_proj" in n for n in split) and any("down_proj" in n for n in split), sorted(split)
    assert all(len(s) == 1 for n, s in expected.items() if "norm" in n)  # replicated: whole
    (model / "config.json").write_text(
        json.dumps({**json.loads((model / "config.json").read_text()), "num_attention_heads": 3})
    )
    sync._delta_tp_size = 1
    sync._cut_deltas_for([{"ranks": [0, 1]}], names)  # 3 heads do not split over 2 ranks
    assert sync.delta.slices is None and sync._delta_tp_size == 2
