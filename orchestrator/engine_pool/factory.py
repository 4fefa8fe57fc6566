"""``make_engine``: the rollout engine a config names (``orchestrator.engine_pool.base.RolloutEngine``).

The implementations import the interface (``orchestrator.engine_pool.base``); this module imports them, on
demand, so building one engine never imports the others (nor vLLM before it is needed).
"""

from __future__ import annotations

from orchestrator.config import EngineConfig
from orchestrator.engine_pool.base import RolloutEngine


def make_engine(config: EngineConfig, model_dir: str, *, log_dir: str | None = None) -> RolloutEngine:
    """The engine ``config.type`` names (vLLM imports happen here, not at module import).

    ``config.num_engines`` >= 2: an ``EnginePool`` of that many vLLM servers started on this machine
    (their logs go to ``log_dir``, a temporary directory when None)."""
    if config.num_engines > 1:
        from orchestrator.engine_pool.pool import EnginePool

        return EnginePool.start(config, model_dir, log_dir=log_dir)
    if config.type == "vllm_async":
        from orchestrator.engine_pool.vllm_async import AsyncVllmEngine

        return AsyncVllmEngine(model_dir, config)
    if config.type == "vllm_http":
        from orchestrator.engine_pool.vllm_http import HttpVllmEngine

        return HttpVllmEngine(config)
    if config.type == "daemon":
        raise ValueError("engine.type='daemon': the engines are the daemon's (orchestrator.engine_pool.daemon)")
    raise ValueError(f"engine.type={config.type!r} is not supported")
