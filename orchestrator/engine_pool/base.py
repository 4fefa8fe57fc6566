"""Rollout engines behind one interface: in-process async vLLM, or a vLLM server over HTTP.

::

    RolloutEngine.generate([GenRequest], SamplingSettings, repeat, on_result) ──▶ [GenResult]
        AsyncVllmEngine (engine_async.py): vllm AsyncLLM on an event loop thread of this process;
            every request streams token deltas; a RepeatDetector per request aborts a looping
            response at once (finish "repeat"); on_result(result) fires as each request finishes,
            so the caller scores finished responses while the others still generate
        HttpVllmEngine (engine_http.py): POST /v1/completions from a thread pool (token-id
            prompts, return_token_ids); repeats are cut after the fact
        EnginePool (engine_pool.py): N servers behind one engine
    RolloutEngine.weight_req_func() ──▶ req_func for ParameterServer.update: the engine's workers
        run `update_weights_from_ipc` (vllm_ext.worker extension), then the prefix cache is reset

vLLM starts with dummy weights (``load_format="dummy"``): the first weight sync from the
trainer happens before the first rollout, so every token ever sampled comes from synced weights.
This module holds the interface (requests, results, the protocol, the checks every engine's
``generate`` shares); it imports no vLLM and no engine. ``engine_factory.make_engine`` builds the
engine a config names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from checkpoint_engine.types import ReqFunc
from orchestrator.repeat import RepeatConfig

if TYPE_CHECKING:
    from checkpoint_engine.types import WeightVersion

# vLLM's finish reasons -> ours (None: the request ended without one)
VLLM_FINISH = {"stop": "stop", "length": "length", "abort": "abort", None: "abort"}


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
    # (version, first token, end) spans of the weights that sampled these tokens, where the engine says
    # (vLLM's weight-transfer API labels each update; a version that changes mid-request gives two spans)
    weight_versions: tuple[tuple[str, int, int], ...] | None = None


ResultCallback = Callable[[GenResult], None]


class PartialGeneration(RuntimeError):
    """A batch broke off mid-generation (its engine died): what each of its requests got so far.

    ``finished``: results of requests that ended before the break; ``partial``: request id -> the
    tokens generated so far by each of the others (possibly none). A caller that requeues them keeps
    those tokens (``continuation``) instead of generating them again."""

    def __init__(self, cause: BaseException, finished: Sequence[GenResult], partial: dict[str, tuple[int, ...]]):
        self.cause, self.finished, self.partial = cause, list(finished), dict(partial)
        kept = sum(len(t) for t in partial.values())
        super().__init__(
            f"{type(cause).__name__}: {cause} ({len(self.finished)} requests finished, {len(partial)} broke off "
            f"with {kept} tokens)"
        )


def continuation(request: GenRequest, kept: Sequence[int]) -> GenRequest:
    """``request`` resumed after ``kept`` (tokens it already generated): they join the prompt and the
    repeat check's history, and count against ``max_tokens`` (at least 1 is left to generate)."""
    if not kept:
        return request
    if len(kept) >= request.max_tokens:
        raise ValueError(f"request {request.request_id!r}: {len(kept)} kept tokens leave none of max_tokens")
    return dataclasses.replace(
        request,
        prompt_token_ids=(*request.prompt_token_ids, *kept),
        max_tokens=request.max_tokens - len(kept),
        earlier_response_ids=(*request.earlier_response_ids, *kept),
    )


def check_requests(requests: Sequence[GenRequest]) -> None:
    """ValueError for duplicate request ids or a request without a prompt or tokens to generate."""
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique within one generate call")
    for r in requests:
        if r.max_tokens < 1 or not r.prompt_token_ids:
            raise ValueError(f"request {r.request_id!r} needs a prompt and max_tokens >= 1")


@dataclasses.dataclass(frozen=True)
class GenCall:
    """The arguments of one ``generate`` call, checked (what an engine's ``_generate`` works on)."""

    requests: Sequence[GenRequest]
    sampling: SamplingSettings
    repeat: RepeatConfig | None = None
    on_result: ResultCallback | None = None
    timeout_s: float = 900.0


class RolloutEngine:
    """What the RL loop needs from an inference engine (duck typing is enough: tests script their own).

    ``generate`` checks the requests (unique ids, a prompt, tokens to generate), returns [] for none
    and hands the rest to ``_generate``, which an engine implements with ``weight_req_func`` and ``close``."""

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
        return self._generate(GenCall(requests, sampling, repeat, on_result, timeout_s))

    def _generate(self, call: GenCall) -> list[GenResult]:
        raise NotImplementedError

    def weight_req_func(self, timeout_s: float, weight_version: WeightVersion = None) -> ReqFunc:
        """req_func for ParameterServer.update into this engine, bounded by `timeout_s`;
        `weight_version`: what the engine reports after each update where it reports versions (a
        name, or a callable asked at each update)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
