import time

import pytest
import torch

from checkpoint_engine.config import ParameterServerConfig
from checkpoint_engine.metadata import CheckpointRegistry, InMemoryStore, make_store
from checkpoint_engine.ps import ParameterServer


def test_in_memory_store_ttl_and_prefix():
    s = InMemoryStore()
    s.put("a/1", "x")
    s.put("a/2", "y", ttl_s=0.05)
    s.put("b/1", "z")
    assert s.get_prefix("a/") == {"a/1": "x", "a/2": "y"}
    time.sleep(0.1)  # let the TTL pass
    assert s.get("a/2") is None and s.get_prefix("a/") == {"a/1": "x"}
    s.delete("a/1")
    assert s.get("a/1") is None


@pytest.mark.parametrize("url,match", [("redis://x", "memory:// or etcd://"), ("etcd://", "memory:// or etcd://")])
def test_make_store_rejects_bad_urls(url, match):
    with pytest.raises(ValueError, match=match):
        make_store(url)


def test_ps_publishes_metas_and_updates_and_another_instance_loads_them():
    store = InMemoryStore()
    cfg = ParameterServerConfig(transport="cpu")
    a = ParameterServer(rank=0, world_size=1, config=cfg, metadata_store=store)
    a.register_checkpoint("m", named_tensors={"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.int8)})
    a.gather_metas("m")
    reg = CheckpointRegistry(store)
    assert reg.checkpoints() == ["m"] and reg.metas("m") == a.get_metas("m")
    b = ParameterServer(rank=0, world_size=1, config=cfg, metadata_store=store)
    b.load_metas_from_store("m")
    assert b.get_metas("m") == a.get_metas("m")
    with pytest.raises(ValueError, match=r"no metas for 'zz' in the metadata store \(it has: \['m'\]\)"):
        b.load_metas_from_store("zz")
    with pytest.raises(RuntimeError):  # the update fails: req_func raised ConnectionError
        a.update("m", lambda paths: (_ for _ in ()).throw(ConnectionError("down")), timeout=5)
    assert reg.in_flight() == {}  # the op record is removed even when the update fails
    assert store.get("checkpoints/m/last_update") is None
    a.unregister_checkpoint("m")
    assert reg.checkpoints() == []
    a.close()
    b.close()
