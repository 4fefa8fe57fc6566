"""Where vLLM's engine core runs on a CPU host: on its worker's cores.

vLLM on CPU runs its scheduler (the engine core) and the model (the worker) in two processes that
hand every step over through shared-memory queues (`vllm.distributed.device_communicators.
shm_broadcast`). A reader that read within the last second does not block: it looks at the queue and
calls `sched_yield()` in a loop. The engine core therefore spins through each forward pass of its
worker. vLLM binds the worker's threads to `VLLM_CPU_OMP_THREADS_BIND`, but not the engine core,
so the kernel runs it on another core: about one core per generating engine, and with every core
busy the spinner still took 0.4-0.6 of the core beside it from whatever ran there (a heal's reads,
another engine, the trainer).

Bound to its worker's CPUs (`apply_in_vllm_process`), the spinning engine core yields to its own
worker, which is what it waits for: it used ~0.05 of a core, the engine gave up ~5% of its tokens/s
(5-11% beside a busy core), and a memory-bound process on the other core kept 0.70-0.74 of its rate
instead of 0.50-0.58. A sleep between looks instead of the spin frees the other core too but costs
the engine more (7-27% of its tokens/s: every hand-over waits for a timer and for a core). Figures:
benchmarks/RESULTS.md, bench_engine_core_cpus.py.

The launcher (`--engine-core-cpus`) hands the setting to `vllm serve` in `ENV`. `apply_in_vllm_process`
runs in each of vLLM's processes as it starts: after the fork (vllm_ext/start_method.py, the launcher's
default), or, where vLLM spawns them, from `vllm_ext.serve`, the parent's main module, which spawn runs
again in each of them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from checkpoint_engine.transport.mooncake import parse_cpu_list

logger = logging.getLogger(__name__)

ENV = "VLLM_EXT_ENGINE_CORE_CPUS"
CHOICES: tuple[str, ...] = ("worker", "any")
ENGINE_CORE_PREFIX = "EngineCore"  # vLLM's name of the engine core's process (multiprocessing)


def worker_cpus(omp_bind: str | None) -> tuple[int, ...] | None:
    """Every CPU that `VLLM_CPU_OMP_THREADS_BIND` names ('0-3', or '0-1|2-3' with one list per
    tensor-parallel rank); None where vLLM picks them itself ('auto', 'nobind', unset)."""
    if omp_bind is None or omp_bind.strip() in ("", "auto", "nobind", "all"):
        return None
    cpus: set[int] = set()
    for part in omp_bind.split("|"):
        cpus.update(parse_cpu_list(part))
    return tuple(sorted(cpus))


def engine_core_cpus(setting: str, omp_bind: str | None) -> tuple[int, ...] | None:
    """The CPUs to bind the engine core to (None: leave it where it is)."""
    if setting not in CHOICES:
        raise ValueError(f"{ENV}={setting!r} must be one of {list(CHOICES)}")
    return worker_cpus(omp_bind) if setting == "worker" else None


def apply_in_vllm_process(environ: Mapping[str, str], process_name: str) -> tuple[int, ...] | None:
    """In one of vLLM's processes: bind it to its worker's CPUs if it is the engine core and `ENV`
    says "worker". Returns the CPUs bound to, None if nothing changed."""
    if not process_name.startswith(ENGINE_CORE_PREFIX):
        return None
    cpus = engine_core_cpus(environ.get(ENV, "any"), environ.get("VLLM_CPU_OMP_THREADS_BIND"))
    if cpus is None:
        return None
    allowed = os.sched_getaffinity(0)
    if not set(cpus) <= allowed:
        logger.warning("engine core left unbound: its worker's CPUs %s are not all among %s", cpus, sorted(allowed))
        return None
    os.sched_setaffinity(0, cpus)
    logger.info("engine core bound to its worker's CPUs %s (pid %d)", ",".join(map(str, cpus)), os.getpid())
    return cpus
