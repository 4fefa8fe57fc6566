"""The engine pool's scheduling, requeue and healing, with scripted engines (no vLLM); its pure helpers."""

from __future__ import annotations

import threading
import time

import pytest

from ckpt_common.httpjson import HTTPError
from orchestrator.config import EngineConfig
from orchestrator.engine_pool.base import GenRequest, GenResult, PartialGeneration, SamplingSettings, continuation
from orchestrator.engine_pool.pool import EnginePool
from orchestrator.engine_pool.pool_members import Member
from orchestrator.engine_pool.pool_servers import cpu_binds, launch_command

SAMPLING = SamplingSettings()


class ScriptedEngine:
    """Answers each request with one token (its prompt length); ``hold`` keeps requests in flight until
    set; ``kill()`` makes every request in flight and later fail like a dead server."""

    def __init__(
        self,
        name: str,
        *,
        hold: bool = False,
        reject: bool = False,
        fail_alive: bool = False,
        break_off: tuple[int, ...] | None = None,
    ) -> None:
        self.name = name
        self.break_off = break_off  # killed: streams break off after these tokens (the first request finished)
        self.requests: list[GenRequest] = []
        self.alive = True
        self.reject = reject
        self.fail_alive = fail_alive
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.lock = threading.Lock()
        self.inflight = 0
        self.max_inflight = 0
        self.served: list[str] = []
        self.calls: list[list[str]] = []

    def generate(self, requests, sampling, *, repeat=None, on_result=None, timeout_s=900.0):
        with self.lock:
            self.calls.append([r.request_id for r in requests])
            self.requests += requests
            self.inflight += len(requests)
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            # held past the caller's deadline: time out as an HTTP client does (answering then would race
            # the pool's own deadline, which the deadline test checks)
            deadline = time.monotonic() + timeout_s
            while not self.release.wait(0.01):
                if not self.alive:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"POST http://{self.name}/v1/completions timed out after {timeout_s:.0f} s")
            if self.reject:
                raise HTTPError("POST", f"http://{self.name}/v1/completions", 400, "prompt too long")
            if not self.alive and self.break_off is not None:
                cause = ConnectionError("the stream ended before its [DONE] event")
                first = self.calls[0][0]
                finished = [GenResult(r.request_id, (99,), "stop") for r in requests if r.request_id == first]
                partial = {r.request_id: self.break_off for r in requests if r.request_id != first}
                raise PartialGeneration(cause, finished, partial)
            if not self.alive:
                raise RuntimeError(f"POST http://{self.name}/v1/completions failed: ConnectionRefusedError")
            if self.fail_alive:
                raise RuntimeError(f"POST http://{self.name}/v1/completions answered HTTP 500")
            with self.lock:
                self.served += [r.request_id for r in requests]
            return [GenResult(r.request_id, (len(r.prompt_token_ids),), "stop") for r in requests]
        finally:
            with self.lock:
                self.inflight -= len(requests)

    def answers(self) -> bool:
        return self.alive

    def kill(self) -> None:
        self.alive = False

    def weight_req_func(self, timeout_s, weight_version=None):
        raise NotImplementedError

    def close(self) -> None:
        pass


def _requests(n: int, prefix: str = "r") -> list[GenRequest]:
    return [GenRequest(f"{prefix}{i}", (1,) * (i + 1), 8) for i in range(n)]


def _wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def pools():
    made = []

    def make(engines, **kwargs):
        pool = EnginePool([Member(i, engine=e) for i, e in enumerate(engines)], watch_interval_s=0.05, **kwargs)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def test_cpu_binds_share_the_cpus():
    assert cpu_binds([0, 1], 1) == ["0,1"]
    assert cpu_binds([0, 1], 2) == ["0", "1"]
    assert cpu_binds([1, 0, 3, 2, 4], 2) == ["0,1,2", "3,4"]
    assert cpu_binds([0, 1], 3) == ["0", "1", "0"]  # fewer CPUs than engines: shared round-robin
    with pytest.raises(ValueError, match="1 CPU"):
        cpu_binds([], 2)


def test_launch_command_is_the_gated_launcher_with_the_engine_settings(tmp_path):
    from vllm_ext.launch import build_parser

    config = EngineConfig(num_engines=2, max_model_len=192, enable_prefix_caching=False)
    cmd = launch_command(str(tmp_path), config, 4321)
    assert cmd[1:3] == ["-m", "vllm_ext.launch"]
    args = build_parser().parse_args(cmd[3:])  # every launcher flag exists
    assert args.initial_push is False and args.host == "127.0.0.1" and args.port == 4321
    vllm_args = args.vllm_args[1:]
    assert vllm_args[vllm_args.index("--max-model-len") + 1] == "192"
    assert "--no-enable-prefix-caching" in vllm_args
    assert "--enforce-eager" not in vllm_args  # compiled unless asked
    eager = build_parser().parse_args(launch_command(str(tmp_path), EngineConfig(enforce_eager=True), 1)[3:])
    assert "--enforce-eager" in eager.vllm_args


def test_config_validates_enforce_eager():
    with pytest.raises(ValueError, match=r"engine.enforce_eager='yes' must be true or false"):
        EngineConfig(enforce_eager="yes")


def test_config_validates_num_engines():
    assert EngineConfig().num_engines == 1
    with pytest.raises(ValueError, match=r"engine.num_engines=0 must be an int >= 1"):
        EngineConfig(num_engines=0)
    with pytest.raises(ValueError, match="engine.num_engines=2 starts its own vLLM servers"):
        EngineConfig(type="vllm_http", endpoint="http://127.0.0.1:1", num_engines=2)


def test_requests_go_to_the_engine_with_the_fewest_in_flight(pools):
    a, b = ScriptedEngine("a", hold=True), ScriptedEngine("b", hold=True)
    pool = pools([a, b])
    seen = []
    done = threading.Thread(target=lambda: seen.extend(pool.generate(_requests(6), SAMPLING, on_result=seen.append)))
    done.start()
    _wait(lambda: a.inflight + b.inflight == 6)
    assert (a.inflight, b.inflight) == (3, 3)
    a.release.set()
    b.release.set()
    done.join(timeout=10)
    assert not done.is_alive()
    assert pool.metrics()["engine_requests"] == {"engine0": 3, "engine1": 3}
    assert len(seen) == 12  # 6 callbacks + 6 results appended after the call


def test_in_flight_cap_and_order_of_results(pools):
    a = ScriptedEngine("a")
    pool = pools([a], max_inflight_per_engine=2)
    results = pool.generate(_requests(20), SAMPLING)
    assert [r.request_id for r in results] == [f"r{i}" for i in range(20)]
    assert [r.token_ids for r in results] == [(i + 1,) for i in range(20)]
    assert a.max_inflight <= 2


def test_a_dead_engines_requests_are_requeued_to_the_others(pools):
    fast, doomed = ScriptedEngine("fast"), ScriptedEngine("doomed", hold=True)
    pool = pools([fast, doomed], max_inflight_per_engine=4)
    called: list[str] = []
    out: list = []
    record = lambda r: called.append(r.request_id)
    worker = threading.Thread(target=lambda: out.extend(pool.generate(_requests(30), SAMPLING, on_result=record)))
    worker.start()
    _wait(lambda: doomed.inflight == 4)
    doomed.kill()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert sorted(r.request_id for r in out) == sorted(f"r{i}" for i in range(30))
    assert sorted(called) == sorted(f"r{i}" for i in range(30))  # one callback per request, none twice
    metrics = pool.metrics()
    assert metrics["engine_failures"] == 1 and metrics["requests_requeued"] == 4
    assert metrics["engine_requests"] == {"engine0": 30, "engine1": 0}
    assert metrics["engine_states"]["engine1"] == "down"  # no healer: it stays down
    assert len(fast.served) == 30


def test_a_broken_off_batch_keeps_its_tokens_and_continues_on_another_engine(pools):
    fast, doomed = ScriptedEngine("fast"), ScriptedEngine("doomed", hold=True, break_off=(7, 8))
    pool = pools([fast, doomed], max_inflight_per_engine=4)
    requests = {r.request_id: r for r in _requests(30)}
    called: list = []
    out: list = []
    worker = threading.Thread(
        target=lambda: out.extend(pool.generate(list(requests.values()), SAMPLING, on_result=called.append))
    )
    worker.start()
    _wait(lambda: doomed.inflight == 4)
    doomed.kill()
    worker.join(timeout=10)
    assert not worker.is_alive()
    results = {r.request_id: r for r in out}
    assert sorted(results) == sorted(requests) and sorted(r.request_id for r in called) == sorted(requests)
    finished, *broken = [ids[0] for ids in doomed.calls]
    assert results[finished].token_ids == (99,)  # ended before the break: delivered as it was
    continued = {r.request_id: r for r in fast.requests if r.request_id in broken}
    for rid in broken:
        original = requests[rid]
        assert continued[rid] == continuation(original, (7, 8))  # the kept tokens are in its prompt
        assert continued[rid].max_tokens == original.max_tokens - 2
        # the result carries the kept tokens, then what the other engine generated after them
        assert results[rid].token_ids == (7, 8, len(original.prompt_token_ids) + 2)
    metrics = pool.metrics()
    assert metrics["requests_requeued"] == 3 and metrics["tokens_kept_on_requeue"] == 6
    assert metrics["engine_failures"] == 1


@pytest.mark.parametrize(
    ("kept", "prompt", "max_tokens", "earlier"),
    [
        ((), (1, 2), 8, (5,)),  # nothing kept: the request itself
        ((3,), (1, 2, 3), 7, (5, 3)),
        ((3, 4, 6), (1, 2, 3, 4, 6), 5, (5, 3, 4, 6)),
    ],
)
def test_continuation(kept, prompt, max_tokens, earlier):
    request = GenRequest("r", (1, 2), 8, (5,))
    assert continuation(request, kept) == GenRequest("r", prompt, max_tokens, earlier)


def test_continuation_needs_a_token_left():
    with pytest.raises(ValueError, match="none of max_tokens"):
        continuation(GenRequest("r", (1,), 2), (3, 4))


def test_a_healed_engine_rejoins_and_takes_requests(pools):
    first, second = ScriptedEngine("a"), ScriptedEngine("b", hold=True)
    replacement = ScriptedEngine("b2")

    def restart(member):
        time.sleep(0.2)  # a restart takes time; the other engine keeps generating meanwhile
        member.engine = replacement

    pool = pools([first, second], restart=restart)
    worker = threading.Thread(target=lambda: pool.generate(_requests(40), SAMPLING))
    worker.start()
    _wait(lambda: second.inflight > 0)
    second.kill()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert pool.wait_serving(10)
    metrics = pool.metrics()
    assert metrics["engine_failures"] == 1 and metrics["engine_recoveries"] == 1
    assert 0.2 <= metrics["recovery_s"][0] < 10
    pool.generate(_requests(10, "s"), SAMPLING)
    assert replacement.served, "the healed engine takes requests again"


def test_the_pool_notices_a_dead_server_without_requests(pools):
    class Server:
        proc = type("P", (), {"returncode": -9})()

        port = 0

        def exited(self):
            return True

        def signal_stop(self):
            pass

        def stop(self, grace_s):
            return -9

    pool = pools([ScriptedEngine("a")])
    pool.members[0].server = Server()  # as if its process had exited
    _wait(lambda: pool.metrics()["engine_failures"] == 1)


def test_a_rejected_request_fails_the_call_and_no_engine_goes_down(pools):
    pool = pools([ScriptedEngine("a", reject=True), ScriptedEngine("b", reject=True)])
    with pytest.raises(HTTPError, match="prompt too long"):
        pool.generate(_requests(3), SAMPLING)
    assert pool.metrics()["engine_failures"] == 0


def test_a_request_failing_on_live_engines_is_retried_then_fails(pools):
    pool = pools([ScriptedEngine("a", fail_alive=True)])
    with pytest.raises(RuntimeError, match="failed 3 times on engines that still answer"):
        pool.generate(_requests(1), SAMPLING)
    assert pool.metrics()["engine_failures"] == 0


def test_every_engine_down_without_healing_is_an_error(pools):
    a = ScriptedEngine("a")
    a.kill()
    pool = pools([a])
    with pytest.raises(RuntimeError, match="every engine is down.*engine0: down"):
        pool.generate(_requests(2), SAMPLING, timeout_s=30)


def test_deadline_is_bounded(pools):
    engine = ScriptedEngine("a", hold=True)
    pool = pools([engine])
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 1 s"):
        pool.generate(_requests(2), SAMPLING, timeout_s=1.0)
    assert time.monotonic() - start < 5
    engine.release.set()


def test_a_pool_has_no_single_req_func(pools):
    with pytest.raises(TypeError, match="PoolWeightSync"):
        pools([ScriptedEngine("a")]).weight_req_func(10.0)


def test_a_run_saved_before_engine_pools_still_resumes():
    from ckpt_common.dictconfig import to_dict
    from orchestrator.config import load_config
    from orchestrator.loop_setup import check_resumable

    current = to_dict(load_config(None))
    saved = {**current, "engine": {k: v for k, v in current["engine"].items() if k not in ("num_engines", "self_heal")}}
    check_resumable(saved, current)
    with pytest.raises(ValueError, match="engine.num_engines"):
        check_resumable(saved, to_dict(load_config(None, ["engine.num_engines=2"])))


def test_batches_share_max_tokens_and_spread_over_engines(pools):
    a, b = ScriptedEngine("a"), ScriptedEngine("b")
    pool = pools([a, b], batch_size=4)
    requests = [GenRequest(f"r{i}", (1,) * (i + 1), 8 if i % 3 else 5) for i in range(20)]
    results = pool.generate(requests, SAMPLING)
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    assert [r.token_ids for r in results] == [(i + 1,) for i in range(20)]
    max_tokens = {r.request_id: r.max_tokens for r in requests}
    calls = a.calls + b.calls
    assert all(len(c) <= 4 and len({max_tokens[i] for i in c}) == 1 for c in calls), calls
    assert sorted(i for c in calls for i in c) == sorted(max_tokens)
    assert a.calls and b.calls
    small = pools([ScriptedEngine("c"), ScriptedEngine("d")], batch_size=32)
    small.generate(_requests(4), SAMPLING)  # a short queue still goes to both engines
    assert [len(m.engine.calls) for m in small.members] == [1, 1]
