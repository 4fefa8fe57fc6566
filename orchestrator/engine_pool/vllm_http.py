"""A running vLLM server (OpenAI completions API) as a ``RolloutEngine``, from a thread pool.

::

    generate(requests) ──▶ batches (one request each, or up to batch_size that share max_tokens)
        ──▶ POST /v1/completions per batch (token-id prompts, return_token_ids; streamed for a pool:
            a batch cut off by its engine's death raises PartialGeneration with the tokens so far)
        ──▶ each answer cut at its first repeat (over the earlier segments too), after the fact
        on_result(result) as each batch ends; as_completed also ends on requests close() cancelled
    weight_req_func ──▶ the server's weight-transfer routes (engine.update_route native; auto: where a
                        launcher says it serves them) or its /collective_rpc (extension)
                        (vllm_ext.weight_transfer.native_req.engine_req_func)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from checkpoint_engine.types import ReqFunc
from ckpt_common.httpjson import HTTPError
from orchestrator.config import EngineConfig
from orchestrator.engine_pool.base import (
    VLLM_FINISH,
    GenCall,
    GenRequest,
    GenResult,
    PartialGeneration,
    RolloutEngine,
    SamplingSettings,
)
from orchestrator.repeat import RepeatConfig, first_repeat_end

if TYPE_CHECKING:
    from checkpoint_engine.types import WeightVersion

MAX_POOL_CLIENT_WORKERS = 256
# Tokens per streamed event (vLLM's per-request ``stream_interval``): one event per token cost a pool
# engine ~25% of its tokens/s on 2 cores (benchmarks/bench_stream.py); see RESULTS.md for 8.
STREAM_INTERVAL_TOKENS = 8


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


class HttpVllmEngine(RolloutEngine):
    """A running vLLM server (``python -m vllm_ext.launch`` or ``vllm serve`` in dev mode)."""

    def __init__(
        self,
        config: EngineConfig,
        max_workers: int = 32,
        batch_size: int = 1,
        stream: bool = False,
        stream_interval_tokens: int = STREAM_INTERVAL_TOKENS,
    ) -> None:
        """``batch_size`` > 1: requests of one ``generate`` call that share ``max_tokens`` go out up to that
        many per POST (a list of token-id prompts): on a few cores the per-request HTTP work, not vLLM,
        bounds throughput otherwise; ``on_result`` then fires per batch. ``stream``: the answers stream
        (SSE), so a batch cut off by the engine's death raises ``PartialGeneration`` with the tokens
        generated so far (a pool requeues them as continuations); vLLM sends them every
        ``stream_interval_tokens`` tokens (fewer events: at most that many minus one lost per request)."""
        from vllm_ext.extension_req import get_json

        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be >= 1")
        if stream_interval_tokens < 1:
            raise ValueError(f"stream_interval_tokens={stream_interval_tokens!r} must be >= 1")
        self.stream_interval_tokens = stream_interval_tokens
        self.config = config
        self.batch_size = batch_size
        self.stream = stream
        self.tokens_streamed = 0  # tokens received by streams so far (progress of requests in flight)
        self.tokens_unfinished = 0  # of those, the tokens of requests whose streams are still open and unfinished
        self._count_lock = threading.Lock()
        self.endpoint = str(config.endpoint).rstrip("/")
        status, body = get_json(self.endpoint + "/v1/models", timeout_s=30.0)
        if status != 200 or not body.get("data"):
            raise RuntimeError(f"{self.endpoint}/v1/models answered HTTP {status}: {str(body)[:300]}")
        self.model_name = body["data"][0]["id"]
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rollout")

    def _body(self, requests: Sequence[GenRequest], sampling: SamplingSettings) -> dict:
        return {
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

    def _stream_batch(
        self, requests: Sequence[GenRequest], sampling: SamplingSettings, repeat: RepeatConfig | None, timeout_s: float
    ) -> list[GenResult]:
        """One streamed POST: token ids arrive as they are sampled, so a batch that breaks off (its
        engine died) raises ``PartialGeneration`` with every request's tokens so far."""
        from ckpt_common.httpjson import post_sse

        tokens: list[list[int]] = [[] for _ in requests]
        reasons: list[str | None] = [None] * len(requests)
        done = [False] * len(requests)
        body = {**self._body(requests, sampling), "stream": True, "stream_interval": self.stream_interval_tokens}
        try:
            for event in post_sse(self.endpoint + "/v1/completions", body, timeout_s=timeout_s):
                for choice in event.get("choices") or ():
                    i = int(choice.get("index", 0))
                    new = [int(t) for t in choice.get("token_ids") or ()]
                    tokens[i] += new
                    ends = choice.get("finish_reason") is not None
                    if ends:
                        reasons[i], done[i] = choice["finish_reason"], True
                    with self._count_lock:
                        self.tokens_streamed += len(new)
                        if ends:  # its earlier tokens are no longer unfinished
                            self.tokens_unfinished -= len(tokens[i]) - len(new)
                        else:
                            self.tokens_unfinished += len(new)
        except HTTPError:
            raise  # the engine answered before generating: nothing to keep
        except Exception as e:  # broke off mid-stream: keep what arrived
            finished = [self._result(r, tokens[i], reasons[i], repeat) for i, r in enumerate(requests) if done[i]]
            partial = {r.request_id: tuple(tokens[i]) for i, r in enumerate(requests) if not done[i]}
            raise PartialGeneration(e, finished, partial) from e
        finally:  # the unfinished requests' tokens leave this stream (to the caller or with the error)
            with self._count_lock:
                self.tokens_unfinished -= sum(len(t) for t, d in zip(tokens, done) if not d)
        if not all(done):
            missing = [r.request_id for r, d in zip(requests, done) if not d]
            raise RuntimeError(f"the completion stream ended without finishing requests {missing[:5]}")
        return [self._result(r, t, reason, repeat) for r, t, reason in zip(requests, tokens, reasons)]

    def _complete_batch(
        self, requests: Sequence[GenRequest], sampling: SamplingSettings, repeat: RepeatConfig | None, timeout_s: float
    ) -> list[GenResult]:
        """One POST for requests that share ``max_tokens`` (one prompt: as before batching existed)."""
        from ckpt_common.httpjson import post_json

        body = self._body(requests, sampling)
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
        finish = VLLM_FINISH.get(reason, "abort")
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

    def _batches(self, requests: Sequence[GenRequest]) -> list[list[GenRequest]]:
        """One request per POST in the order given; batch_size > 1: up to that many sharing ``max_tokens``."""
        if self.batch_size == 1:
            return [[r] for r in requests]
        by_tokens: dict[int, list[GenRequest]] = {}
        for r in requests:
            by_tokens.setdefault(r.max_tokens, []).append(r)
        return [g[i : i + self.batch_size] for g in by_tokens.values() for i in range(0, len(g), self.batch_size)]

    def _generate(self, call: GenCall) -> list[GenResult]:
        requests, timeout_s = call.requests, call.timeout_s
        futures = [
            self._pool.submit(
                self._stream_batch if self.stream else self._complete_batch, b, call.sampling, call.repeat, timeout_s
            )
            for b in self._batches(requests)
        ]
        results: dict[str, GenResult] = {}
        try:
            for future in as_completed(futures, timeout_s):
                for result in future.result():
                    results[result.request_id] = result
                    if call.on_result is not None:
                        call.on_result(result)
        except concurrent.futures.TimeoutError:
            for future in futures:
                future.cancel()
            missing = len(requests) - len(results)
            raise TimeoutError(
                f"{missing} of {len(requests)} requests did not finish within {timeout_s:.0f} s"
            ) from None
        return [results[r.request_id] for r in requests]

    def weight_req_func(self, timeout_s: float, weight_version: WeightVersion = None) -> ReqFunc:
        """The server's route: ``engine.update_route`` (auto: what the server says it offers at each
        update, ``served_route``)."""
        from vllm_ext.weight_transfer.native_req import engine_req_func

        return engine_req_func(
            self.endpoint, route=self.config.update_route, rank=0, timeout_s=timeout_s, weight_version=weight_version
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def http_client(config: EngineConfig, endpoint: str, batch_size: int) -> HttpVllmEngine:
    """The client of one of several engines (a pool's, the daemon's): ``config`` with this endpoint
    alone (``num_engines`` and the daemon-only ``colocated`` do not apply to one engine); streamed, so
    the requests of an engine that dies keep their tokens."""
    one = dataclasses.replace(config, type="vllm_http", endpoint=endpoint, num_engines=1, colocated=False)
    return HttpVllmEngine(
        one, max_workers=min(config.max_num_seqs, MAX_POOL_CLIENT_WORKERS), batch_size=batch_size, stream=True
    )
