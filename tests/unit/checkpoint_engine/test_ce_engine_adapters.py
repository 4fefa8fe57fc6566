"""The engine adapter registry (checkpoint_engine.engines.adapters): the daemon's update request into a
served engine comes from the adapter its entry point registered (vLLM's), and without one only the
extension route works."""

from __future__ import annotations

import pytest

from checkpoint_engine.engines import adapters
from checkpoint_engine.errors import CheckpointEngineError


@pytest.fixture
def no_adapter():
    previous = adapters.register_engine_req_func(None)
    yield
    adapters.register_engine_req_func(previous)


def _ask(route: str):
    def extension(socket_paths):  # the daemon's own /collective_rpc request
        return None

    req = adapters.engine_req_func(
        "http://e",
        route=route,
        rank=1,
        ranks_per_engine=2,
        timeout_s=5.0,
        weight_version="v1",
        pause_mode="keep",
        extension=extension,
    )
    return req, extension


def test_without_an_adapter_the_extension_route_is_the_daemons_own_request_and_the_others_refuse(no_adapter):
    req, extension = _ask("extension")
    assert req is extension
    for route in ("auto", "native"):
        req, _ = _ask(route)  # built (an update's check phase), refused when it runs
        with pytest.raises(CheckpointEngineError, match=f"route '{route}' into http://e needs an engine adapter"):
            req([("uuid", "ipc://x")])


def test_the_registered_adapter_makes_the_request_from_every_argument(no_adapter):
    asked = []

    def factory(endpoint, **kwargs):
        asked.append((endpoint, kwargs))
        return "req"

    assert adapters.register_engine_req_func(factory) is None
    assert adapters.registered_engine_req_func() is factory
    req, extension = _ask("auto")
    assert req == "req"
    assert asked == [
        (
            "http://e",
            {
                "route": "auto",
                "rank": 1,
                "ranks_per_engine": 2,
                "timeout_s": 5.0,
                "weight_version": "v1",
                "pause_mode": "keep",
                "extension": extension,
            },
        )
    ]
    assert adapters.register_engine_req_func(None) is factory  # the replaced one comes back


def test_the_daemons_entry_point_registers_vllms_adapter_without_importing_vllm(no_adapter):
    import sys

    from checkpoint_engine.__main__ import register_engine_adapter
    from vllm_ext.weight_transfer.native_req import engine_req_func

    had_vllm = "vllm" in sys.modules
    register_engine_adapter()
    assert adapters.registered_engine_req_func() is engine_req_func
    assert had_vllm or "vllm" not in sys.modules
