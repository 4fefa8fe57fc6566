"""Delta updates through the parameter server and the plain engine's receive path (world size 1, the
engine's receive loop on a thread of this process): bf16 engine weights of the demo model after
optimizer steps go as deltas and equal a full update bit for bit; a corrupted base, a skipped
version, a healed (reset) engine and a delta denser than the threshold each end in a full update
that says why."""

from __future__ import annotations

import pytest
import torch

from checkpoint_engine.checksum import tensor_checksum
from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
from checkpoint_engine.engines.plain import PlainEngine
from checkpoint_engine.ps import ParameterServer
from checkpoint_engine.sharding.delta import DeltaMismatch, encode_version
from checkpoint_engine.sharding.delta_sync import HEADER, DeltaReceiver, DeltaSync, from_wire, to_wire


@pytest.fixture
def ps():
    cfg = ParameterServerConfig(
        transport="cpu",
        update=UpdateConfig(bucket_size_bytes=1 << 20, engine_timeout_s=20, engine_connect_timeout_s=20),
    )
    p = ParameterServer(rank=0, world_size=1, config=cfg)
    yield p
    p.close()


def req_func_of(engine: PlainEngine):
    def req_func(paths):
        ((device_id, address),) = paths
        engine.update_weights_from_ipc({device_id: address})

    return req_func


class Trainer:
    """float32 master weights of the demo model, AdamW steps on random gradients; `engine()` is their
    bf16 cast, what the engine serves."""

    def __init__(self):
        from demo.tiny_model import TinyModelConfig, random_state_dict

        self.master = {
            n: t.float().clone().requires_grad_(True) for n, t in random_state_dict(TinyModelConfig.tiny(), 0).items()
        }
        self.gen = torch.Generator().manual_seed(1)

    def step(self, lr: float) -> None:
        opt = torch.optim.AdamW(self.master.values(), lr=lr)
        for t in self.master.values():
            t.grad = torch.randn(t.shape, generator=self.gen)
        opt.step()

    def engine(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().to(torch.bfloat16) for n, t in self.master.items()}


def digest(weights):
    return {n: tensor_checksum(t) for n, t in weights.items()}


def make_sync(ps, engine):
    return DeltaSync(ps, req_func_of(engine), lambda: engine.weights_state()["checkpoint"])


def test_versions_go_as_deltas_and_equal_a_full_update(ps):
    trainer, engine, plain = Trainer(), PlainEngine(timeout_s=20), PlainEngine(timeout_s=20)
    sync = make_sync(ps, engine)
    first = sync.push("v1", trainer.engine())
    assert (first.kind, first.tried_delta) == ("full", False) and "no version" in first.reason
    full_bytes = first.nbytes
    for version in ("v2", "v3"):
        trainer.step(lr=1e-5)
        pushed = sync.push(version, trainer.engine())
        assert pushed.kind == "delta", pushed.reason
        assert pushed.nbytes < 0.5 * full_bytes
        assert digest(engine.weights) == digest(trainer.engine())
        assert engine.weights_state()["checkpoint"] == version
    # the same version as a full update gives the same bits
    make_sync(ps, plain).push("v3", trainer.engine())
    assert digest(plain.weights) == digest(engine.weights)


def test_a_corrupted_base_is_refused_and_the_full_version_follows(ps):
    trainer, engine = Trainer(), PlainEngine(timeout_s=20)
    sync = make_sync(ps, engine)
    sync.push("v1", trainer.engine())
    name = next(iter(engine.weights))
    engine.weights[name].view(-1)[0] += 1  # the engine's copy no longer is v1
    trainer.step(lr=1e-5)
    pushed = sync.push("v2", trainer.engine())
    assert (pushed.kind, pushed.tried_delta) == ("full", True)
    assert "refused the delta" in pushed.reason and name in pushed.reason
    assert digest(engine.weights) == digest(trainer.engine())


def test_a_skipped_version_a_healed_engine_and_a_dense_delta_go_full(ps):
    trainer, engine = Trainer(), PlainEngine(timeout_s=20)
    sync = make_sync(ps, engine)
    sync.push("v1", trainer.engine())

    # the sender moved on to v2 (sent to other engines), this engine still holds v1
    trainer.step(lr=1e-5)
    sync.sender.commit(sync.sender.prepare("v2", trainer.engine(), "v1"))
    trainer.step(lr=1e-5)
    pushed = sync.push("v3", trainer.engine())
    assert (pushed.kind, pushed.tried_delta) == ("full", False) and "skipped version" in pushed.reason
    assert digest(engine.weights) == digest(trainer.engine())

    engine.reset_weights()  # a healed engine: no version
    trainer.step(lr=1e-5)
    pushed = sync.push("v4", trainer.engine())
    assert pushed.kind == "full" and "no version" in pushed.reason
    assert digest(engine.weights) == digest(trainer.engine())

    trainer.step(lr=1e-1)  # most bf16 values change
    pushed = sync.push("v5", trainer.engine())
    assert (pushed.kind, pushed.tried_delta) == ("full", False) and "more than 0.5" in pushed.reason
    assert digest(engine.weights) == digest(trainer.engine())


def test_wire_form_round_trips_and_a_missing_part_or_wrong_base_is_refused():
    base = {"a": torch.zeros(100, dtype=torch.bfloat16), "b": torch.ones(3, 4, dtype=torch.bfloat16)}
    new = {"a": base["a"].clone(), "b": base["b"].clone()}
    new["a"][7] = 2.0
    wire = to_wire(encode_version(base, new), "v1", "v2")
    assert HEADER in wire and all("::delta" in n for n in wire if n != HEADER)
    got_base, got_version, delta = from_wire(wire)
    assert (got_base, got_version) == ("v1", "v2") and delta.tensors["a"].num_changed == 1

    receiver = DeltaReceiver()
    for name, t in wire.items():
        assert receiver.take(name, t)
    assert not receiver.take("a", new["a"])  # a model tensor is not the receiver's
    with pytest.raises(DeltaMismatch, match="holds 'v0'"):
        receiver.finish(base, "v0")
    assert not base["a"].any()  # nothing written
    assert receiver.finish(base, "v1") == "v2" and base["a"][7] == 2.0

    missing = {n: t for n, t in wire.items() if not n.startswith("a::")}
    with pytest.raises(DeltaMismatch, match="tensor 'a': delta part 0 did not arrive"):
        from_wire(missing)
