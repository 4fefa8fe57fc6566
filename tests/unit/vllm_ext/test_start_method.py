"""vllm_ext.start_method: what a forked vLLM worker and engine core apply after the fork."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ext.start_method import omp_cpus, omp_threads

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "environ, cpus",
    [
        ({"GOMP_CPU_AFFINITY": "0 1 2"}, (0, 1, 2)),  # libgomp (vLLM preloads torch's)
        ({"GOMP_CPU_AFFINITY": " 3 "}, (3,)),
        ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,5]"}, (4, 5)),  # Intel OpenMP
        ({"OMP_PLACES": "{0,2}"}, (0, 2)),  # any other OpenMP runtime
        ({"GOMP_CPU_AFFINITY": "1", "OMP_PLACES": "{0}"}, (1,)),  # what vLLM set for the preloaded runtime
        ({"OMP_PLACES": "cores"}, None),  # not a CPU list: left to the runtime
        ({"OMP_NUM_THREADS": "2"}, None),  # VLLM_CPU_OMP_THREADS_BIND=nobind sets no CPUs
        ({}, None),
    ],
)
def test_omp_cpus(environ, cpus):
    assert omp_cpus(environ) == cpus


def test_omp_threads():
    assert omp_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert omp_threads({}) is None
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
            omp_threads({"OMP_NUM_THREADS": bad})
    with pytest.raises(ValueError, match="bad CPU list"):
        omp_cpus({"GOMP_CPU_AFFINITY": "0 x"})


def _forked_children(cases: list[tuple[dict, str]]) -> list[dict]:
    """In one fresh process (importing vLLM takes seconds): `install`'s after-fork hook, then for each
    case a multiprocessing child forked under its name with its variables set around the fork (as
    vLLM sets the worker's OpenMP variables), which reports its CPUs and torch's thread count."""
    code = f"""
import json, multiprocessing, os, sys, torch
from vllm_ext import start_method
start_method.install(os.environ)
def report(q):
    q.put((sorted(os.sched_getaffinity(0)), torch.get_num_threads(), multiprocessing.current_process().name))
ctx = multiprocessing.get_context("fork")
for env, name in {cases!r}:
    saved = dict(os.environ)
    os.environ.update(env)
    q = ctx.Queue()
    p = ctx.Process(target=report, args=(q,), name=name)
    p.start()
    os.environ.clear()
    os.environ.update(saved)
    cpus, threads, name = q.get(timeout=60)
    p.join(60)
    print(json.dumps({{"cpus": cpus, "threads": threads, "name": name, "exitcode": p.exitcode,
                       "parent_cpus": sorted(os.sched_getaffinity(0))}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()[-len(cases) :]]


def test_forked_workers_and_engine_cores_are_placed_as_spawn_placed_them():
    from vllm_ext.engine_core_cpus import ENV

    allowed = sorted(os.sched_getaffinity(0))
    first, last = allowed[0], allowed[-1]
    core_env = {ENV: "worker", "VLLM_CPU_OMP_THREADS_BIND": str(first)}
    worker, core_bound, core_free, other = _forked_children(
        [
            ({"GOMP_CPU_AFFINITY": str(last), "OMP_NUM_THREADS": "1"}, "VllmWorker-0"),
            (core_env, "EngineCore_DP0"),
            ({**core_env, ENV: "any"}, "EngineCore_DP0"),
            ({**core_env, "GOMP_CPU_AFFINITY": str(first)}, "Process-1"),
        ]
    )
    # the worker: its threads on vLLM's CPUs for it, as many as vLLM asked for; the parent unmoved
    assert worker["exitcode"] == 0 and worker["name"] == "VllmWorker-0", worker
    assert (worker["cpus"], worker["threads"]) == ([last], 1), worker
    assert worker["parent_cpus"] == allowed
    # the engine core: where engine_core_cpus says
    assert core_bound["cpus"] == [first] and core_free["cpus"] == allowed, (core_bound, core_free)
    # any other forked process is left as it is
    assert other["cpus"] == allowed, other


def test_a_worker_asked_for_cpus_it_may_not_use_fails_at_its_start():
    outside = max(os.sched_getaffinity(0)) + 1
    code = (
        "from vllm_ext.start_method import bind_worker; "
        f"bind_worker({{'GOMP_CPU_AFFINITY': '{outside}', 'OMP_NUM_THREADS': '1'}})"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and f"vLLM's worker CPUs [{outside}] are not all among" in out.stderr, out.stderr


def test_serve_refuses_an_unknown_start_method():
    env = dict(os.environ, VLLM_EXT_START_METHOD="forkserver")
    cmd = [sys.executable, "-m", "vllm_ext.serve", "serve", "--help"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "VLLM_EXT_START_METHOD='forkserver' must be one of ['fork', 'spawn']" in out.stderr
