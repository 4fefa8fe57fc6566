"""Where vLLM's engine core runs: its worker's CPUs, from VLLM_CPU_OMP_THREADS_BIND."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ext.engine_core_cpus import ENV, apply_in_vllm_process, engine_core_cpus, worker_cpus

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("bind", "cpus"),
    [
        ("0", (0,)),
        ("2-3", (2, 3)),
        ("0,2-3", (0, 2, 3)),
        ("0-1|2-3", (0, 1, 2, 3)),  # one list per tensor-parallel rank: the engine core serves them all
        ("4|1", (1, 4)),
        ("auto", None),  # vLLM picks the worker's cores itself: nothing to follow
        ("nobind", None),
        ("all", None),
        ("", None),
        (None, None),
    ],
)
def test_worker_cpus(bind, cpus):
    assert worker_cpus(bind) == cpus


def test_a_bad_bind_names_the_bad_part():
    with pytest.raises(ValueError, match="'x'"):
        worker_cpus("0|x")


@pytest.mark.parametrize(
    ("setting", "bind", "cpus"),
    [("worker", "1", (1,)), ("worker", "auto", None), ("any", "1", None), ("any", None, None)],
)
def test_engine_core_cpus(setting, bind, cpus):
    assert engine_core_cpus(setting, bind) == cpus


def test_an_unknown_setting_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match=ENV):
        engine_core_cpus("everywhere", "0")


def _affinity_in_child(env: dict, process_name: str) -> list[int]:
    """apply_in_vllm_process in a fresh process (it binds the caller); that process's CPUs after it."""
    code = (
        "import os, sys; from vllm_ext.engine_core_cpus import apply_in_vllm_process as a; "
        f"a({env!r}, {process_name!r}); print(sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_only_the_engine_core_is_bound_and_only_to_cpus_it_may_use():
    allowed = sorted(os.sched_getaffinity(0))
    one = str(allowed[-1])
    env = {ENV: "worker", "VLLM_CPU_OMP_THREADS_BIND": one}
    assert _affinity_in_child(env, "EngineCore_DP0") == [allowed[-1]]
    assert _affinity_in_child(env, "VllmWorker-0") == allowed  # a worker binds its own threads
    assert _affinity_in_child({**env, ENV: "any"}, "EngineCore_DP0") == allowed
    outside = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(max(allowed) + 1)}
    assert _affinity_in_child(outside, "EngineCore_DP0") == allowed  # warned, left unbound
    assert apply_in_vllm_process(env, "MainProcess") is None  # this process: not vLLM's engine core
