"""Single-process ParameterServer: registration and bad input (world_size=1, no process group)."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
from checkpoint_engine.host_memory import read_safetensors_index
from checkpoint_engine.ps import ParameterServer
from checkpoint_engine.transport.load_rendezvous import PullHint


@pytest.fixture
def ps():
    p = ParameterServer(rank=0, world_size=1, config=ParameterServerConfig(transport="cpu"))
    yield p
    p.close()


def test_register_files_and_named_tensors_bit_exact(ps, tmp_path):
    a = {"x": torch.randn(3, 5).to(torch.bfloat16), "i": torch.randint(-9, 9, (7,), dtype=torch.int8)}
    save_file(a, tmp_path / "a.safetensors")
    b = {"y": torch.randn(2, 2, dtype=torch.float16).t(), "s": torch.tensor(3.0)}  # non-contiguous, 0-d
    ps.register_checkpoint("c", files=[str(tmp_path / "a.safetensors")], named_tensors=b)
    ck = ps._checkpoints["c"]
    for name, t in {**a, **b}.items():
        meta = next(m for m in ck.layout.metas if m.name == name)
        assert torch.equal(ck.view(meta), t)
        assert meta.offset_bytes % 256 == 0
    assert ps.checkpoints()["c"]["num_tensors"] == 4


def test_register_twice_and_unknown_unregister(ps):
    ps.register_checkpoint("c", named_tensors={"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="'c' is already registered"):
        ps.register_checkpoint("c", named_tensors={"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="'zz' is not registered"):
        ps.unregister_checkpoint("zz")


def test_duplicate_names_between_sources(ps, tmp_path):
    save_file({"x": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"x": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(ValueError, match="duplicate tensor name 'x'"):
        ps.register_checkpoint("c", files=[str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")])
    with pytest.raises(ValueError, match="duplicate tensor name 'x'.*named_tensors"):
        ps.register_checkpoint("d", files=[str(tmp_path / "a.safetensors")], named_tensors={"x": torch.zeros(1)})


def test_missing_file(ps, tmp_path):
    with pytest.raises(ValueError, match="checkpoint file not found: .*nope.safetensors"):
        ps.register_checkpoint("c", files=[str(tmp_path / "nope.safetensors")])


def _write_raw(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize(
    "case,match",
    [
        ("short", "shorter than 8 bytes"),
        ("huge_header", "corrupt safetensors header length"),
        ("not_json", "corrupt safetensors header"),
        ("truncated", "truncated or corrupt"),
        ("bad_dtype", "unsupported safetensors dtype 'C64'"),
    ],
)
def test_corrupt_files(tmp_path, case, match):
    p = tmp_path / "bad.safetensors"
    if case == "short":
        p.write_bytes(b"abc")
    elif case == "huge_header":
        p.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    elif case == "not_json":
        _write_raw(p, b"{not json")
    elif case == "truncated":
        _write_raw(p, json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(), b"\0" * 8)
    else:
        _write_raw(p, json.dumps({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode(), b"\0" * 8)
    with pytest.raises(ValueError, match=match):
        read_safetensors_index(str(p))


def test_unsupported_dtype_named(ps):
    with pytest.raises(ValueError, match="tensor 'z'.*unsupported dtype"):
        ps.register_checkpoint("c", named_tensors={"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="not a torch.Tensor"):
        ps.register_checkpoint("c", named_tensors={"z": [1, 2]})


def test_update_errors_before_gather_and_unknown(ps):
    with pytest.raises(ValueError, match="unknown checkpoint 'nope': nothing is registered"):
        ps.update("nope", lambda paths: None)
    ps.register_checkpoint("c", named_tensors={"x": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"call gather_metas\('c'\)"):
        ps.update("c", lambda paths: None)
    ps.gather_metas("other")  # the join flow: a name no rank registered is allowed, it has no owners
    with pytest.raises(ValueError, match="no rank owns 'other'"):
        ps.update("other", lambda paths: None)
    ps.gather_metas("c")
    with pytest.raises(ValueError, match="ranks must be distinct ints in"):
        ps.update("c", lambda paths: None, ranks=[0, 0])
    with pytest.raises(ValueError, match="ranks must be distinct ints in"):
        ps.update("c", lambda paths: None, ranks=[3])
    with pytest.raises(ValueError, match="req_func must be a callable"):
        ps.update("c", None)


def test_metas_roundtrip_and_validation(ps):
    ps.register_checkpoint("c", named_tensors={"x": torch.zeros(2), "y": torch.ones(3, dtype=torch.int8)})
    ps.gather_metas("c")
    metas = ps.get_metas()
    assert json.loads(json.dumps(metas)) == metas  # JSON-ready, no pickle needed
    ps.load_metas(metas)
    with pytest.raises(ValueError, match="malformed metas"):
        ps.load_metas({"checkpoint": "c"})
    # another job's world of another size (a trainer's) is taken: its owners are named by pid and host
    ps.load_metas(dict(metas, device_ids=["a", "b"], pids=[1, 2], hosts=["h", "h"]))
    # ... but not metas whose owner is no rank of the world they describe and has no pid or host of its own
    orphan = dict(metas, device_ids=["a", "b"], pids=[1, 2], hosts=["h", "h"], owner_pids={}, owner_hosts={})
    orphan["ranks"] = {"5": metas["ranks"]["0"]}
    with pytest.raises(ValueError, match="describe 2 ranks but this world has 1"):
        ps.load_metas(orphan)


def test_rank_validation():
    with pytest.raises(ValueError, match="rank must be in"):
        ParameterServer(rank=2, world_size=2, config=ParameterServerConfig(transport="cpu"))


@pytest.mark.parametrize("reuse", [False, True])
def test_reuse_host_memory_hands_freed_chunks_to_the_next_registration(reuse):
    ps = ParameterServer(rank=0, world_size=1, config=ParameterServerConfig(transport="cpu", reuse_host_memory=reuse))
    try:
        shapes = {"w": (64, 32), "b": (32,)}
        ps.register_checkpoint("v1", named_tensors={n: torch.zeros(s) for n, s in shapes.items()})

        def identities(name):  # the memfd behind each chunk (addresses and fd numbers get reused)
            return [os.fstat(c.handle.fd).st_ino for c in ps._checkpoints[name].chunks]

        ptrs = identities("v1")
        ps.unregister_checkpoint("v1")
        assert ps._host_pool.free_bytes == (sum(ps._host_pool._free) if reuse else 0)
        new = {n: torch.full(s, 2.0) for n, s in shapes.items()}
        ps.register_checkpoint("v2", named_tensors=new)
        ck = ps._checkpoints["v2"]
        assert (identities("v2") == ptrs) is reuse
        assert ps._host_pool.num_reused == (len(ptrs) if reuse else 0)
        for m in ck.layout.metas:
            assert torch.equal(ck.view(m), new[m.name])  # the reused bytes hold the new checkpoint
        ps.unregister_checkpoint("v2")
        ps.register_checkpoint("other", named_tensors={"z": torch.ones(7)})  # other sizes: nothing to reuse
        assert ps._host_pool.free_bytes == 0  # the registration freed what it did not reuse
    finally:
        ps.close()


@pytest.mark.parametrize("reader", ["rank", "engine"])
def test_pull_hint_lists_the_checkpoint_tensors_for_engines_that_read_the_owners(reader):
    """Owners on this rank only: no peers to connect to; the tensors only when the engine reads."""
    cfg = ParameterServerConfig(transport="cpu", update=UpdateConfig(p2p_reader=reader))
    ps = ParameterServer(rank=0, world_size=1, config=cfg)
    try:
        assert ps.pull_hint("c") == PullHint()  # no metas gathered
        ps.register_checkpoint("c", named_tensors={"w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(4)})
        ps.gather_metas("c")
        hint = ps.pull_hint("c")
        assert hint.peers == ()
        expected = {("w", "bfloat16", (3, 4)), ("b", "float32", (4,))} if reader == "engine" else set()
        assert set(hint.tensors) == expected and len(hint.tensors) == len(expected)
    finally:
        ps.close()
