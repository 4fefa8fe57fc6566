"""The `checkpoint_engine` load format's rendezvous, without vLLM: settings, requests, a real PS into a receiver.

The engine side (`serve_initial_load`, as vLLM's load step runs it) and the PS side
(`wait_for_loader`, `ps.update(..., loader_req_func(...))`) talk over real ZMQ ipc sockets; the
"model" is a dict the receiver's reload function copies into.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import zmq

from checkpoint_engine.errors import UpdateFailed
from checkpoint_engine.transport.load_rendezvous import (
    LoaderRendezvousError,
    loader_req_func,
    parse_request,
    serve_initial_load,
    wait_for_loader,
)
from vllm_ext.loader import LoaderSettings, missing_parameters
from vllm_ext.receiver import WeightReceiver
from vllm_ext.settings import ReceiverConfig
from vllm_ext.weight_cache import checkpoint_checksum
from vllm_ext.worker_handle import select_handle


def make_ckpt(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(64, 40 + i, generator=g) for i in range(10)}
    out["norm"] = torch.randn(33, generator=g).to(torch.bfloat16)
    return out


class Engine:
    """The engine side in a thread: a dict model, a receiver, serve_initial_load; keeps its outcome."""

    def __init__(self, address: str, timeout_s: float = 20.0, fail: bool = False):
        self.weights: dict[str, torch.Tensor] = {}
        self.fail = fail
        self.receiver = WeightReceiver(self._load, config=ReceiverConfig(timeout_s=20, reload_timeout_s=20))
        self.report: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(address, timeout_s), daemon=True)
        self.thread.start()

    def _load(self, pairs) -> None:
        for name, t in pairs:
            if self.fail:
                raise KeyError(f"no parameter named {name!r}")
            self.weights[name] = t.clone()

    def _run(self, address: str, timeout_s: float) -> None:
        try:
            self.report = serve_initial_load(
                address,
                lambda handles: self.receiver.receive(select_handle(handles, device_uuid=None, tp_rank=0), None),
                timeout_s=timeout_s,
            )
        except BaseException as e:  # noqa: BLE001 - checked by the test
            self.error = e

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive(), "serve_initial_load did not return"


@pytest.mark.parametrize(
    "settings, message",
    [
        ({}, "needs --model-loader-extra-config"),
        ({"rendezvous": "/tmp/x.sock"}, "ipc:// or tcp://"),
        ({"rendezvous": "ipc:///tmp/x.sock", "timeout_s": 0}, "timeout_s must be a number > 0"),
        ({"rendezvous": "ipc:///tmp/x.sock", "timeout_s": True}, "timeout_s must be a number > 0"),
        ({"rendezvous": "ipc:///tmp/x.sock", "p2p_host": ""}, "p2p_host must be a non-empty address"),
        ({"rendezvous": "ipc:///tmp/x.sock", "p2p_cpus": []}, "p2p_cpus must be a non-empty list"),
        ({"rendezvous": "ipc:///tmp/x.sock", "p2p_cpus": [0, -1]}, "p2p_cpus must be a non-empty list"),
        ({"rendezvous": "ipc:///tmp/x.sock", "p2p_cpus": "0-1"}, "p2p_cpus must be a non-empty list"),
        ({"rendezvous": "ipc:///tmp/x.sock", "p2p_cpus": [True]}, "p2p_cpus must be a non-empty list"),
        (
            {"rendezvous": "ipc:///tmp/x.sock", "timout_s": 5},
            "unknown checkpoint_engine loader setting(s) ['timout_s']",
        ),
    ],
)
def test_settings_name_what_is_wrong(settings, message):
    with pytest.raises(ValueError) as e:
        LoaderSettings.from_dict(settings)
    assert message in str(e.value)


def test_settings_address_per_tp_rank():
    s = LoaderSettings.from_dict({"rendezvous": "ipc:///tmp/load-{rank}.sock"})
    assert (s.address(0, 1), s.address(1, 2)) == ("ipc:///tmp/load-0.sock", "ipc:///tmp/load-1.sock")
    with pytest.raises(ValueError, match="placeholder"):
        LoaderSettings.from_dict({"rendezvous": "ipc:///tmp/load.sock"}).address(1, 2)


@pytest.mark.parametrize(
    "raw, ok",
    [
        (b'{"op": "hello"}', True),
        (b'{"op": "load", "zmq_handles": {"0": "ipc:///tmp/a"}}', True),
        (b'{"op": "load", "zmq_handles": {}}', False),
        (b'{"op": "load", "zmq_handles": {"0": 5}}', False),
        (b'{"op": "load"}', False),
        (b'{"op": "drop_tables"}', False),
        (b"[1, 2]", False),
        (b"\x80\x04\x95 pickle", False),
        (b'{"op": "hello", "pad": "' + b"x" * (1 << 20) + b'"}', False),
    ],
)
def test_parse_request_accepts_only_the_two_json_requests(raw, ok):
    if ok:
        assert parse_request(raw)["op"] in ("hello", "load")
    else:
        with pytest.raises(ValueError):
            parse_request(raw)


def test_missing_parameters():
    assert missing_parameters(["a", "b", "c"], {"a", "c", "extra"}) == ["b"]
    assert missing_parameters(["a"], {"a"}) == []


def registered(ps, name: str, seed: int) -> dict[str, torch.Tensor]:
    ckpt = make_ckpt(seed)
    ps.register_checkpoint(name, named_tensors=ckpt)
    ps.gather_metas(name)
    return ckpt


@pytest.fixture
def address(tmp_path) -> str:
    return f"ipc://{tmp_path}/load.sock"


def test_initial_load_through_the_rendezvous(ps, address):
    ckpt = registered(ps, "A", seed=1)
    engine = Engine(address)
    wait_for_loader(address, timeout_s=20)
    wait_for_loader(address, timeout_s=20)  # hellos may repeat (a retrying launcher)
    engine_report: dict = {}
    ps.update("A", loader_req_func(address, timeout_s=20, result=engine_report))
    engine.join()
    assert engine.error is None
    assert sorted(engine.weights) == sorted(ckpt)
    assert all(torch.equal(engine.weights[k], v) for k, v in ckpt.items())
    for rep in (engine.report, engine_report):
        assert (rep["version"], rep["status"], rep["checkpoint"]) == (1, "ready", "A")
    assert engine.receiver.checksum_report()["checksum"] == checkpoint_checksum(ckpt)


def test_bad_request_is_answered_and_the_loader_keeps_waiting(ps, address):
    registered(ps, "B", seed=2)
    engine = Engine(address)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(b"not json")
    assert sock.poll(20_000)
    answer = json.loads(sock.recv())
    sock.close()
    ctx.term()
    assert answer["ok"] is False and "not JSON" in answer["error"]
    ps.update("B", loader_req_func(address, timeout_s=20))
    engine.join()
    assert engine.error is None and engine.report["version"] == 1


def test_engine_side_failure_reaches_the_ps_and_fails_the_load(ps, address):
    registered(ps, "A", seed=1)
    engine = Engine(address, fail=True)
    with pytest.raises(UpdateFailed):
        ps.update("A", loader_req_func(address, timeout_s=20))
    engine.join()
    assert engine.error is not None and engine.report is None
    assert engine.receiver.report()["status"] == "incomplete"


def test_req_func_raises_the_engines_error(address):
    def refuse(handles):
        raise RuntimeError("the model has no parameter 'x'")

    result: dict = {}
    t = threading.Thread(
        target=lambda: result.setdefault("e", _catch(lambda: serve_initial_load(address, refuse, timeout_s=20))),
        daemon=True,
    )
    t.start()
    with pytest.raises(LoaderRendezvousError, match="the model has no parameter 'x'"):
        loader_req_func(address, timeout_s=20)([("0", "ipc:///nowhere")])
    t.join(20)
    assert isinstance(result["e"], RuntimeError)


def _catch(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    return None


def test_waits_have_deadlines(tmp_path):
    address = f"ipc://{tmp_path}/nobody.sock"
    t0 = time.monotonic()
    with pytest.raises(LoaderRendezvousError, match="did not answer 'hello' within 1 s"):
        wait_for_loader(address, timeout_s=1)
    with pytest.raises(LoaderRendezvousError, match="engine exited"):
        wait_for_loader(address, timeout_s=60, is_alive=lambda: False)
    with pytest.raises(TimeoutError, match="no parameter server sent the weights"):
        serve_initial_load(f"ipc://{tmp_path}/alone.sock", lambda h: {}, timeout_s=0.5)
    assert time.monotonic() - t0 < 10


class _AliveProcess:
    """Stands in for the vLLM process the launcher watches."""

    def poll(self):
        return None


def test_launcher_releases_its_host_copy_once_the_load_step_returns(ps, address, tmp_path):
    from vllm_ext.launch import Launcher
    from vllm_ext.launch_config import LaunchConfig

    ckpt = registered(ps, "A", seed=3)
    launcher = Launcher(LaunchConfig(model=str(tmp_path), checkpoint_name="A"))
    launcher._ps, launcher.rendezvous, launcher.proc = ps, address, _AliveProcess()
    done = threading.Thread(target=lambda: None)
    done.start()
    engine = Engine(address)
    launcher.load_into_engine(done)  # waits for the loader, updates it, releases the PS
    engine.join()
    assert launcher._load_error is None and engine.error is None
    assert launcher._ps is None, "the parameter server should be closed right after the load step"
    assert launcher.gate.snapshot()["phase"] == "finishing_engine_start"
    assert launcher._load_metrics["engine_version"] == 1
    assert all(torch.equal(engine.weights[k], v) for k, v in ckpt.items())  # the engine's copy outlives the PS
    launcher.release_ps()  # idempotent: close() calls it again
