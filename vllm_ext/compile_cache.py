"""Let vLLM's CPU backend load the compiled model it saved, instead of compiling it again at every start.

vLLM 0.32 on CPU traces the model once with Dynamo and compiles it with torch's stock inductor
backend (`CompilationMode.DYNAMO_TRACE_ONCE`), saves the result as an AOT artifact under
`~/.cache/vllm/torch_compile_cache/torch_aot_compile/<hash>/`, and on the next start tries to load
it. The load fails every time:

    Compiling model again due to a load failure from .../rank_0_0/model,
    reason: 'function' object has no attribute 'finalize_loading'

because vLLM calls `finalize_loading(vllm_config)` on the loaded artifact, a hook only its own
backend's artifacts (`VllmSerializableFunction`) have; torch's loaded inductor artifact
(`BundledAOTAutogradSerializableCallable`) needs no such step. So each start spends its longest
phase (about 27 s of ~50 s for the benchmark's model on the 2-core machine) compiling again.

`repair_aot_cache_load()` gives torch's artifact class the no-op hook vLLM expects. Everything else
stays vLLM's: the cache key (config, model source files), the source check, `VLLM_DISABLE_COMPILE_CACHE=1`
(which skips the load altogether), and the fallback to compiling when a load fails for another
reason. The worker extension applies it when vLLM imports it in the worker, so every engine that
loads `vllm_ext.worker` (the launcher's, the tests', the RL job's) starts from the cache.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
vllm_logger = logging.getLogger("vllm.checkpoint_engine")  # inside vLLM's processes: shown in vLLM's log


def _finalize_loading(self, vllm_config) -> None:
    """Nothing to finalize: torch's inductor artifact is complete once deserialized."""


def needs_repair(artifact_cls: type, vllm_calls_hook: bool) -> bool:
    """Whether `artifact_cls` lacks the `finalize_loading` hook that vLLM's cache load calls."""
    return vllm_calls_hook and "finalize_loading" not in dir(artifact_cls)


def repair_aot_cache_load() -> bool:
    """Install the no-op hook where vLLM needs it; True when installed (now or before)."""
    try:
        import inspect

        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as artifact_cls
        from vllm.compilation import decorators
    except ImportError as e:  # another torch or vLLM layout: leave it alone
        logger.debug("compile-cache repair not applicable: %s", e)
        return False
    if getattr(artifact_cls, "finalize_loading", None) is _finalize_loading:
        return True
    try:
        calls_hook = "finalize_loading" in inspect.getsource(decorators._try_load_aot_compiled_fn)
    except (AttributeError, OSError, TypeError):
        calls_hook = False
    if not needs_repair(artifact_cls, calls_hook):
        return False
    artifact_cls.finalize_loading = _finalize_loading
    vllm_logger.info(
        "compile cache: torch's inductor AOT artifacts get vLLM's finalize_loading hook (a no-op), "
        "so this engine loads its compiled model from the cache instead of compiling it again"
    )
    return True
