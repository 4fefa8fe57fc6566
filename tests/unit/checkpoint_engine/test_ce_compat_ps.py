"""MoonshotAI compatibility of the public API, in one process (world size 1): `checkpoint_engine.distributed`,
register_checkpoint's options, the join flow's metas merge, the local pull without Mooncake, error types,
and the one checksum switch."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as td
import zmq

import checkpoint_engine.distributed as dist
from checkpoint_engine import pipeline
from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
from checkpoint_engine.errors import REMOTE_ERRORS, CheckpointEngineError, UpdateFailed
from checkpoint_engine.ps import ParameterServer
from checkpoint_engine.worker import update_weights_from_ipc


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtypes = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32)
    return {f"w{i}": torch.randn(5 + i, 7, generator=g).to(dtypes[i % 4]) for i in range(8)}


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class Engine:
    """Receives in the req_func thread; records what arrived and the Hello."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.weights: dict[str, bytes] = {}
        self.hellos = []

    def req_func(self, paths):
        ((_, address),) = paths
        update_weights_from_ipc(
            self.ctx,
            address,
            None,
            timeout_s=10,
            run=lambda ws: self.weights.update({n: bits(t) for n, t in ws}),
            on_hello=lambda hello, _bufs: self.hellos.append(hello),
        )


def make_ps(**cfg) -> ParameterServer:
    update = UpdateConfig(engine_timeout_s=10, engine_connect_timeout_s=10, req_func_timeout_s=10)
    return ParameterServer(rank=0, world_size=1, config=ParameterServerConfig(transport="cpu", update=update, **cfg))


@pytest.fixture
def ps():
    p = make_ps()
    yield p
    p.close()


# -- checkpoint_engine.distributed -------------------------------------------------------------------
@pytest.mark.parametrize("name", [None, "", "torch"])
def test_use_backend_accepts_torch_distributed(name):
    dist.use_backend(name)
    assert dist.backend() == "torch"


@pytest.mark.parametrize("name", ["vllm_nccl", "hccl", "nccl"])
def test_use_backend_refuses_others_naming_the_supported(name):
    with pytest.raises(ValueError, match=rf"unsupported distributed backend '{name}'.*'torch'.*None"):
        dist.use_backend(name)
    assert dist.backend() == "torch"


def test_distributed_functions_forward_to_torch():
    """The default backend is NCCL where CUDA is, else gloo; the collectives reach torch's."""
    on_gpu = torch.cuda.is_available()
    assert not dist.is_initialized()
    dist.init_process_group(rank=0, world_size=1, store=td.HashStore(), timeout=30)
    try:
        assert dist.is_initialized() and td.get_backend() == ("nccl" if on_gpu else "gloo")
        got = [None]
        dist.all_gather_object(got, {"pid": os.getpid()})
        assert got == [{"pid": os.getpid()}]
        t = torch.tensor([3.0], device="cuda" if on_gpu else "cpu")
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        dist.barrier()
        g = dist.new_group([0])
        dist.all_reduce(t, op=td.ReduceOp.MAX, group=g)
        dist.destroy_process_group(g)
        assert t.item() == 3.0
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


# -- register_checkpoint options ------------------------------------------------------------------
def test_register_refuses_unknown_keywords_naming_the_accepted(ps):
    with pytest.raises(TypeError, match=r"\['use_shm'\].*use_shared_memory_pool, use_inplace_pin_memory"):
        ps.register_checkpoint("c", named_tensors=tensors(0), use_shm=True)
    with pytest.raises(TypeError, match="use_inplace_pin_memory must be a bool"):
        ps.register_checkpoint("c", named_tensors=tensors(0), use_inplace_pin_memory="yes")
    assert ps.checkpoints() == {}


def test_register_accepts_moonshot_options_and_keeps_files(ps, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "a.safetensors"
    save_file(tensors(1), path)
    ps.register_checkpoint("c", files=[str(path)], use_inplace_pin_memory=True, use_shared_memory_pool=False)
    assert path.exists(), "in-place pinning is not done here: the user's file stays"
    assert ps.checkpoints()["c"]["num_tensors"] == 8


def test_shared_memory_pool_reuses_chunks_one_user_at_a_time(ps):
    ps.register_checkpoint("a", named_tensors=tensors(1), use_shared_memory_pool=True)
    handles_a = [c.handle for c in ps._checkpoints["a"].chunks]
    with pytest.raises(ValueError, match="shared memory pool is used by checkpoint 'a'"):
        ps.register_checkpoint("b", named_tensors=tensors(2), use_shared_memory_pool=True)
    ps.register_checkpoint("b", named_tensors=tensors(2))  # outside the pool: fine
    ps.unregister_checkpoint("a")
    ps.register_checkpoint("c", named_tensors=tensors(3), use_shared_memory_pool=True)
    assert [c.handle for c in ps._checkpoints["c"].chunks] == handles_a  # a's memory, reused
    ck = ps._checkpoints["c"]
    assert all(bits(ck.view(m)) == bits(tensors(3)[m.name]) for m in ck.layout.metas)


# -- checksums: one switch, and it works ----------------------------------------------------------
def test_update_config_has_no_checksum_switch():
    with pytest.raises(TypeError):
        UpdateConfig(verify_checksums=True)  # the switch is ParameterServerConfig.verify_checksums


@pytest.mark.parametrize("verify", [False, True])
def test_verify_checksums_reaches_the_engine(verify):
    p = make_ps(verify_checksums=verify)
    try:
        p.register_checkpoint("a", named_tensors=tensors(4))
        p.gather_metas("a")
        eng = Engine()
        p.update("a", eng.req_func)
        assert [h.verify_checksums for h in eng.hellos] == [verify]
        assert (p.get_metas("a")["checksums"] is not None) == verify
        if verify:  # and a wrong checksum is caught, so the flag is not decorative
            p._global["a"].checksums["w2"] ^= 1
            with pytest.raises(UpdateFailed, match="checksum mismatch for tensor 'w2'"):
                p.update("a", eng.req_func)
    finally:
        p.close()


# -- errors ---------------------------------------------------------------------------------------
def test_update_failed_keeps_moonshot_wording_and_type():
    e = UpdateFailed({1: "engine failed on bucket 0: RuntimeError: boom"})
    assert isinstance(e, RuntimeError) and isinstance(e, CheckpointEngineError)
    assert str(e).startswith(REMOTE_ERRORS) and "rank 1: engine failed on bucket 0: RuntimeError: boom" in str(e)
    assert pipeline.UpdateFailed is UpdateFailed


def test_engine_error_raises_remote_errors_runtime_error(ps):
    ps.register_checkpoint("a", named_tensors=tensors(5))
    ps.gather_metas("a")
    ctx = zmq.Context()

    def bad(paths):
        def run(_ws):
            raise RuntimeError("Intentional Error for testing.")

        update_weights_from_ipc(ctx, paths[0][1], None, run=run, timeout_s=10)

    with pytest.raises(RuntimeError, match=f"{REMOTE_ERRORS}.*rank 0: engine failed on bucket 0.*Intentional"):
        ps.update("a", bad)


# -- join flow ------------------------------------------------------------------------------------
def foreign(metas: dict, *, pid: int = 4_000_000, host: str | None = None) -> dict:
    """`metas` as if another job (other pids, maybe another host) had gathered them."""
    m = dict(metas)
    m["pids"] = [pid] * len(metas["pids"])
    m["owner_pids"] = dict.fromkeys(metas["owner_pids"], pid)
    if host is not None:
        m["hosts"] = [host] * len(metas["hosts"])
        m["owner_hosts"] = dict.fromkeys(metas["owner_hosts"], host)
    return m


def test_gather_of_unregistered_name_then_update_needs_owners(ps):
    ps.gather_metas("join")  # allowed: this job learns its own ranks only
    metas = ps.get_metas("join")
    assert metas["ranks"] == {} and metas["pids"] == [os.getpid()] and metas["hosts"] == [socket.gethostname()]
    assert ps.registry.metas("join") is None, "an owner-less view must not be published over the owners'"
    with pytest.raises(ValueError, match="no rank owns 'join'.*load_metas"):
        ps.update("join", lambda paths: None, ranks=[0])
    with pytest.raises(ValueError, match="name no owner rank"):
        ps.load_metas(metas)


def test_load_metas_keeps_this_jobs_rank_info_and_takes_the_owners():
    owner, joiner = make_ps(), make_ps()
    try:
        owner.register_checkpoint("c", named_tensors=tensors(6))
        owner.gather_metas("c")
        theirs = foreign(owner.get_metas())
        joiner.gather_metas("c")
        joiner.load_metas(theirs)
        mine = joiner.get_metas("c")
        assert mine["pids"] == [os.getpid()] and mine["device_ids"] == [joiner.device_id]
        for key in ("ranks", "chunk_handles", "chunk_ptrs", "owner_pids", "owner_hosts"):
            assert mine[key] == theirs[key], key
        # without an earlier gather the loaded metas are taken whole (this job's info is gathered at update)
        other = make_ps()
        try:
            other.load_metas(theirs)
            assert other.get_metas("c")["pids"] == theirs["pids"]
        finally:
            other.close()
        orphan = {**theirs, "device_ids": ["a", "b"], "pids": [1, 2], "hosts": ["h", "h"]}
        orphan.update(owner_pids={}, owner_hosts={}, ranks={"5": theirs["ranks"]["0"]})
        with pytest.raises(ValueError, match="metas describe 2 ranks but this world has 1"):
            joiner.load_metas(orphan)
        with pytest.raises(ValueError, match="malformed metas.*differ in length"):
            joiner.load_metas({**theirs, "pids": [1, 2]})
        with pytest.raises(ValueError, match="malformed metas"):
            joiner.load_metas({"checkpoint": "c"})
    finally:
        owner.close()
        joiner.close()


@pytest.mark.parametrize("ranks", [[0], None])
def test_joiner_pulls_owner_chunks_in_place_without_mooncake(ranks):
    owner, joiner = make_ps(), make_ps()
    try:
        t = tensors(7)
        owner.register_checkpoint("c", named_tensors=t)
        owner.gather_metas("c")
        joiner.gather_metas("c")
        joiner.load_metas(foreign(owner.get_metas()))  # chunk handles still name the owner's memfds
        eng = Engine()
        m = joiner.update("c", eng.req_func, ranks=ranks)
        assert m.ok and m.mode == "local"
        assert eng.weights == {k: bits(v) for k, v in t.items()}
    finally:
        owner.close()
        joiner.close()


def test_pull_across_hosts_without_p2p_says_what_to_configure():
    owner, joiner = make_ps(), make_ps()
    try:
        owner.register_checkpoint("c", named_tensors=tensors(8))
        owner.gather_metas("c")
        joiner.gather_metas("c")
        joiner.load_metas(foreign(owner.get_metas(), host="elsewhere"))
        with pytest.raises(ValueError, match=r"owners are in another job.*ParameterServerConfig\(p2p=P2PConfig"):
            joiner.update("c", Engine().req_func, ranks=[0])
        with pytest.raises(ValueError, match="mode='local' needs every owner on the receivers' host"):
            make_local = ParameterServer(
                rank=0, world_size=1, config=ParameterServerConfig(transport="cpu", update=UpdateConfig(mode="local"))
            )
            try:
                make_local.gather_metas("c")
                make_local.load_metas(foreign(owner.get_metas(), host="elsewhere"))
                make_local.update("c", Engine().req_func, ranks=[0])
            finally:
                make_local.close()
    finally:
        owner.close()
        joiner.close()
