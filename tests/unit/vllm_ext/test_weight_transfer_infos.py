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
