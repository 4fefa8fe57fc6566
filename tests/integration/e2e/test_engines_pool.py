"""``engine.num_engines: 2``: the RL job on two vLLM servers, every version in both, a killed one healed.

One short run of the demo task (real vLLM servers on CPU, real checkpoint engine, the demo's SFT
model from the shared cache) with two engines:

    iteration 1: rollouts on both engines; v1 pushed into both (one update each)
    iteration 2: the vLLM server of engine1 is SIGKILLed while its requests stream tokens; they go
                 back to the queue with the tokens they got and engine0 continues them; the healer
                 restarts engine1 (new port, no dummy weights served: its gate stays closed), updates
                 it to the current version and puts it back, while engine0 keeps generating
    end: both engines report the newest checkpoint, hold the same weights (checksum) and answer the
         same greedy tokens for held-out prompts; metrics count one failure and one recovery

The job runs in this process so the test can look at the pool before it is closed (``KeepOpen``);
the servers are child processes, and the test checks they end with exit code 0 and leave nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
import time

import psutil
import pytest

from orchestrator.metrics_log import read_jsonl

# Two vLLM servers start at once (~45 s on an idle 2-core machine, 11 min seen under a load of 20+).
pytestmark = pytest.mark.timeout(1800)
# the orchestrator's default SFT, configs/demo.json's: trained in the background (tests/conftest.py)
SFT_WARMUP = ("tests.integration.e2e.test_rl_demo:demo_sft_config",)

REPO = pathlib.Path(__file__).resolve().parents[3]
DEMO = REPO / "configs" / "demo.json"
SFT_CACHE = REPO / ".cache" / "sft"
NUM_ITERATIONS = 5
KILL_IN_ITERATION = 2  # 1-based: the rollout during which engine1's vLLM server is killed
QUIET_S = 0.3  # engine1's server stopped: the client has read what it sent once nothing arrives for this long
OVERRIDES = [
    f"sft_cache_dir={SFT_CACHE}",
    "engine.num_engines=2",
    f"rl.num_iterations={NUM_ITERATIONS}",
    f"eval.every_iterations={NUM_ITERATIONS}",
    "eval.num_sampled_problems=0",
    "data.num_heldout_per_level=16",
    # small iterations; responses (about 30 tokens) span two segments, so requests carry earlier segments
    "rollout.iteration_token_budget=4096",
    "rollout.segment_max_tokens=16",
    "rollout.max_new_groups_per_iteration=16",
]


def _wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)  # polling the job's in-process state, under a deadline


def _wait_quiet(value, quiet_s: float, timeout_s: float = 60.0) -> None:
    """Until ``value()`` has not changed for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    last, since = value(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        if time.monotonic() > deadline:
            raise AssertionError(f"still changing after {timeout_s:.0f} s")
        time.sleep(0.01)
        if (now := value()) != last:
            last, since = now, time.monotonic()


@pytest.fixture(scope="module")
def healed_run(tmp_path_factory):
    """The run described above; yields (job, pool, summary, killed pids) and closes everything after."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from orchestrator.config import load_config
    from orchestrator.engine_pool.pool import EnginePool
    from orchestrator.loop import RLJob

    class KeepOpen(RLJob):
        def close(self) -> None:  # the test looks at the engines first, then closes the job
            pass

    out = tmp_path_factory.mktemp("engines") / "run"
    job = KeepOpen(load_config(DEMO, OVERRIDES), out, progress_bar=False)
    killed: dict = {}

    def kill_engine1_during_rollout() -> None:
        try:
            _wait_for(lambda: isinstance(job.engine, EnginePool), 900, "the engine pool")
            _wait_for(lambda: len(read_jsonl(out / "metrics.jsonl")) >= KILL_IN_ITERATION - 1, 900, "iteration 1")
            member = job.engine.members[1]
            launcher = psutil.Process(member.server.proc.pid)
            server = next(p for p in launcher.children() if "vllm" in " ".join(p.cmdline()))  # vLLM's API server
            killed["tree"] = [server, *server.children(recursive=True)]  # looked up before: the kill is at once
            # The kill must find requests that streamed tokens but have not finished, so they go back
            # to the queue with tokens to keep. The demo model's decode steps take a few ms, so instead
            # of racing them: stop the server (SIGSTOP, it sends nothing more), let the client read what
            # was sent, and kill it only if such tokens are there; otherwise let it go on and try again.
            engine = member.engine
            deadline, stops = time.monotonic() + 300, 0
            while True:
                stops += 1
                _wait_for(lambda: engine.tokens_unfinished > 0, 300, "streamed tokens on engine1", poll_s=0.001)
                server.suspend()
                _wait_quiet(lambda: engine.tokens_streamed, QUIET_S)
                if engine.tokens_unfinished > 0:
                    break
                server.resume()
                assert time.monotonic() < deadline, "no stop of engine1 found a request with streamed tokens"
            killed["in_flight"] = member.outstanding
            killed["tokens_unfinished"] = engine.tokens_unfinished
            killed["stops"] = stops
            os.kill(server.pid, signal.SIGKILL)
        except BaseException as e:  # noqa: BLE001 - reported by the test through `killed`
            killed["error"] = e

    killer = threading.Thread(target=kill_engine1_during_rollout, daemon=True)
    killer.start()
    try:
        start = time.monotonic()
        summary = job.run()
        run_s = time.monotonic() - start
        killer.join(timeout=60)
        assert "error" not in killed, killed.get("error")
        yield job, job.engine, summary, killed, run_s
    finally:
        pool = job.engine
        RLJob.close(job)
        if pool is not None:
            codes = [m.server.proc.returncode for m in pool.members]
            assert codes == [0, 0], f"engine launchers ended with {codes}"
            left = [p for m in pool.members for p in m.server.processes() if p.is_running()]
            left += [p for p in killed.get("tree", []) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            assert not left, f"engine processes outlived the job: {left}"


@pytest.mark.e2e
@pytest.mark.vllm
def test_two_engines_take_rollouts_and_every_version(healed_run):
    job, pool, summary, killed, run_s = healed_run
    records = read_jsonl(job.out / "metrics.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, NUM_ITERATIONS + 1))
    first = records[0]  # before the kill: both engines took rollouts and version 1
    assert min(first["rollout_engine_requests"].values()) > 0, first
    assert sum(first["rollout_engine_requests"].values()) == first["num_requests"], first
    assert set(first["weight_sync_engine_s"]) == {"engine0", "engine1"}
    for r in records:  # engine0 took every version; engine1 every one but those pushed while it was down
        assert "engine0" in r["weight_sync_engine_s"] and r["weight_sync_s"] > 0
    assert pool.wait_serving(300), pool.metrics()
    newest = f"policy-v{NUM_ITERATIONS}"
    from vllm_ext.extension_req import collective_rpc

    checksums = {}
    for name, endpoint in pool.endpoints().items():
        states = collective_rpc(endpoint, "weights_state")
        assert [s["checkpoint"] for s in states] == [newest], (name, states)
        checksums[name] = [c["checksum"] for c in collective_rpc(endpoint, "weights_checksum")]
    assert checksums["engine0"] == checksums["engine1"] and checksums["engine0"][0], checksums
    print(f"run of {NUM_ITERATIONS} iterations with 2 engines: {run_s:.0f} s; {json.dumps(pool.metrics())}")


@pytest.mark.e2e
@pytest.mark.vllm
def test_each_engine_core_runs_on_its_workers_cpus(healed_run):
    """vLLM leaves its engine core, which spins while its worker computes, free to run on any core;
    the launcher binds it to the worker's (vllm_ext.engine_core_cpus), the restarted engine's too, after
    forking both (vllm_ext.start_method)."""
    _, pool, _, _, _ = healed_run
    assert pool.wait_serving(300), pool.metrics()
    placed = {}
    for member in pool.members:
        procs = {p.name(): p for p in member.server.processes() if p.is_running()}
        core = next(p for name, p in procs.items() if "EngineCor" in name)  # comm names are cut at 15
        worker = next(p for name, p in procs.items() if "Worker" in name)
        placed[member.name] = (core.cpu_affinity(), worker.cpu_affinity())
        # forked from vLLM's API server (vllm_ext.start_method), not spawned: no re-import of vLLM; the
        # forked worker bound its own threads, as spawn's fresh process did through its environment
        forked = f"forked worker VllmWorker-0: threads on CPUs {tuple(worker.cpu_affinity())} (pid {worker.pid})"
        assert forked in member.server.log_path.read_text(errors="replace"), (forked, member.server.log_path)
    for core_cpus, worker_cpus in placed.values():
        assert core_cpus == worker_cpus, placed
        assert len(core_cpus) < len(os.sched_getaffinity(0)) or len(os.sched_getaffinity(0)) == 1, placed


@pytest.mark.e2e
@pytest.mark.vllm
def test_a_killed_engine_is_healed_while_the_other_generates(healed_run):
    from orchestrator.engine_pool.base import GenRequest, SamplingSettings

    job, pool, summary, killed, _ = healed_run
    assert killed["in_flight"] > 0 and killed["tokens_unfinished"] > 0, killed
    assert pool.wait_serving(300), pool.metrics()
    metrics = pool.metrics()
    assert metrics["engine_failures"] == 1, metrics
    assert metrics["engine_recoveries"] == 1 and 0 < metrics["recovery_s"][0] < 300, metrics
    assert metrics["requests_requeued"] >= 1, metrics
    # partial rollouts kept their tokens: every token streamed for an unfinished request at the kill
    assert metrics["tokens_kept_on_requeue"] >= killed["tokens_unfinished"], (metrics, killed)
    records = read_jsonl(job.out / "metrics.jsonl")
    killed_in = records[KILL_IN_ITERATION - 1]
    assert killed_in["engine_failures"] == 1 and killed_in["requests_requeued"] >= 1, killed_in
    assert summary["num_iterations"] == NUM_ITERATIONS
    # the healed engine (a new server) answers held-out prompts exactly like the one that never died
    prompts = [tuple(job.encode(p)) for p in job.heldout[:8]]
    answers = {}
    for member in pool.members:
        requests = [GenRequest(f"g{i}", p, 32) for i, p in enumerate(prompts)]
        answers[member.name] = [
            r.token_ids for r in member.engine.generate(requests, SamplingSettings(temperature=0.0))
        ]
    assert answers["engine0"] == answers["engine1"]
    assert all(answers["engine0"])
    print(f"killed on stop {killed['stops']} with {killed['tokens_unfinished']} unfinished tokens in flight")
