"""Where vLLM's engine core runs on a CPU host: anywhere (vLLM's own) against its worker's cores.

    python benchmarks/bench_engine_core_cpus.py [--seconds 8] [--rounds 2] [--model-size-mib 256]

vLLM's engine core waits for its worker by spinning on a shared-memory queue (vllm_ext/
engine_core_cpus.py). For each mode (any: vLLM's placement; worker: the engine core bound to the
worker's CPUs, the launcher's default), one engine (`vllm_ext.serve` with the launcher's variable,
its worker bound to the first CPU as a pool engine's is) generates batches of `--prompts` prompts
back to back:

  alone        nothing else runs (`--rounds` windows of `--seconds`);
  beside       a competitor runs on the other CPUs: a process copying 64 MiB buffers (memory-bound,
               like a P2P read), counting its copies (`--rounds` windows, alternating with `alone`);
  idle         the competitor with the engine idle (its rate with nothing beside it).

Per mode: tokens/s alone and beside, the cores the engine core and the worker used, the competitor's
rate beside the engine over its rate beside the idle engine. Ratios worker / any of each; the last
line is one JSON object. Needs 2 or more CPUs; ~4 minutes at the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import select
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from _common import cpu_model, require_positive  # benchmarks/ is first on sys.path

COMPETITOR_GRACE_S = 30.0  # past its window, how long the competitor may take to print its count
COMPETITOR = """
import os, sys, time
os.sched_setaffinity(0, {cpus})
a, b = bytearray(64 << 20), bytearray(64 << 20)
for line in sys.stdin:
    end, n = time.monotonic() + float(line), 0
    while time.monotonic() < end:
        b[:] = a
        n += 1
    print(n, flush=True)
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=8.0, help="length of each window")
    p.add_argument("--rounds", type=int, default=2, help="alone/beside windows per mode")
    p.add_argument("--prompts", type=int, default=8, help="prompts per request")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per prompt")
    p.add_argument("--model-size-mib", type=int, default=256, help="model size (float32)")
    p.add_argument("--start-timeout-s", type=float, default=600.0, help="deadline of each engine start")
    args = p.parse_args(argv)
    require_positive(p, args, ("seconds", "rounds", "prompts", "max_tokens", "model_size_mib", "start_timeout_s"))
    return args


class Engine:
    """`python -m vllm_ext.serve serve MODEL` (no extension) with the engine core's placement, its
    worker on `bind`; `testing.vllm_servers.ServerProcess` runs it."""

    def __init__(self, model: pathlib.Path, engine_core_cpus: str, bind: str, log: pathlib.Path, timeout_s: float):
        from ckpt_common.ports import free_port
        from testing.vllm_servers import ServerProcess, child_env, vllm_serve_command
        from vllm_ext.engine_core_cpus import ENV

        self.model, port = model, free_port()
        args = (
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--block-size",
            "32",
            "--seed",
            "0",
            "--disable-log-stats",
        )
        cmd = vllm_serve_command(model, port, vllm_args=args, extension=False)
        env = child_env(VLLM_CPU_OMP_THREADS_BIND=bind, **{ENV: engine_core_cpus})
        self.server = ServerProcess(cmd, f"http://127.0.0.1:{port}", log, env=env)
        self.server.wait_for("/health", timeout_s=timeout_s)

    def generate(self, prompts: int, max_tokens: int) -> int:
        from ckpt_common.httpjson import post_json

        body = {
            "model": str(self.model),
            "prompt": [[1, 2, 3, 4, 5, 6, 7, 8]] * prompts,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
        }
        answer = post_json(self.server.url + "/v1/completions", body, timeout_s=120.0)
        return int(answer["usage"]["completion_tokens"])

    def processes(self) -> dict[str, object]:
        """vLLM's engine core and worker (psutil processes), by title."""
        import psutil

        out = {}
        for p in psutil.Process(self.server.proc.pid).children(recursive=True):
            try:
                name = p.name()
            except psutil.Error:
                continue
            for title in ("EngineCor", "Worker"):  # comm names are cut at 15 characters
                if title in name:
                    out[title] = p
        return out

    def close(self) -> None:
        self.server.stop()


def cpu_s(procs: dict) -> dict[str, float]:
    import psutil

    out = {}
    for title, p in procs.items():
        try:
            t = p.cpu_times()
            out[title] = t.user + t.system
        except psutil.Error:
            out[title] = 0.0
    return out


def window(engine: Engine, competitor, seconds: float, args, generate: bool) -> dict:
    """One window: the engine generating (or idle) for `seconds`, the competitor beside it or not."""
    procs = engine.processes()
    before, t0, tokens = cpu_s(procs), time.monotonic(), 0
    if competitor is not None:
        competitor.stdin.write(f"{seconds}\n")
        competitor.stdin.flush()
    while time.monotonic() - t0 < seconds:
        if generate:
            tokens += engine.generate(args.prompts, args.max_tokens)
        else:
            time.sleep(0.1)
    elapsed = time.monotonic() - t0
    after = cpu_s(procs)
    out = {
        "tokens_per_s": round(tokens / elapsed, 1),
        "cores": {k: round((after[k] - before[k]) / elapsed, 3) for k in after},
    }
    if competitor is not None:  # its count comes at the end of its own window of `seconds`
        ready, _, _ = select.select([competitor.stdout], [], [], seconds + COMPETITOR_GRACE_S)
        if not ready:
            raise TimeoutError(f"the competitor did not report within {seconds + COMPETITOR_GRACE_S:g} s")
        line = competitor.stdout.readline()
        if not line:
            raise RuntimeError(f"the competitor exited (code {competitor.poll()})")
        out["copies_per_s"] = round(int(line) / seconds, 2)
    return out


def measure(mode: str, model: pathlib.Path, work: pathlib.Path, args, cpus: list[int]) -> dict:
    engine = Engine(model, mode, str(cpus[0]), work / f"engine-{mode}.log", args.start_timeout_s)
    code = COMPETITOR.format(cpus=set(cpus[1:]))
    competitor = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        engine.generate(args.prompts, args.max_tokens)  # warm-up
        alone, beside = [], []
        for _ in range(args.rounds):
            alone.append(window(engine, None, args.seconds, args, generate=True))
            beside.append(window(engine, competitor, args.seconds, args, generate=True))
        idle = window(engine, competitor, args.seconds, args, generate=False)
    finally:
        competitor.kill()
        competitor.wait(10)
        engine.close()

    def med(values) -> float:
        return round(statistics.median(values), 3)

    bound = "engine core bound to its worker's CPUs" in (work / f"engine-{mode}.log").read_text()
    if bound != (mode == "worker"):
        raise RuntimeError(f"mode {mode!r}: the engine core was{'' if bound else ' not'} bound to its worker's CPUs")
    out = {
        "engine_core_cpus": mode,
        "tokens_per_s_alone": med([w["tokens_per_s"] for w in alone]),
        "tokens_per_s_beside": med([w["tokens_per_s"] for w in beside]),
        "engine_core_cores_alone": med([w["cores"].get("EngineCor", 0.0) for w in alone]),
        "engine_core_cores_beside": med([w["cores"].get("EngineCor", 0.0) for w in beside]),
        "worker_cores_alone": med([w["cores"].get("Worker", 0.0) for w in alone]),
        "competitor_copies_per_s_idle": idle["copies_per_s"],
        "competitor_copies_per_s_beside": med([w["copies_per_s"] for w in beside]),
    }
    out["competitor_share_beside"] = round(out["competitor_copies_per_s_beside"] / idle["copies_per_s"], 3)
    print(f"{mode}: {json.dumps(out)}", flush=True)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("bench_engine_core_cpus needs 2 or more CPUs (the worker on one, a competitor beside it)")
    from demo.tiny_model import TinyModelConfig, make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-engine-core-cpus-", dir="/dev/shm") as tmp:
        work = pathlib.Path(tmp)
        model = make_tiny_model(
            work / "model", TinyModelConfig.for_size_bytes(args.model_size_mib * 2**20, dtype="float32"), seed=0
        )
        anywhere = measure("any", model, work, args, cpus)
        worker = measure("worker", model, work, args, cpus)
    result = {
        "cpu": cpu_model(),
        "cpus": len(cpus),
        "model_size_mib": args.model_size_mib,
        "any": anywhere,
        "worker": worker,
        "ratio_tokens_alone_worker_vs_any": round(worker["tokens_per_s_alone"] / anywhere["tokens_per_s_alone"], 3),
        "ratio_tokens_beside_worker_vs_any": round(worker["tokens_per_s_beside"] / anywhere["tokens_per_s_beside"], 3),
        "ratio_competitor_beside_worker_vs_any": round(
            worker["competitor_copies_per_s_beside"] / anywhere["competitor_copies_per_s_beside"], 3
        ),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
