"""vllm_ext.weight_transfer.infos: the checkpoint_engine backend's init/update infos (errors name the field), and
the plug-in module staying light until vLLM registers it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ext.weight_transfer.infos import NativeInitInfo, NativeUpdateInfo

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "d, want",
    [
        ({"zmq_handles": {"cpu-0": "ipc:///tmp/a"}}, {"cpu-0": "ipc:///tmp/a"}),
        ({"zmq_handles": {"u0": "ipc:///a", "u1": "ipc:///b"}}, {"u0": "ipc:///a", "u1": "ipc:///b"}),
    ],
)
def test_update_info_parses(d, want):
    info = NativeUpdateInfo.from_dict(d)
    assert info.zmq_handles == want
    assert NativeUpdateInfo.from_dict(info.to_dict()) == info  # what the PS side builds, the engine reads


@pytest.mark.parametrize(
    "d, fragment",
    [
        ({}, "update_info.zmq_handles is required"),
        ([], "update_info must be a JSON object"),
        ("ipc:///a", "update_info must be a JSON object"),
        ({"zmq_handles": {}}, "update_info.zmq_handles must be a non-empty"),
        ({"zmq_handles": ["ipc:///a"]}, "update_info.zmq_handles must be a non-empty"),
        ({"zmq_handles": {"cpu-0": ""}}, "update_info.zmq_handles['cpu-0'] must map"),
        ({"zmq_handles": {"cpu-0": 5}}, "update_info.zmq_handles['cpu-0'] must map"),
        ({"zmq_handles": {"a": "ipc:///a"}, "names": []}, "unknown field(s) ['names']"),
    ],
)
def test_update_info_errors_name_the_field(d, fragment):
    with pytest.raises(ValueError) as e:
        NativeUpdateInfo.from_dict(d)
    assert fragment in str(e.value)


def test_init_info_is_empty_and_refuses_fields():
    assert NativeInitInfo.from_dict({}) == NativeInitInfo()
    assert NativeInitInfo().to_dict() == {}
    with pytest.raises(ValueError, match=r"init_info has unknown field\(s\) \['master_address'\].*checkpoint_engine"):
        NativeInitInfo.from_dict({"master_address": "127.0.0.1"})
    with pytest.raises(ValueError, match="init_info must be a JSON object"):
        NativeInitInfo.from_dict(None)


def test_plugin_and_infos_import_no_vllm_or_torch():
    code = (
        "import json, sys\n"
        "import vllm_ext.weight_transfer.plugin, vllm_ext.weight_transfer.infos\n"
        "print(json.dumps({m: m in sys.modules for m in ('vllm', 'torch', 'vllm_ext.weight_transfer.engine')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "vllm": False,
        "torch": False,
        "vllm_ext.weight_transfer.engine": False,
    }


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"rank": 0, "world_size": 0}, "world_size must be an integer >= 1, got 0"),
        ({"rank": -1}, "rank must be an integer >= 0, got -1"),
        ({"rank": 0, "source_layout": "sharded"}, "source_layout must be one of ['replicated', 'distinct']"),
        ({"rank": 0, "transport": "rdma"}, "transport must be 'auto', 'cpu' or 'cuda', got 'rdma'"),
    ],
)
def test_trainer_init_info_errors_name_the_field(kw, fragment):
    from vllm_ext.weight_transfer.trainer import CheckpointEngineTrainerInitInfo

    with pytest.raises(ValueError) as e:
        CheckpointEngineTrainerInitInfo(**kw)
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "layout, rank, want",
    [
        ("replicated", 0, ["a", "e", "d"]),  # positions 0, 2, 4 of the iteration (not of the sorted names)
        ("replicated", 1, ["c", "b"]),
        ("distinct", 1, ["a", "c", "e", "b", "d"]),  # the rank's own source: all of it
    ],
)
def test_each_trainer_rank_registers_its_share_of_the_source(layout, rank, want):
    from types import SimpleNamespace

    import torch

    from vllm_ext.weight_transfer.trainer import CheckpointEngineTrainerEngine, CheckpointEngineTrainerInitInfo

    source = [(n, torch.full((2,), float(i))) for i, n in enumerate("acebd")]
    info = CheckpointEngineTrainerInitInfo(rank=rank, world_size=2, source_layout=layout)
    share = CheckpointEngineTrainerEngine._share(SimpleNamespace(source=source, init_info=info))
    assert list(share) == want
    assert all(torch.equal(share[n], t) for n, t in source if n in share)


def test_a_rank_past_world_size_only_iterates_its_source_and_named_tensors_feed_vllms_source_api():
    import torch

    from vllm_ext.weight_transfer.trainer import (
        CheckpointEngineTrainerEngine,
        CheckpointEngineTrainerInitInfo,
        NamedTensorsSource,
    )

    calls = []

    def named_tensors():  # a Megatron TP rank > 0: writes its slices (collective), yields nothing
        calls.append(1)
        return {}

    info = CheckpointEngineTrainerInitInfo(rank=1, world_size=1, source_layout="distinct")
    engine = CheckpointEngineTrainerEngine(info, client=None, source=NamedTensorsSource(named_tensors))
    assert engine.ps is None and not engine.is_sender
    engine.send_weights()
    engine.send_weights()
    engine.shutdown()
    assert len(calls) == 2  # one iteration (one collective) per round

    weights = {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    source = NamedTensorsSource(lambda: weights)
    assert [(m.name, m.dtype, m.shape) for m in source.metadata()] == [
        ("a", torch.float32, (2, 3)),
        ("b", torch.bfloat16, (4,)),
    ]
    assert [(n, t is weights[n]) for n, t in source] == [("a", True), ("b", True)]
