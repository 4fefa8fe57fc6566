"""The compat surface for MoonshotAI checkpoint-engine users: top-level names, the worker shim,
the update route's req_func. `import checkpoint_engine` must stay light (no torch, no vLLM)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
QUALNAME = "checkpoint_engine.worker.VllmColocateWorkerExtension"  # what users pass to --worker-extension-cls


def _run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_is_light_and_names_resolve_without_vllm():
    res = _run(
        "import json, sys, time\n"
        "t0 = time.perf_counter(); import checkpoint_engine as ce; dt = time.perf_counter() - t0\n"
        "light = {'torch': 'torch' in sys.modules, 'vllm': 'vllm' in sys.modules}\n"
        "from checkpoint_engine import ParameterServer, request_inference_to_update\n"
        "from checkpoint_engine import update_weights_from_ipc, P2PStore\n"
        "from checkpoint_engine.worker import VllmColocateWorkerExtension as W\n"
        "import vllm_ext.worker\n"
        "print(json.dumps({'dt': dt, 'light': light, 'vllm_after': 'vllm' in sys.modules,\n"
        "  'same': W is vllm_ext.worker.VllmColocateWorkerExtension is ce.VllmColocateWorkerExtension,\n"
        "  'all': sorted(ce.__all__), 'resolved': [n for n in ce.__all__ if getattr(ce, n, None) is not None],\n"
        "  'version': ce.__version__}))"
    )
    assert res["light"] == {"torch": False, "vllm": False}, res
    assert res["dt"] < 1.0
    assert res["vllm_after"] is False  # resolving every name, the vLLM extension included, imports no vLLM
    assert res["same"] is True
    assert set(res["all"]) >= {
        "ParameterServer",
        "request_inference_to_update",
        "update_weights_from_ipc",
        "VllmColocateWorkerExtension",
        "P2PStore",
        "__version__",
    }
    assert res["resolved"] == [n for n in res["all"]]
    assert res["version"].count(".") == 2


def test_worker_extension_resolves_as_vllm_does():
    """vLLM 0.32's resolve_obj_by_qualname: importlib.import_module(module) then getattr(module, name)."""
    import importlib

    import checkpoint_engine
    from checkpoint_engine import worker

    module_name, obj_name = QUALNAME.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_name), obj_name)
    params = list(inspect.signature(cls.update_weights_from_ipc).parameters)
    assert params == ["self", "zmq_handles"]  # what request_inference_to_update's collective_rpc sends
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        worker.nope  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        checkpoint_engine.nope  # noqa: B018
    assert "ParameterServer" in dir(checkpoint_engine)


def test_request_inference_to_update_keeps_their_signature():
    from checkpoint_engine import request_inference_to_update

    sig = inspect.signature(request_inference_to_update)
    assert list(sig.parameters) == ["url", "socket_paths", "timeout", "uds"]
    assert sig.parameters["timeout"].default == 300.0 and sig.parameters["uds"].default is None


@pytest.mark.parametrize(
    "url, rank, group, paths_sent",
    [
        ("http://e/collective_rpc", 0, [0, 1], {"d0": "ipc://0", "d1": "ipc://1"}),  # first rank sends the group
        ("http://e/collective_rpc", 1, [0, 1], None),  # others send nothing
        ("http://e/collective_rpc", 2, [3, 2], {"d3": "ipc://3", "d2": "ipc://2"}),  # min rank sends, order kept
        (None, 0, [0, 1], None),  # update_url None: no engine request
    ],
)
def test_group_req_func_selects_sender_and_socket_paths(monkeypatch, url, rank, group, paths_sent):
    from checkpoint_engine import api

    sent = []
    monkeypatch.setattr(
        api, "request_inference_to_update", lambda u, paths, timeout, uds: sent.append((u, paths, timeout, uds))
    )
    api.group_req_func(url, rank=rank, group_ranks=group, timeout_s=12.0, uds="/s")(
        [(f"d{i}", f"ipc://{i}") for i in range(4)]
    )
    assert sent == ([] if paths_sent is None else [(url, paths_sent, 12.0, "/s")])


def test_group_req_func_rejects_ranks_outside_the_job():
    from checkpoint_engine import api

    with pytest.raises(ValueError, match="at least one rank"):
        api.group_req_func("http://e", rank=0, group_ranks=[])
    with pytest.raises(ValueError, match=r"\[5\] are outside the 2 ranks"):
        api.group_req_func("http://e", rank=0, group_ranks=[0, 5])([("a", "x"), ("b", "y")])
