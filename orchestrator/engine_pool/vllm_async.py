"""vLLM's AsyncLLM in this process as a ``RolloutEngine``: every request streams, repeats stop at once.

::

    generate(requests) ──▶ one coroutine per request on a private event loop thread
        token deltas ──▶ _StreamStopper (a RepeatDetector seeded with the earlier segments)
            fires ──▶ the request aborted in the engine, finish "repeat"
        on_result(result) as each request finishes
    weight_req_func ──▶ update_route native (default): vLLM's weight-transfer methods of the AsyncLLM
                        (start_weight_update, update_weights, finish_weight_update(version)), the engine
                        running the checkpoint_engine backend (vllm_ext.weight_transfer);
                        extension: collective_rpc(update_weights_from_ipc) on the workers;
                        then a prefix-cache reset either way
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from checkpoint_engine.types import ReqFunc
from ckpt_common.procs import block_sigint, stop_signal
from orchestrator.config import EngineConfig
from orchestrator.engine_pool.base import (
    VLLM_FINISH,
    GenCall,
    GenRequest,
    GenResult,
    ResultCallback,
    RolloutEngine,
    SamplingSettings,
)
from orchestrator.repeat import RepeatConfig

if TYPE_CHECKING:
    from checkpoint_engine.types import WeightVersion

logger = logging.getLogger(__name__)

STOP_POLL_S = 0.2  # how often an engine call waiting off the main thread looks for a stop signal


class EngineStopped(RuntimeError):
    """An engine call given up because the job is stopping (a stop signal was recorded)."""


class _StreamStopper:
    """Per-request streaming repeat check; returns how many new tokens to keep once it fires."""

    def __init__(self, repeat: RepeatConfig | None, earlier: Sequence[int]) -> None:
        self._detector = repeat.detector() if repeat is not None and repeat.enabled else None
        self._num_earlier = len(earlier)
        if self._detector is not None:
            self._detector.extend(earlier)
            if self._detector.triggered:  # an earlier segment repeated under another rule: start clean
                self._detector.reset()
                self._num_earlier = 0

    def push(self, new_ids: Sequence[int], num_kept: int) -> int | None:
        """Feed a delta; None to go on, else the number of new tokens (of the request) to keep."""
        if self._detector is None or not self._detector.extend(new_ids):
            return None
        return self._detector.triggered_at - self._num_earlier


class AsyncVllmEngine(RolloutEngine):
    """vLLM's AsyncLLM in this process, driven from an event loop on a private thread."""

    def __init__(self, model_dir: str, config: EngineConfig) -> None:
        self.config = config
        self.native = config.update_route != "extension"  # auto: native, the engine is ours to start
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="vllm-loop", daemon=True)
        self._thread.start()
        self._serial = itertools.count()
        self._llm = None
        self._before = _children()  # what vLLM starts is the rest
        try:
            self._llm = self._call(self._create(model_dir), config.start_timeout_s, "engine start")
        except BaseException:
            self.close()
            raise

    def _run_loop(self) -> None:
        # vLLM's engine core starts from this thread. Forked, it inherits this thread's signal mask:
        # with SIGINT blocked it does not take a terminal's Ctrl-C (sent to the job's whole process
        # group) for its own shutdown, which tears a weight update or a generation in flight into a
        # chain of EngineDeadErrors; the job gets the Ctrl-C, and close() stops vLLM. Spawned (vLLM's
        # default on CPU) the mask starts empty: orchestrator/spawned.py blocks SIGINT there (the job's
        # ``spawn_children_through_here``).
        block_sigint()
        self._loop.run_forever()

    async def _create(self, model_dir: str):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from vllm_ext.launch_config import EXTENSION, WEIGHT_TRANSFER_CONFIG

        c = self.config
        args = AsyncEngineArgs(
            model=str(model_dir),
            load_format="dummy",
            dtype=c.dtype,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            block_size=c.block_size,
            enable_prefix_caching=c.enable_prefix_caching,
            seed=c.seed,
            enforce_eager=c.enforce_eager,
            worker_extension_cls=EXTENSION,
            disable_log_stats=True,
            **({"weight_transfer_config": dict(WEIGHT_TRANSFER_CONFIG)} if self.native else {}),
        )
        return AsyncLLM.from_engine_args(args)

    def _call(self, coro, timeout_s: float, what: str, *, stoppable: bool = True) -> Any:
        """Run ``coro`` on the loop; its result. ``stoppable``: once a stop signal is recorded
        (``ckpt_common.procs.record_stop_signals``), give up waiting at once (``EngineStopped``),
        on any thread: a weight update's req_func thread must not keep the stop waiting on an engine
        call (an update the aborted sync will never feed waits for its engine timeout)."""
        if stoppable and stop_signal() is not None:  # not even started: a request sent now would be orphaned
            coro.close()
            raise EngineStopped(f"vLLM {what}: not started, the job is stopping")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if stoppable and stop_signal() is not None:
                    future.cancel()
                    raise EngineStopped(f"vLLM {what}: given up, the job is stopping")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    future.cancel()
                    raise TimeoutError(f"vLLM {what} did not finish within {timeout_s:.0f} s")
                try:
                    return future.result(timeout=min(remaining, STOP_POLL_S) if stoppable else remaining)
                except concurrent.futures.TimeoutError:
                    continue
        except BaseException:  # e.g. KeyboardInterrupt, SystemExit from SIGTERM: stop the work on the loop too
            future.cancel()
            raise

    def _generate(self, call: GenCall) -> list[GenResult]:
        batch = next(self._serial)

        async def run_all():
            return await asyncio.gather(
                *(self._one(r, call.sampling, call.repeat, call.on_result, batch) for r in call.requests)
            )

        return list(self._call(run_all(), call.timeout_s, f"generation of {len(call.requests)} requests"))

    async def _one(
        self,
        request: GenRequest,
        sampling: SamplingSettings,
        repeat: RepeatConfig | None,
        on_result: ResultCallback | None,
        batch: int,
    ) -> GenResult:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=request.max_tokens,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        stopper = _StreamStopper(repeat, request.earlier_response_ids)
        tokens: list[int] = []
        finish: str | None = None
        spans = None  # vLLM's weight version spans, on the final output
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)),
            params,
            request_id=f"b{batch}-{request.request_id}",
        )
        try:
            async for out in stream:  # a cancelled task aborts its request inside vLLM's generate()
                completion = out.outputs[0]
                new = list(completion.token_ids)
                keep = stopper.push(new, len(tokens))
                if keep is not None:
                    tokens = (tokens + new)[:keep]
                    finish = "repeat"
                    break
                tokens += new
                if out.finished:
                    finish = VLLM_FINISH.get(completion.finish_reason, "abort")
                    spans = getattr(completion, "weight_versions", None)
        except EngineDeadError:
            # vLLM raises one shared exception object in every open stream, and its traceback grows by
            # each stream's frames (hundreds of KB for a full batch): raise a fresh, short one instead.
            raise RuntimeError(
                "the in-process vLLM engine died (its EngineCore process ended; its own log above says why)"
            ) from None
        if finish == "repeat":
            await stream.aclose()  # stopped early: abort the request in the engine now
        versions = tuple((s.version, s.start, s.end) for s in spans) if spans else None
        result = GenResult(request.request_id, tuple(tokens), finish or "abort", versions)
        if on_result is not None:
            on_result(result)
        return result

    def weight_req_func(self, timeout_s: float, weight_version: WeightVersion = None) -> ReqFunc:
        """``weight_version``: the version vLLM reports after each update (native only; a callable is
        asked at each update)."""

        def reset_prefix_cache() -> None:  # KV blocks computed with the old weights must not be reused
            self._call(self._llm.reset_prefix_cache(), 60.0, "prefix cache reset")

        if self.native:
            from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

            from vllm_ext.weight_transfer.native_req import (
                NativeSteps,
                checked_finish,
                run_native_update,
                update_payload,
                version_now,
            )

            num_workers = self._llm.vllm_config.parallel_config.world_size

            def step(coro, what: str) -> Any:
                return self._call(coro, timeout_s + 30.0, what)

            steps = NativeSteps(
                where="in-process vLLM",
                start=lambda: step(self._llm.start_weight_update(), "start_weight_update"),
                update=lambda payload: step(
                    self._llm.update_weights(WeightTransferUpdateRequest(update_info=payload)), "update_weights"
                ),
                # the version is set once the workers' reports show their finish went through
                finish=checked_finish(
                    lambda: step(self._llm.finish_weight_update(), "finish_weight_update"),
                    lambda: step(self._llm.collective_rpc("weights_state", timeout=60.0), "weights_state"),
                    lambda version: step(self._llm.update_weight_version(version), "update_weight_version"),
                ),
                reset_prefix_cache=reset_prefix_cache,
            )

            def native_req_func(socket_paths: Sequence[tuple[str, str]]) -> None:
                run_native_update(steps, update_payload(dict(socket_paths), num_workers), version_now(weight_version))

            return native_req_func

        from vllm_ext.extension_req import rpc_req_func

        def collective_rpc(method: str, *, timeout: float, args: tuple) -> list:
            return self._call(
                self._llm.collective_rpc(method, timeout=timeout, args=args), timeout + 30.0, "weight update"
            )

        return rpc_req_func(collective_rpc, reset_prefix_cache, "in-process vLLM", timeout_s=timeout_s)

    def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None

            async def shutdown() -> None:  # on the loop thread: it cancels the loop's output task
                llm.shutdown()

            try:
                self._call(shutdown(), 60.0, "shutdown", stoppable=False)
            except Exception as e:  # noqa: BLE001 - closing must go on
                logger.warning("vLLM shutdown: %s", e)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30 if stop_signal() is None else 0.5)
            if self._thread.is_alive() and stop_signal() is not None:
                # A stop during the engine's start: the loop thread is inside vLLM's start (tens of
                # seconds; its processes do not take the Ctrl-C). End what it started so far at once and
                # silently (SIGKILL: a worker ended under a starting engine core makes it log errors);
                # the reaper removes their shared memory.
                _kill(set(_children()) - set(self._before))


def _children() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)]


def _kill(pids: set[int]) -> None:
    import psutil

    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
