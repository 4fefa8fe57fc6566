"""Global metadata in a real etcd server started by the fixture (apt etcd-server)."""

from __future__ import annotations

import shutil

import pytest
import torch

from checkpoint_engine.config import ParameterServerConfig
from checkpoint_engine.metadata import CheckpointRegistry, EtcdStore
from checkpoint_engine.ps import ParameterServer
from tests.integration.dist.harness import etcd_server

pytestmark = [pytest.mark.etcd, pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not installed")]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with etcd_server(tmp_path_factory.mktemp("etcd")) as port:
        yield port


def test_etcd_store_basic(etcd):
    s = EtcdStore("127.0.0.1", etcd, prefix="/t1")
    s.put("a/1", "x")
    s.put("a/2", "y", ttl_s=30)
    assert s.get("a/1") == "x" and s.get_prefix("a/") == {"a/1": "x", "a/2": "y"}
    s.delete("a/1")
    assert s.get("a/1") is None
    s.close()


def test_two_instances_share_metas_through_etcd(etcd):
    cfg = ParameterServerConfig(transport="cpu", metadata_url=f"etcd://127.0.0.1:{etcd}/ckpt")
    a = ParameterServer(rank=0, world_size=1, config=cfg)
    a.register_checkpoint("m", named_tensors={"w": torch.randn(4, 4)})
    a.gather_metas("m")
    b = ParameterServer(rank=0, world_size=1, config=cfg)
    b.load_metas_from_store("m")
    assert b.get_metas("m") == a.get_metas("m")
    assert CheckpointRegistry(b.registry.store).checkpoints() == ["m"]
    a.close()
    b.close()


def test_unreachable_etcd_is_a_clear_error():
    with pytest.raises(RuntimeError, match="etcd at 127.0.0.1:1 is not reachable"):
        EtcdStore("127.0.0.1", 1, timeout_s=1)
