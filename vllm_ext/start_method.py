"""How `vllm serve` starts its engine core and workers on a CPU host: forked, not spawned.

vLLM's CPU platform sets `VLLM_WORKER_MULTIPROC_METHOD=spawn`, so its engine core and each worker
start as fresh interpreters and import vLLM again: on a 2-core CPU an engine's start spends about
half its time in three imports of vLLM, one after another (the API server's, the engine core's, the
worker's). Forked, the engine core and the worker inherit the API server's imports.

Spawn also did two things through the fresh process's environment, which a forked child's runtime
has already read by the time it runs; `install` does them after the fork instead:
- the worker's OpenMP threads: vLLM sets the thread count and the CPUs (`OMP_NUM_THREADS` with
  `GOMP_CPU_AFFINITY`, `KMP_AFFINITY` or `OMP_PLACES`) around the worker's start. The forked worker
  applies them itself (`sched_setaffinity` before its first parallel region, `torch.set_num_threads`):
  without that its threads float over every core beside the spinning engine core (~30% fewer
  tokens/s here);
- the engine core's CPUs (vllm_ext/engine_core_cpus.py), which spawn applied by running
  `vllm_ext.serve` again as `__mp_main__`.

`spawn` stays available (`vllm_ext.launch --vllm-start-method spawn`): it is what vLLM does.
Figures: benchmarks/RESULTS.md, "vLLM's processes forked".
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from checkpoint_engine.transport.mooncake import parse_cpu_list

logger = logging.getLogger(__name__)

ENV = "VLLM_EXT_START_METHOD"
CHOICES: tuple[str, ...] = ("fork", "spawn")
WORKER_PREFIX = "VllmWorker"  # vLLM's name of a worker's process (multiprocessing)


def omp_cpus(environ: Mapping[str, str]) -> tuple[int, ...] | None:
    """The CPUs vLLM gave a worker's OpenMP threads, from whichever variable its OpenMP runtime
    reads: GOMP_CPU_AFFINITY ('0 1 2', libgomp), KMP_AFFINITY ('...,proclist=[0,1]', Intel's),
    OMP_PLACES ('{0,1}'). None where it set none (VLLM_CPU_OMP_THREADS_BIND=nobind)."""
    gomp = environ.get("GOMP_CPU_AFFINITY", "").strip()
    if gomp:
        return parse_cpu_list(",".join(gomp.split()))
    kmp = re.search(r"proclist=\[([^\]]*)\]", environ.get("KMP_AFFINITY", ""))
    if kmp:
        return parse_cpu_list(kmp.group(1))
    places = environ.get("OMP_PLACES", "").strip()
    if places.startswith("{") and places.endswith("}"):
        return parse_cpu_list(places[1:-1])
    return None


def omp_threads(environ: Mapping[str, str]) -> int | None:
    value = environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r} is not a thread count >= 1")
    return int(value)


def bind_worker(environ: Mapping[str, str]) -> tuple[int, ...] | None:
    """In a forked worker, before its first parallel region: its threads on vLLM's CPUs for it, as
    many as vLLM asked for. Returns the CPUs, None where vLLM set none."""
    import torch

    threads = omp_threads(environ)
    cpus = omp_cpus(environ)
    if cpus is not None:
        allowed = os.sched_getaffinity(0)
        if not set(cpus) <= allowed:
            raise RuntimeError(f"vLLM's worker CPUs {list(cpus)} are not all among this process's {sorted(allowed)}")
        os.sched_setaffinity(0, cpus)  # the threads OpenMP creates from here on inherit it
    if threads is not None:
        torch.set_num_threads(threads)
    return cpus


def after_fork(environ: Mapping[str, str], process_name: str) -> None:
    """What spawn's fresh process did, in one of vLLM's forked processes."""
    from vllm_ext.engine_core_cpus import apply_in_vllm_process

    if process_name.startswith(WORKER_PREFIX):
        cpus = bind_worker(environ)
        logger.info("forked worker %s: threads on CPUs %s (pid %d)", process_name, cpus, os.getpid())
    else:
        apply_in_vllm_process(environ, process_name)


class _AfterForkKey:
    """multiprocessing.util.register_after_fork keeps a weak reference to its key: this one lives here."""


_KEY = _AfterForkKey()


def install(environ: Mapping[str, str]) -> None:
    """In `vllm serve`'s process, before vLLM builds its config: its CPU platform keeps fork, and each
    forked child runs `after_fork` as it starts."""
    import multiprocessing
    import multiprocessing.util

    from vllm.platforms.cpu import CpuPlatform

    vllm_update = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        vllm_update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # vLLM's update has just set spawn

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)

    def run_after_fork(_key: _AfterForkKey) -> None:
        # multiprocessing has made the child's Process current by now: its name says what it is
        from ckpt_common.logs import setup_logging

        setup_logging("INFO")  # this project's loggers in vLLM's processes (vLLM configures its own)
        after_fork(os.environ, multiprocessing.current_process().name)

    multiprocessing.util.register_after_fork(_KEY, run_after_fork)
