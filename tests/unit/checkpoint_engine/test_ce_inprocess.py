"""World-size-1 updates with the engine receive loop on a thread of the same process (fast path tests)."""

import pytest
import torch
import zmq

from checkpoint_engine.checksum import tensor_checksum
from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
from checkpoint_engine.errors import UpdateFailed
from checkpoint_engine.ps import ParameterServer
from checkpoint_engine.state import EngineWeightState
from checkpoint_engine.worker import update_weights_from_ipc


def make_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    out = {
        f"w{i}": torch.randn(17 + i, 3, generator=g).to([torch.bfloat16, torch.float32, torch.float16][i % 3])
        for i in range(12)
    }
    out["i8"] = torch.randint(-100, 100, (5,), generator=g, dtype=torch.int8)
    return out


class ThreadEngine:
    def __init__(self, fail_at=None, post_hook=None):
        self.ctx = zmq.Context()
        self.state = EngineWeightState()
        self.weights = {}
        self.fail_at = fail_at
        self.post_hook = post_hook
        self.buckets_seen = 0
        self.errors = []

    def run(self, named):
        if self.fail_at is not None and self.buckets_seen == self.fail_at:
            raise RuntimeError("injected load failure")
        self.buckets_seen += 1
        for n, t in named:
            self.weights[n] = t.clone()

    def req_func(self, paths):
        assert len(paths) == 1
        device_id, address = paths[0]
        assert device_id.startswith("cpu-") and address.startswith("ipc://@ckpt-engine-")
        try:
            update_weights_from_ipc(
                self.ctx, address, None, run=self.run, post_hook=self.post_hook, state=self.state, timeout_s=10
            )
        except Exception as e:
            self.errors.append(e)
            raise


@pytest.fixture
def ps():
    cfg = ParameterServerConfig(
        transport="cpu", update=UpdateConfig(bucket_size_bytes=512, engine_timeout_s=10, engine_connect_timeout_s=10)
    )
    p = ParameterServer(rank=0, world_size=1, config=cfg)
    yield p
    p.close()


def test_update_bit_exact_with_many_buckets(ps):
    t = make_tensors(0)
    ps.register_checkpoint("a", named_tensors=t)
    ps.gather_metas("a")
    eng = ThreadEngine()
    m = ps.update("a", eng.req_func)
    assert m.ok and m.num_buckets > 4 and m.total_bytes == sum(x.nbytes for x in t.values())
    assert {k: tensor_checksum(v) for k, v in eng.weights.items()} == {k: tensor_checksum(v) for k, v in t.items()}
    assert all(eng.weights[k].dtype == v.dtype and eng.weights[k].shape == v.shape for k, v in t.items())
    assert eng.state.report()["version"] == 1 and eng.state.report()["status"] == "ready"


def test_engine_failure_aborts_and_state_is_incomplete_then_recovers(ps):
    ps.register_checkpoint("a", named_tensors=make_tensors(1))
    ps.gather_metas("a")
    eng = ThreadEngine(fail_at=2)
    with pytest.raises(UpdateFailed, match="rank 0: engine failed on bucket 2: RuntimeError: injected load failure"):
        ps.update("a", eng.req_func)
    r = eng.state.report()
    assert r["status"] == "incomplete" and r["version"] == 0 and "0->1 aborted" in r["last_error"]
    eng.fail_at = None
    ps.update("a", eng.req_func)
    assert eng.state.report()["status"] == "ready" and eng.state.report()["version"] == 1


def test_post_hook_failure_is_reported(ps):
    ps.register_checkpoint("a", named_tensors=make_tensors(2))
    ps.gather_metas("a")

    def hook():
        raise ValueError("bad repack")

    eng = ThreadEngine(post_hook=hook)
    with pytest.raises(UpdateFailed, match="post_hook: ValueError: bad repack"):
        ps.update("a", eng.req_func)
    assert eng.state.report()["status"] == "incomplete"


def test_req_func_raising_fails_fast(ps):
    ps.register_checkpoint("a", named_tensors=make_tensors(3))
    ps.gather_metas("a")

    def req(paths):
        raise ConnectionRefusedError("no engine at that address")

    with pytest.raises(UpdateFailed, match="req_func raised ConnectionRefusedError: no engine at that address"):
        ps.update("a", req, timeout=30)
    assert ps.last_metrics is None


def test_engine_that_never_connects_times_out(ps):
    ps.register_checkpoint("a", named_tensors=make_tensors(4))
    ps.gather_metas("a")
    with pytest.raises(UpdateFailed, match="timed out waiting for the engine to connect"):
        ps.update("a", lambda paths: None, timeout=0.5)


def test_checksum_mode_detects_corruption():
    cfg = ParameterServerConfig(transport="cpu", verify_checksums=True, update=UpdateConfig(engine_timeout_s=10))
    p = ParameterServer(rank=0, world_size=1, config=cfg)
    p.register_checkpoint("a", named_tensors=make_tensors(5))
    p.gather_metas("a")
    eng = ThreadEngine()
    p.update("a", eng.req_func)  # intact bytes verify fine
    assert eng.state.report()["version"] == 1
    p._global["a"].checksums["w3"] ^= 1  # simulate corruption in flight
    with pytest.raises(UpdateFailed, match="checksum mismatch for tensor 'w3'"):
        p.update("a", eng.req_func)
    assert eng.state.report()["status"] == "incomplete"
    p.close()


def test_failed_updates_and_unregister_close_the_segments(ps):
    import os

    ps.register_checkpoint("a", named_tensors=make_tensors(6))
    ps.gather_metas("a")
    fds = [c.handle.fd for c in ps._checkpoints["a"].chunks]
    inodes = {fd: os.fstat(fd).st_ino for fd in fds}
    with pytest.raises(UpdateFailed):
        ps.update("a", ThreadEngine(fail_at=1).req_func)
    ps.update("a", ThreadEngine().req_func)
    ps.unregister_checkpoint("a")
    for fd, ino in inodes.items():  # the segment's own descriptor is closed (or reused by another file);
        try:  # the pages go once the last view of them is gone
            assert os.fstat(fd).st_ino != ino
        except OSError:
            pass


@pytest.mark.parametrize("mode", ["collective", "local"])
def test_both_modes_bit_exact(mode):
    cfg = ParameterServerConfig(
        transport="cpu", update=UpdateConfig(bucket_size_bytes=700, mode=mode, agree_every_buckets=1)
    )
    p = ParameterServer(rank=0, world_size=1, config=cfg)
    t = make_tensors(8)
    p.register_checkpoint("a", named_tensors=t)
    p.gather_metas("a")
    eng = ThreadEngine()
    assert p.update("a", eng.req_func).mode == mode
    assert {k: tensor_checksum(v) for k, v in eng.weights.items()} == {k: tensor_checksum(v) for k, v in t.items()}
    p.close()
