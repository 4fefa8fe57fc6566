"""The HTTP rollout engine against a stand-in of vLLM's OpenAI server (token-id prompts and outputs)."""

import json
import threading
from http.server import ThreadingHTTPServer

import pytest

from checkpoint_engine.httpjson import JsonRequestHandler
from orchestrator.config import EngineConfig
from orchestrator.engine import GenRequest, SamplingSettings
from orchestrator.engine_http import HttpVllmEngine
from orchestrator.repeat import RepeatConfig


class FakeVllm(JsonRequestHandler):
    """Echoes max_tokens tokens: prompt[-1]+1, +2, ...; prompts ending in 7 loop on one token."""

    bodies: list = []

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
        last = body["prompt"][-1]
        tokens = [5] * body["max_tokens"] if last == 7 else [last + i + 1 for i in range(body["max_tokens"])]
        finish = "length"
        if 50 in tokens:
            tokens, finish = tokens[: tokens.index(50) + 1], "stop"
        self.reply(200, {"choices": [{"token_ids": tokens, "finish_reason": finish, "text": ""}]})


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    thread.join(timeout=10)


def test_http_engine_generates_calls_back_and_cuts_repeats(server):
    engine = HttpVllmEngine(EngineConfig(type="vllm_http", endpoint=server), max_workers=4)
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


def test_http_engine_reports_a_server_that_is_not_vllm(server):
    with pytest.raises(RuntimeError, match="v1/models"):
        HttpVllmEngine(EngineConfig(type="vllm_http", endpoint=server + "/nothing-here"))
