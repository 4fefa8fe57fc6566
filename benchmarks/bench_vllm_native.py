"""One full-model update into a running vLLM server through vLLM's own weight-transfer API (the
`checkpoint_engine` backend) vs the worker extension vs vLLM's reload from disk, paired and interleaved.

    python benchmarks/bench_vllm_native.py [--size-gib 0.55] [--repeats 5] [--inflight-repeats 1]
                                           [--inflight-tokens 64] [--pause-mode keep] [--out-dir DIR]

One server: `vllm serve A` (dev mode) with both the worker extension and `--weight-transfer-config
'{"backend": "checkpoint_engine"}'`, which coexist: both doors reach the same receiver per worker
(vllm_ext.weight_transfer.engine), so the paths below differ only in how the update is driven. Two
generated checkpoints of the same shapes, A and B (>= 0.5 GiB, bf16, tiny vocabulary); every step
loads the one the server does not hold, so an update that did not land shows in the answer.
A one-rank CPU parameter server holds both. After untimed warm-ups (the first update allocates the
receiver's cache; vLLM's reload of B gives B's reference answer), `--repeats` pairs, each running
the three paths in an order that rotates from pair to pair:

  native     ParameterServer.update -> vllm_ext.weight_transfer.native_req.native_http_req_func:
             /pause?mode=M, /start_weight_update, /update_weights, /finish_weight_update (version),
             [keep: /reset_prefix_cache?reset_running_requests=true], /resume          -> native_s
  extension  ParameterServer.update -> vllm_ext.extension_req.vllm_http_req_func: /collective_rpc
             update_weights_from_ipc, /reset_prefix_cache                              -> extension_s
  disk       /collective_rpc reload_weights(weights_path=DIR), /reset_prefix_cache (vLLM's own
             in-place reload; the safetensors in the page cache: the best case for it) -> disk_reload_s

Per pair: ratio_native_vs_extension = native_s / extension_s (target <= 1.05) and
ratio_native_vs_disk_reload = native_s / disk_reload_s (target <= 1.0); then their medians and
spread (min-max). After every step the greedy answer is checked token for token (A: the server's
first answer; B: its answer after vLLM's own reload of B).

Then `--inflight-repeats` times, a request in flight: a greedy completion of `--inflight-tokens`
tokens streamed one token per event, started before an update that runs once it has 8 tokens;
through the native routes with pause mode keep (the request freezes, recomputes its KV with the
new weights after /resume and goes on) and through the worker extension (no pause: the engine's
steps wait for the update; its prefix-cache reset then waits for the request to end). Reported:
the longest gap between the request's tokens across the update against its typical (median)
gap, the update's own seconds under that request, and whether the request completed.

The last line printed is one JSON object. SIGTERM or Ctrl-C stops the server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from _common import cpu_model  # benchmarks/ is first on sys.path
from bench_vllm_update import ENGINE_ARGS, MAX_TOKENS, PROMPTS, reload_from_disk, timed_disk_start

from checkpoint_engine.types import PAUSE_MODES  # no vLLM or torch
from ckpt_common.cli_config import add_config_args, meta  # after the path insert: run as a script
from ckpt_common.validate import check_int, check_number

PATHS = ("native", "extension", "disk")
INFLIGHT_PROMPT = "Hello world\n"
INFLIGHT_WARM_TOKENS = 8  # tokens the request has before the update starts (its typical gap before)
UPDATE_TIMEOUT_S = 600.0
BACKEND_ARGS = ("--weight-transfer-config", json.dumps({"backend": "checkpoint_engine"}))


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    size_gib: float = dataclasses.field(default=0.55, metadata=meta("size of each checkpoint (>= 0.5)"))
    repeats: int = dataclasses.field(default=5, metadata=meta("native / extension / disk-reload triples"))
    pause_mode: str = dataclasses.field(
        default="keep", metadata=meta("the native path's /pause mode in the timed pairs", choices=PAUSE_MODES)
    )
    inflight_repeats: int = dataclasses.field(
        default=1, metadata=meta("updates under a streaming request, per path (native keep, extension); 0: none")
    )
    inflight_tokens: int = dataclasses.field(default=64, metadata=meta("tokens of the streaming request"))
    out_dir: str = "/tmp/bench_vllm_native"
    startup_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not self.size_gib >= 0.5:
            raise ValueError(f"size_gib={self.size_gib!r} must be >= 0.5 (the benchmark's contract)")
        check_int("repeats", self.repeats)
        check_int("inflight_repeats", self.inflight_repeats, 0)
        check_int("inflight_tokens", self.inflight_tokens, INFLIGHT_WARM_TOKENS + 8)
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {list(PAUSE_MODES)}, got {self.pause_mode!r}")
        check_number("startup_timeout_s", self.startup_timeout_s)


def parse_config(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    spec = add_config_args(p, BenchConfig)
    return spec.build(p.parse_args(argv), p)


def spread(values: list[float], digits: int = 3) -> dict:
    """median, min and max of `values`, rounded."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


class Bench:
    """The server, the parameter server holding A and B, and what the server holds now."""

    def __init__(self, url: str, model_dirs: dict[str, Path], reference: dict[str, list], pause_mode: str):
        from checkpoint_engine.config import ParameterServerConfig
        from checkpoint_engine.ps import ParameterServer
        from ckpt_common.hf_dir import safetensors_files

        self.url, self.model_dirs, self.reference, self.pause_mode = url, model_dirs, reference, pause_mode
        self.served_model = str(model_dirs["A"])  # the name vLLM serves the model under
        self.current = "A"
        self.steps = 0
        self.correct = True
        self.native_steps: list[dict[str, float]] = []  # each native update's seconds per route
        self.last_ps_side: dict | None = None  # the last update's PS-side seconds around the req_func call
        self.ps = ParameterServer(rank=0, world_size=1, config=ParameterServerConfig(transport="cpu"))
        t0 = time.perf_counter()
        for name, d in model_dirs.items():
            self.ps.register_checkpoint(name, files=[str(f) for f in safetensors_files(d)])
            self.ps.gather_metas(name)
        self.register_s = time.perf_counter() - t0

    def close(self) -> None:
        self.ps.close()

    def target(self) -> str:
        return "B" if self.current == "A" else "A"

    def run(self, path: str, pause_mode: str | None = None) -> tuple[float, float | None]:
        """One update of the whole model to the other checkpoint through `path`; (seconds, the receiver's
        own seconds or None for the disk reload). The answer is checked afterwards (untimed)."""
        from vllm_ext.extension_req import collective_rpc, vllm_http_req_func
        from vllm_ext.weight_transfer.native_req import native_http_req_func

        name = self.target()
        self.steps += 1
        marks: dict[str, float] = {}

        def traced(req_func):  # when the PS hands the engine its sockets, and when that call returns
            def call(socket_paths):
                marks["req_called"] = time.perf_counter()
                try:
                    req_func(socket_paths)
                finally:
                    marks["req_returned"] = time.perf_counter()

            return call

        t0 = time.perf_counter()
        if path == "native":
            version = f"{name}-{self.steps}"
            mode = pause_mode or self.pause_mode
            req = native_http_req_func(
                self.url,
                rank=0,
                weight_version=version,
                pause_mode=mode,
                timeout_s=UPDATE_TIMEOUT_S,
                step_times=self.native_steps,
            )
            self.ps.update(name, traced(req))
        elif path == "extension":
            self.ps.update(name, traced(vllm_http_req_func(self.url, rank=0, timeout_s=UPDATE_TIMEOUT_S)))
        elif path == "disk":
            reload_from_disk(self.url, self.model_dirs[name], timeout_s=UPDATE_TIMEOUT_S)
        else:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        t1 = time.perf_counter()
        elapsed = t1 - t0
        self.current = name
        self.last_ps_side = (
            {
                "before_req_s": round(marks["req_called"] - t0, 4),  # the PS's work before the engine is told
                "after_req_s": round(t1 - marks["req_returned"], 4),  # the PS's work after the engine answered
            }
            if marks
            else None
        )
        engine_s = None
        if path != "disk":
            state = collective_rpc(self.url, "weights_state", timeout_s=60.0)[0]
            engine_s = (state.get("last_update") or {}).get("total_s")
        return elapsed, engine_s

    def check(self, where: str) -> list:
        """The server's greedy answer now; the reference of the checkpoint it holds once one is known."""
        from testing.vllm_servers import completion_token_ids

        answer = completion_token_ids(self.url, self.served_model, PROMPTS, MAX_TOKENS)
        want = self.reference.get(self.current)
        if want is not None and answer != want:
            self.correct = False
            print(f"WRONG ANSWER after {where}: holds {self.current}, got {answer}, want {want}", flush=True)
        return answer


def measure_pairs(bench: Bench, repeats: int) -> dict:
    # untimed: vLLM's reload of B gives B's reference; then every path once (the receiver allocates its cache)
    bench.run("disk")
    bench.reference["B"] = bench.check("warm-up disk reload of B")
    for path in ("native", "extension", "disk"):
        bench.run(path)
        bench.check(f"warm-up {path}")
    runs: dict[str, list[float]] = {p: [] for p in PATHS}
    engine: dict[str, list[float]] = {"native": [], "extension": []}
    ratio_ext, ratio_disk = [], []
    routes: list[dict[str, float]] = []
    for i in range(repeats):
        order = PATHS[i % 3 :] + PATHS[: i % 3]
        got = {}
        for path in order:
            got[path], engine_s = bench.run(path)
            if engine_s is not None:
                engine[path].append(engine_s)
            if path == "native":
                routes.append({**bench.native_steps[-1], **bench.last_ps_side})
            bench.check(f"pair {i} {path}")
        runs_i = {p: got[p] for p in PATHS}
        for p in PATHS:
            runs[p].append(runs_i[p])
        ratio_ext.append(got["native"] / got["extension"])
        ratio_disk.append(got["native"] / got["disk"])
        print(
            f"pair {i} ({', '.join(order)}): native {got['native']:.3f} s, extension {got['extension']:.3f} s, "
            f"disk reload {got['disk']:.3f} s; native/extension {ratio_ext[-1]:.3f}, native/disk {ratio_disk[-1]:.3f}; "
            f"native routes {routes[-1]}",
            flush=True,
        )
    return {"runs": runs, "engine": engine, "ratio_ext": ratio_ext, "ratio_disk": ratio_disk, "routes": routes}


def measure_inflight(bench: Bench, repeats: int, tokens: int) -> dict:
    """Updates under a streaming request: native (pause mode keep) and extension, alternating."""
    from testing.vllm_servers import StreamedCompletion

    seen: dict[str, list[dict]] = {"native": [], "extension": []}
    for i in range(repeats):
        for path in ("native", "extension"):
            stream = StreamedCompletion(bench.url, bench.served_model, INFLIGHT_PROMPT, tokens, timeout_s=120.0)
            stream.wait_tokens(INFLIGHT_WARM_TOKENS, timeout_s=120.0)
            t0 = time.monotonic()
            bench.run(path, pause_mode="keep")
            t1 = time.monotonic()
            got = stream.result(timeout_s=120.0)
            res = stream.pause_across(t0, t1)
            res["update_s"] = round(t1 - t0, 4)
            res["routes_s"] = bench.native_steps[-1] if path == "native" else None
            res["ps_side_s"] = bench.last_ps_side
            res["completed"] = len(got) == tokens and res["finish_reason"] == "length"
            # the update's window held the request: tokens before it, none between, the rest after the longest gap
            res["spanned"] = res["tokens_before"] > 0 and res["max_gap_across_s"] is not None
            bench.check(f"in-flight {path} {i}")
            seen[path].append(res)
            ratio = (
                res["max_gap_across_s"] / res["typical_gap_s"]
                if res["max_gap_across_s"] and res["typical_gap_s"]
                else 0
            )
            routes = f" (routes {res['routes_s']}; PS side {res['ps_side_s']})" if res["routes_s"] else ""
            print(
                f"in flight {i} {path}{' (keep)' if path == 'native' else ''}: longest gap "
                f"{res['max_gap_across_s']} s vs typical {res['typical_gap_s']} s ({ratio:.1f}x); update "
                f"{res['update_s']:.3f} s under the request{routes}; tokens {res['tokens_before']} before, "
                f"{res['tokens_after']} after; completed {res['completed']}",
                flush=True,
            )
    out = {}
    for path, results in seen.items():
        if not results:
            continue
        gaps = [r["max_gap_across_s"] for r in results if r["max_gap_across_s"] is not None]
        typical = [r["typical_gap_s"] for r in results if r["typical_gap_s"] is not None]
        out[path] = {
            "max_gap_s": round(statistics.median(gaps), 4) if gaps else None,
            "typical_gap_s": round(statistics.median(typical), 4) if typical else None,
            "gap_ratio": round(statistics.median(gaps) / statistics.median(typical), 2) if gaps and typical else None,
            "update_s": round(statistics.median(r["update_s"] for r in results), 4),
            "completed": all(r["completed"] for r in results),
            "spanned": all(r["spanned"] for r in results),
            "runs": results,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    from ckpt_common.procs import exit_on_signals

    exit_on_signals((signal.SIGTERM, signal.SIGINT))  # unwind as SystemExit: the finally blocks stop the server
    t_bench = time.monotonic()

    from demo.tiny_model import TinyModelConfig, make_tiny_model

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_cfg = TinyModelConfig.for_size_bytes(int(cfg.size_gib * 2**30), dtype="bfloat16", init_std=0.1)
    model_dirs = {
        "A": make_tiny_model(out / "model_a", model_cfg, seed=3),
        "B": make_tiny_model(out / "model_b", model_cfg, seed=4),
    }
    size_gib = model_cfg.size_bytes() / 2**30
    print(
        f"checkpoints A and B: {size_gib:.3f} GiB each, {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}",
        flush=True,
    )

    server, start_s, answer_a = timed_disk_start(
        model_dirs["A"], out / "server.log", cfg.startup_timeout_s, vllm_args=(*ENGINE_ARGS, *BACKEND_ARGS)
    )
    bench = None
    try:
        print(f"server (extension + checkpoint_engine backend) first answer after {start_s:.1f} s", flush=True)
        bench = Bench(server.url, model_dirs, {"A": answer_a}, cfg.pause_mode)
        pairs = measure_pairs(bench, cfg.repeats)
        inflight = measure_inflight(bench, cfg.inflight_repeats, cfg.inflight_tokens) if cfg.inflight_repeats else {}
    finally:
        if bench is not None:
            bench.close()
        server.stop()

    runs = pairs["runs"]
    r_ext, r_disk = spread(pairs["ratio_ext"]), spread(pairs["ratio_disk"])
    med = {p: statistics.median(runs[p]) for p in PATHS}
    print(
        f"native {med['native']:.3f} s, extension {med['extension']:.3f} s, disk reload {med['disk']:.3f} s "
        f"(medians of {cfg.repeats}); ratio_native_vs_extension {r_ext['median']} ({r_ext['min']}-{r_ext['max']}), "
        f"ratio_native_vs_disk_reload {r_disk['median']} ({r_disk['min']}-{r_disk['max']})",
        flush=True,
    )

    def inflight_field(path: str, key: str):
        return inflight[path][key] if path in inflight else None

    result = {
        "checkpoint_gib": round(size_gib, 4),
        "pause_mode": cfg.pause_mode,
        "ratio_native_vs_extension": r_ext["median"],
        "ratio_native_vs_extension_min": r_ext["min"],
        "ratio_native_vs_extension_max": r_ext["max"],
        "ratio_native_vs_disk_reload": r_disk["median"],
        "ratio_native_vs_disk_reload_min": r_disk["min"],
        "ratio_native_vs_disk_reload_max": r_disk["max"],
        "native_s": round(med["native"], 4),
        "extension_s": round(med["extension"], 4),
        "disk_reload_s": round(med["disk"], 4),
        "engine_side_native_s": round(statistics.median(pairs["engine"]["native"]), 4),
        "engine_side_extension_s": round(statistics.median(pairs["engine"]["extension"]), 4),
        # the native path's seconds per route (median over the pairs): pause, start, update, finish, [drop_kv,] resume
        "native_routes_s": {k: round(statistics.median(r[k] for r in pairs["routes"]), 4) for k in pairs["routes"][0]},
        "inflight_native_keep_max_gap_s": inflight_field("native", "max_gap_s"),
        "inflight_native_keep_typical_gap_s": inflight_field("native", "typical_gap_s"),
        "inflight_native_keep_gap_ratio": inflight_field("native", "gap_ratio"),
        "inflight_native_keep_update_s": inflight_field("native", "update_s"),
        "inflight_native_keep_completed": inflight_field("native", "completed"),
        "inflight_extension_max_gap_s": inflight_field("extension", "max_gap_s"),
        "inflight_extension_typical_gap_s": inflight_field("extension", "typical_gap_s"),
        "inflight_extension_gap_ratio": inflight_field("extension", "gap_ratio"),
        "inflight_extension_update_s": inflight_field("extension", "update_s"),
        "inflight_extension_completed": inflight_field("extension", "completed"),
        "answers_correct": bench.correct,
        "native_runs_s": [round(x, 4) for x in runs["native"]],
        "extension_runs_s": [round(x, 4) for x in runs["extension"]],
        "disk_reload_runs_s": [round(x, 4) for x in runs["disk"]],
        "ratio_native_vs_extension_runs": [round(x, 3) for x in pairs["ratio_ext"]],
        "ratio_native_vs_disk_reload_runs": [round(x, 3) for x in pairs["ratio_disk"]],
        "inflight_runs": {p: v["runs"] for p, v in inflight.items()},
        "server_first_answer_s": round(start_s, 2),
        "ps_register_s": round(bench.register_s, 3),
        "cpu": cpu_model(),
        "config": dataclasses.asdict(cfg),
        "bench_s": round(time.monotonic() - t_bench, 1),
    }
    print(json.dumps(result), flush=True)
    ok = bench.correct and all(v["completed"] and v["spanned"] for v in inflight.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
