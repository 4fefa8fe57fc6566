"""Rollout engines behind one interface: in-process async vLLM, or a vLLM server over HTTP.

::

    RolloutEngine.generate([GenRequest], SamplingSettings, repeat, on_result) ──▶ [GenResult]
        AsyncVllmEngine: vllm AsyncLLM on an event loop thread of this process; every request
            streams token deltas; a RepeatDetector per request aborts a looping response at once
            (finish "repeat"); on_result(result) fires as each request finishes, so the caller
            scores finished responses while the others still generate
        HttpVllmEngine: POST /v1/completions per request from a thread pool (token-id prompts,
            return_token_ids); repeats are cut after the fact
    RolloutEngine.weight_req_func() ──▶ req_func for ParameterServer.update: the engine's workers
        run `update_weights_from_ipc` (vllm_ext.worker extension), then the prefix cache is reset

vLLM starts with dummy weights (``load_format="dummy"``): the first weight sync from the
trainer happens before the first rollout, so every token ever sampled comes from synced weights.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from checkpoint_engine.types import ReqFunc
from orchestrator.config import EngineConfig
from orchestrator.repeat import RepeatConfig, first_repeat_end

logger = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", None: "abort"}


@dataclasses.dataclass(frozen=True)
class GenRequest:
    """One generation request; ``earlier_response_ids`` (already inside the prompt) seed repeat detection."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    earlier_response_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0


@dataclasses.dataclass(frozen=True)
class GenResult:
    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length" | "repeat" | "abort" (replay.FINISH_REASONS)


ResultCallback = Callable[[GenResult], None]


class RolloutEngine(Protocol):
    """What the RL loop needs from an inference engine."""

    def generate(
        self,
        requests: Sequence[GenRequest],
        sampling: SamplingSettings,
        *,
        repeat: RepeatConfig | None = None,
        on_result: ResultCallback | None = None,
        timeout_s: float = 900.0,
    ) -> list[GenResult]: ...

    def weight_req_func(self, timeout_s: float) -> ReqFunc: ...

    def close(self) -> None: ...


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


def check_requests(requests: Sequence[GenRequest]) -> None:
    """ValueError for duplicate request ids or a request without a prompt or tokens to generate."""
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique within one generate call")
    for r in requests:
        if r.max_tokens < 1 or not r.prompt_token_ids:
            raise ValueError(f"request {r.request_id!r} needs a prompt and max_tokens >= 1")


class AsyncVllmEngine:
    """vLLM's AsyncLLM in this process, driven from an event loop on a private thread."""

    def __init__(self, model_dir: str, config: EngineConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        self._serial = itertools.count()
        self._llm = None
        try:
            self._llm = self._call(self._create(model_dir), config.start_timeout_s, "engine start")
        except BaseException:
            self.close()
            raise

    async def _create(self, model_dir: str):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from vllm_ext.launch import EXTENSION

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
            worker_extension_cls=EXTENSION,
            disable_log_stats=True,
        )
        return AsyncLLM.from_engine_args(args)

    def _call(self, coro, timeout_s: float, what: str) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"vLLM {what} did not finish within {timeout_s:.0f} s") from None
        except BaseException:  # e.g. SystemExit from SIGTERM: stop the work on the loop too
            future.cancel()
            raise

    def generate(
        self,
        requests: Sequence[GenRequest],
        sampling: SamplingSettings,
        *,
        repeat: RepeatConfig | None = None,
        on_result: ResultCallback | None = None,
        timeout_s: float = 900.0,
    ) -> list[GenResult]:
        check_requests(requests)
        if not requests:
            return []
        batch = next(self._serial)

        async def run_all():
            return await asyncio.gather(*(self._one(r, sampling, repeat, on_result, batch) for r in requests))

        return list(self._call(run_all(), timeout_s, f"generation of {len(requests)} requests"))

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
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)),
            params,
            request_id=f"b{batch}-{request.request_id}",
        )
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
                finish = _FINISH.get(completion.finish_reason, "abort")
        if finish == "repeat":
            await stream.aclose()  # stopped early: abort the request in the engine now
        result = GenResult(request.request_id, tuple(tokens), finish or "abort")
        if on_result is not None:
            on_result(result)
        return result

    def weight_req_func(self, timeout_s: float) -> ReqFunc:
        from vllm_ext.req import rpc_req_func

        def collective_rpc(method: str, *, timeout: float, args: tuple) -> list:
            return self._call(
                self._llm.collective_rpc(method, timeout=timeout, args=args), timeout + 30.0, "weight update"
            )

        def reset_prefix_cache() -> None:  # KV blocks computed with the old weights must not be reused
            self._call(self._llm.reset_prefix_cache(), 60.0, "prefix cache reset")

        return rpc_req_func(collective_rpc, reset_prefix_cache, "in-process vLLM", timeout_s=timeout_s)

    def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None

            async def shutdown() -> None:  # on the loop thread: it cancels the loop's output task
                llm.shutdown()

            try:
                self._call(shutdown(), 60.0, "shutdown")
            except Exception as e:  # noqa: BLE001 - closing must go on
                logger.warning("vLLM shutdown: %s", e)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)


def as_completed(futures: Sequence[concurrent.futures.Future], timeout_s: float):
    """``concurrent.futures.as_completed`` that also ends on futures cancelled by ``close()``.

    A future cancelled while still in an executor's queue (``shutdown(cancel_futures=True)``) never
    notifies ``as_completed``/``wait``, which would then sleep until their timeout (15 minutes of a
    rollout, after an engine died and the pool closed its client). Such a future raises here.
    """
    deadline = time.monotonic() + timeout_s
    pending = set(futures)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise concurrent.futures.TimeoutError()
        done, pending = concurrent.futures.wait(
            pending, timeout=min(remaining, 0.5), return_when=concurrent.futures.FIRST_COMPLETED
        )
        yield from done
        cancelled = [f for f in pending if f.cancelled()]
        if cancelled:
            raise RuntimeError(f"{len(cancelled)} requests were cancelled: the engine client was closed")


class HttpVllmEngine:
    """A running vLLM server (``python -m vllm_ext.launch`` or ``vllm serve`` in dev mode)."""

    def __init__(self, config: EngineConfig, max_workers: int = 32, batch_size: int = 1) -> None:
        """``batch_size`` > 1: requests of one ``generate`` call that share ``max_tokens`` go out up to that
        many per POST (a list of token-id prompts): on a few cores the per-request HTTP work, not vLLM,
        bounds throughput otherwise; ``on_result`` then fires per batch."""
        from vllm_ext.req import get_json

        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be >= 1")
        self.config = config
        self.batch_size = batch_size
        self.endpoint = str(config.endpoint).rstrip("/")
        status, body = get_json(self.endpoint + "/v1/models", timeout_s=30.0)
        if status != 200 or not body.get("data"):
            raise RuntimeError(f"{self.endpoint}/v1/models answered HTTP {status}: {str(body)[:300]}")
        self.model_name = body["data"][0]["id"]
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rollout")

    def _complete(
        self, request: GenRequest, sampling: SamplingSettings, repeat: RepeatConfig | None, timeout_s: float
    ) -> GenResult:
        return self._complete_batch([request], sampling, repeat, timeout_s)[0]

    def _complete_batch(
        self, requests: Sequence[GenRequest], sampling: SamplingSettings, repeat: RepeatConfig | None, timeout_s: float
    ) -> list[GenResult]:
        """One POST for requests that share ``max_tokens`` (one prompt: as before batching existed)."""
        from checkpoint_engine.api import post_json

        body = {
            "model": self.model_name,
            "prompt": list(requests[0].prompt_token_ids)
            if len(requests) == 1
            else [list(r.prompt_token_ids) for r in requests],
            "max_tokens": requests[0].max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        answer = post_json(self.endpoint + "/v1/completions", body, timeout_s=timeout_s)
        try:
            choices = sorted(answer["choices"], key=lambda c: int(c.get("index", 0)))
            if len(choices) != len(requests):
                raise ValueError(f"{len(choices)} choices for {len(requests)} prompts")
            answers = [([int(t) for t in c["token_ids"]], c.get("finish_reason")) for c in choices]
        except (KeyError, IndexError, TypeError, ValueError):
            raise RuntimeError(f"unexpected completion answer: {str(answer)[:300]}") from None
        return [self._result(r, tokens, reason, repeat) for r, (tokens, reason) in zip(requests, answers)]

    @staticmethod
    def _result(request: GenRequest, tokens: list[int], reason: str | None, repeat: RepeatConfig | None) -> GenResult:
        """The result of one completion; a repeat (over earlier segments and these tokens) is cut after the fact."""
        finish = _FINISH.get(reason, "abort")
        if repeat is not None and repeat.enabled:
            earlier = list(request.earlier_response_ids)
            end = first_repeat_end(
                earlier + tokens,
                min_ngram=repeat.min_ngram,
                min_repeats=repeat.min_repeats,
                max_ngram=repeat.max_ngram,
                min_tail_tokens=repeat.min_tail_tokens,
            )
            if end is not None and end > len(earlier):
                tokens, finish = tokens[: end - len(earlier)], "repeat"
        return GenResult(request.request_id, tuple(tokens), finish)

    def generate(
        self,
        requests: Sequence[GenRequest],
        sampling: SamplingSettings,
        *,
        repeat: RepeatConfig | None = None,
        on_result: ResultCallback | None = None,
        timeout_s: float = 900.0,
    ) -> list[GenResult]:
        check_requests(requests)
        if self.batch_size > 1:
            return self._generate_batched(requests, sampling, repeat, on_result, timeout_s)
        futures = [self._pool.submit(self._complete, r, sampling, repeat, timeout_s) for r in requests]
        try:
            for future in as_completed(futures, timeout_s):
                if on_result is not None:
                    on_result(future.result())
        except concurrent.futures.TimeoutError:
            pending = [f for f in futures if not f.done()]
            for future in pending:
                future.cancel()
            raise TimeoutError(
                f"{len(pending)} of {len(requests)} requests did not finish within {timeout_s:.0f} s"
            ) from None
        return [f.result() for f in futures]

    def _generate_batched(
        self,
        requests: Sequence[GenRequest],
        sampling: SamplingSettings,
        repeat: RepeatConfig | None,
        on_result: ResultCallback | None,
        timeout_s: float,
    ) -> list[GenResult]:
        by_tokens: dict[int, list[GenRequest]] = {}
        for r in requests:
            by_tokens.setdefault(r.max_tokens, []).append(r)
        batches = [g[i : i + self.batch_size] for g in by_tokens.values() for i in range(0, len(g), self.batch_size)]
        futures = [self._pool.submit(self._complete_batch, b, sampling, repeat, timeout_s) for b in batches]
        results: dict[str, GenResult] = {}
        try:
            for future in as_completed(futures, timeout_s):
                for result in future.result():
                    results[result.request_id] = result
                    if on_result is not None:
                        on_result(result)
        except concurrent.futures.TimeoutError:
            for future in futures:
                future.cancel()
            missing = len(requests) - len(results)
            raise TimeoutError(
                f"{missing} of {len(requests)} requests did not finish within {timeout_s:.0f} s"
            ) from None
        return [results[r.request_id] for r in requests]

    def weight_req_func(self, timeout_s: float) -> ReqFunc:
        from vllm_ext.req import vllm_http_req_func

        return vllm_http_req_func(self.endpoint, rank=0, timeout_s=timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_engine(config: EngineConfig, model_dir: str, *, log_dir: str | None = None) -> RolloutEngine:
    """The engine ``config.type`` names (vLLM imports happen here, not at module import).

    ``config.num_engines`` >= 2: an ``EnginePool`` of that many vLLM servers started on this machine
    (their logs go to ``log_dir``, a temporary directory when None)."""
    if config.num_engines > 1:
        from orchestrator.engine_pool import EnginePool  # imports this module: not at module level

        return EnginePool.start(config, model_dir, log_dir=log_dir)
    if config.type == "vllm_async":
        return AsyncVllmEngine(model_dir, config)
    if config.type == "vllm_http":
        return HttpVllmEngine(config)
    if config.type == "daemon":
        raise ValueError("engine.type='daemon': the engines are the daemon's (orchestrator.daemon_engines)")
    raise ValueError(f"engine.type={config.type!r} is not supported")
