"""The HTTP rollout engine against a stand-in of vLLM's OpenAI server (token-id prompts and outputs)."""

import json
import threading
import time

import pytest

from ckpt_common.httpjson import JsonRequestHandler
from orchestrator.config import EngineConfig
from orchestrator.engine_pool.base import GenRequest, PartialGeneration, SamplingSettings
from orchestrator.engine_pool.vllm_http import HttpVllmEngine
from orchestrator.repeat import RepeatConfig
from testing.http_stub import serve_stub


class FakeVllm(JsonRequestHandler):
    """Echoes max_tokens tokens: prompt[-1]+1, +2, ...; prompts ending in 7 loop on one token.

    ``stream``: one SSE event per token and prompt, as vLLM sends them; ``break_after`` tokens per
    prompt, the connection then closes without ``[DONE]`` (a server that died mid-stream); with
    ``hold`` set, it first waits (at most 30 s) for that event with the events so far sent."""

    bodies: list = []
    break_after: int | None = None
    hold: threading.Event | None = None

    def do_GET(self):
        if self.path == "/v1/models":
            self.reply(200, {"data": [{"id": "tiny"}]})
        else:
            self.reply(404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeVllm.bodies.append(body)
        if self.path != "/v1/completions" or body["model"] != "tiny" or not body.get("return_token_ids"):
            self.reply(400, {"detail": "bad request"})
            return
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        answers = [self._answer(prompt, body["max_tokens"]) for prompt in prompts]
        if not body.get("stream"):
            self.reply(
                200,
                {
                    "choices": [
                        {"index": i, "token_ids": t, "finish_reason": f, "text": ""} for i, (t, f) in enumerate(answers)
                    ]
                },
            )
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for step in range(max(len(t) for t, _ in answers)):
            if FakeVllm.break_after is not None and step >= FakeVllm.break_after:
                self.wfile.flush()
                if FakeVllm.hold is not None:
                    FakeVllm.hold.wait(30)
                return  # HTTP/1.0: the connection closes here, before [DONE]
            for i, (tokens, finish) in enumerate(answers):
                if step < len(tokens):
                    last = step == len(tokens) - 1
                    choice = {
                        "index": i,
                        "text": "",
                        "token_ids": [tokens[step]],
                        "finish_reason": finish if last else None,
                    }
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    @staticmethod
    def _answer(prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        last = prompt[-1]
        tokens = [5] * max_tokens if last == 7 else [last + i + 1 for i in range(max_tokens)]
        finish = "length"
        if 50 in tokens:
            tokens, finish = tokens[: tokens.index(50) + 1], "stop"
        return tokens, finish


@pytest.fixture
def server():
    FakeVllm.bodies.clear()
    with serve_stub(FakeVllm) as url:
        yield url


@pytest.mark.parametrize(("stream", "batch_size"), [(False, 1), (True, 1), (True, 2)])
def test_http_engine_generates_calls_back_and_cuts_repeats(server, stream, batch_size):
    engine = HttpVllmEngine(
        EngineConfig(type="vllm_http", endpoint=server), max_workers=4, batch_size=batch_size, stream=stream
    )
    seen = []
    requests = [GenRequest("a", (1, 10), 4), GenRequest("b", (1, 45), 10), GenRequest("c", (1, 7), 40, (5,) * 10)]
    try:
        results = engine.generate(
            requests,
            SamplingSettings(temperature=0.7),
            repeat=RepeatConfig(min_ngram=1, max_ngram=4, min_repeats=4, min_tail_tokens=16),
            on_result=seen.append,
        )
    finally:
        engine.close()
    assert [r.request_id for r in results] == ["a", "b", "c"]
    assert results[0].token_ids == (11, 12, 13, 14) and results[0].finish_reason == "length"
    assert results[1].token_ids == (46, 47, 48, 49, 50) and results[1].finish_reason == "stop"
    # 10 earlier repeated tokens + 6 new ones reach the 16-token rule: the rest is cut
    assert results[2].token_ids == (5,) * 6 and results[2].finish_reason == "repeat"
    assert sorted(r.request_id for r in seen) == ["a", "b", "c"]
    assert {b["temperature"] for b in FakeVllm.bodies} == {0.7}
    assert {bool(b.get("stream")) for b in FakeVllm.bodies} == {stream}
    if stream:  # every token arrived, and none belongs to an unfinished request
        assert engine.tokens_streamed == 4 + 5 + 40 and engine.tokens_unfinished == 0


def test_a_stream_that_breaks_off_raises_the_tokens_so_far(server, monkeypatch):
    monkeypatch.setattr(FakeVllm, "break_after", 3)
    engine = HttpVllmEngine(EngineConfig(type="vllm_http", endpoint=server), max_workers=2, batch_size=2, stream=True)
    requests = [GenRequest("a", (1, 10), 8), GenRequest("b", (1, 48), 8)]  # b stops at token 50, a is cut
    try:
        with pytest.raises(PartialGeneration) as info:
            engine.generate(requests, SamplingSettings())
    finally:
        engine.close()
    assert info.value.partial == {"a": (11, 12, 13)}
    assert [(r.request_id, r.token_ids, r.finish_reason) for r in info.value.finished] == [("b", (49, 50), "stop")]
    assert isinstance(info.value.cause, ConnectionError)
    assert engine.tokens_streamed == 5 and engine.tokens_unfinished == 0  # a's 3 left with the error


def test_tokens_of_unfinished_requests_are_counted_while_their_stream_is_open(server, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(FakeVllm, "break_after", 3)
    monkeypatch.setattr(FakeVllm, "hold", release)  # the stream stays open after its third events
    engine = HttpVllmEngine(EngineConfig(type="vllm_http", endpoint=server), stream=True)
    errors = []

    def generate():
        try:
            engine.generate([GenRequest("a", (1, 10), 8), GenRequest("b", (1, 48), 8)], SamplingSettings())
        except PartialGeneration as e:
            errors.append(e)

    t = threading.Thread(target=generate)
    t.start()
    try:
        deadline = time.monotonic() + 30
        # a's 3 tokens held open and b's 2 finished: the two POSTs run side by side, so b may still be on
        # its way when a's tokens are in (CI once read the gauge, released a, and generate raised before b)
        while (engine.tokens_unfinished < 3 or engine.tokens_streamed < 5) and time.monotonic() < deadline:
            time.sleep(0.01)
        open_count, streamed = engine.tokens_unfinished, engine.tokens_streamed
    finally:
        release.set()
        t.join(60)
        engine.close()
    assert not t.is_alive()
    assert open_count == 3 and streamed == 5
    assert len(errors) == 1 and engine.tokens_unfinished == 0  # a's tokens left with the error


def test_a_stream_answered_with_an_http_error_raises_it(server):
    from ckpt_common.httpjson import HTTPError

    engine = HttpVllmEngine(EngineConfig(type="vllm_http", endpoint=server), stream=True)
    engine.model_name = "not-tiny"  # the fake answers 400
    try:
        with pytest.raises(HTTPError) as info:
            engine.generate([GenRequest("a", (1, 10), 4)], SamplingSettings())
    finally:
        engine.close()
    assert info.value.status == 400


def test_http_engine_reports_a_server_that_is_not_vllm(server):
    with pytest.raises(RuntimeError, match="v1/models"):
        HttpVllmEngine(EngineConfig(type="vllm_http", endpoint=server + "/nothing-here"))
