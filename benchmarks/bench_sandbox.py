"""Benchmark of the code sandbox: start latency against a plain subprocess, and throughput.

    1. start latency, measured side by side (interleaved, same interpreter and flags):
         plain      subprocess.run([python, -I, -S, -c, "print(1)"])
         sandbox    Sandbox.run(print(1)) through the warm pool (the service's path)
         cold       the same with no pool (bwrap + interpreter start on the critical path)
    2. throughput: the real service (python -m sandbox) under concurrent HTTP load
       of trivial programs, in runs per second per usable core; plus the CPU time one run costs
       (service, its sandboxes and this client), which still reads right on a busy machine.

Targets (issue 5): ratio_to_plain_p50 <= 2 and runs_per_s_per_core >= 25.
The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRIVIAL = "print(1)"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-starts", type=int, default=200, help="runs per start-latency series")
    p.add_argument("--load-s", type=float, default=10.0, help="duration of the throughput run")
    p.add_argument(
        "--concurrency", type=int, default=None, help="requests in flight during the throughput run (default 4 x cores)"
    )
    p.add_argument("--python", default="/usr/bin/python3", help="interpreter, inside and plain")
    return p.parse_args()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure_starts(num_starts: int, python: str) -> dict[str, list[float]]:
    from sandbox.config import SandboxConfig
    from sandbox.executor import Sandbox
    from sandbox.models import RunRequest

    warm = Sandbox(SandboxConfig(python_executable=python, pool_size=2))
    cold = Sandbox(SandboxConfig(python_executable=python, pool_size=0, uid_base=150_000))
    request = RunRequest(language="python", code=TRIVIAL)
    series: dict[str, list[float]] = {"plain": [], "sandbox": [], "cold": []}
    try:
        for _ in range(5):  # warm the page cache and the pool
            subprocess.run([python, "-I", "-S", "-c", TRIVIAL], capture_output=True, check=True)
            warm.run(request)
            cold.run(request)
        for _ in range(num_starts):
            t0 = time.perf_counter()
            plain = subprocess.run([python, "-I", "-S", "-c", TRIVIAL], capture_output=True)
            t1 = time.perf_counter()
            got = warm.run(request)
            t2 = time.perf_counter()
            got_cold = cold.run(request)
            t3 = time.perf_counter()
            if plain.stdout != b"1\n" or got.stdout != "1\n" or got_cold.stdout != "1\n":
                raise RuntimeError(f"wrong output: {plain.stdout!r} {got} {got_cold}")
            series["plain"].append(t1 - t0)
            series["sandbox"].append(t2 - t1)
            series["cold"].append(t3 - t2)
    finally:
        warm.close()
        cold.close()
    return series


def start_service(port: int, workers: int) -> subprocess.Popen:
    from ckpt_common.httpjson import status_json
    from ckpt_common.procs import die_with_parent

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sandbox",
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--max-queue",
            "1024",
            "--log-level",
            "WARNING",
        ],
        cwd=REPO,
        preexec_fn=die_with_parent,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sandbox service exited with {proc.returncode}")
        try:
            if status_json("GET", f"http://127.0.0.1:{port}/health", timeout_s=2)[0] == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.1)  # polling a starting server, bounded by the deadline
    proc.kill()
    raise RuntimeError("sandbox service did not become healthy within 60 s")


async def load(url: str, concurrency: int, duration_s: float) -> tuple[int, int, float]:
    """(ok runs, other answers, elapsed seconds) of `concurrency` clients posting back to back."""
    import asyncio

    import aiohttp

    counts = {"ok": 0, "other": 0}
    body = {"language": "python", "code": TRIVIAL}
    async with aiohttp.ClientSession(
        url, timeout=aiohttp.ClientTimeout(total=60), connector=aiohttp.TCPConnector(limit=concurrency)
    ) as client:
        started = time.perf_counter()
        stop_at = started + duration_s

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                async with client.post("/run", json=body) as resp:
                    ok = resp.status == 200 and (await resp.json())["stdout"] == "1\n"
                counts["ok" if ok else "other"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return counts["ok"], counts["other"], time.perf_counter() - started


def _cpu_s(times) -> float:
    return times.user + times.system + times.children_user + times.children_system


def measure_throughput(cores: int, concurrency: int, duration_s: float) -> dict:
    """Runs per second, and the CPU time they cost (service + its sandboxes + this client), so
    that a machine shared with other work can be read too: runs per CPU-second."""
    import asyncio
    import resource

    import psutil

    from ckpt_common.ports import free_port

    port = free_port()
    proc = start_service(port, workers=cores)
    try:
        asyncio.run(load(f"http://127.0.0.1:{port}", concurrency, 1.0))  # warm-up
        service = psutil.Process(proc.pid)
        cpu0 = _cpu_s(service.cpu_times())
        self0 = resource.getrusage(resource.RUSAGE_SELF)
        ok, other, elapsed = asyncio.run(load(f"http://127.0.0.1:{port}", concurrency, duration_s))
        cpu1 = _cpu_s(service.cpu_times())
        self1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        proc.terminate()
        rc = proc.wait(timeout=60)
    if rc != 0:
        raise RuntimeError(f"sandbox service exited with {rc}")
    client_cpu_s = (self1.ru_utime - self0.ru_utime) + (self1.ru_stime - self0.ru_stime)
    cpu_s = (cpu1 - cpu0) + client_cpu_s
    return {
        "ok": ok,
        "other": other,
        "elapsed_s": elapsed,
        "runs_per_s": ok / elapsed,
        "cpu_ms_per_run": 1e3 * cpu_s / max(ok, 1),
        "client_cpu_ms_per_run": 1e3 * client_cpu_s / max(ok, 1),
    }


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(REPO))
    from ckpt_common.procs import exit_on_signals

    exit_on_signals()  # SIGTERM unwinds like Ctrl-C: the finally blocks stop every server started
    from sandbox.bwrap import probe_bwrap

    reason = probe_bwrap()
    if reason is not None:
        print(f"cannot benchmark: {reason}")
        print(json.dumps({"error": reason, "targets_met": False}))
        return 1
    cores = len(os.sched_getaffinity(0))
    concurrency = args.concurrency or 4 * cores
    load_before = os.getloadavg()[0]
    series = measure_starts(args.num_starts, args.python)
    p50 = {name: statistics.median(v) for name, v in series.items()}
    p99 = {name: percentile(v, 0.99) for name, v in series.items()}
    for name in series:
        print(f"start {name:8s} p50 {p50[name] * 1e3:7.2f} ms   p99 {p99[name] * 1e3:7.2f} ms")
    thr = measure_throughput(cores, concurrency, args.load_s)
    per_core = thr["runs_per_s"] / cores
    print(
        f"throughput: {thr['ok']} runs in {thr['elapsed_s']:.1f} s over HTTP with {concurrency} "
        f"in flight = {thr['runs_per_s']:.1f}/s = {per_core:.1f}/s per core ({cores} cores); "
        f"{thr['other']} other answers"
    )
    print(
        f"cpu per run: {thr['cpu_ms_per_run']:.2f} ms (service + sandboxes + client; client "
        f"{thr['client_cpu_ms_per_run']:.2f} ms) = {1e3 / thr['cpu_ms_per_run']:.0f} runs per "
        f"CPU-second; 1-min load average {os.getloadavg()[0]:.1f} on {cores} cores"
    )
    ratio = p50["sandbox"] / p50["plain"]
    result = {
        "sandbox_start_p50_s": round(p50["sandbox"], 5),
        "sandbox_start_p99_s": round(p99["sandbox"], 5),
        "plain_start_p50_s": round(p50["plain"], 5),
        "plain_start_p99_s": round(p99["plain"], 5),
        "ratio_to_plain_p50": round(ratio, 3),
        "cold_sandbox_start_p50_s": round(p50["cold"], 5),
        "cold_sandbox_start_p99_s": round(p99["cold"], 5),
        "cold_ratio_to_plain_p50": round(p50["cold"] / p50["plain"], 3),
        "runs_per_s": round(thr["runs_per_s"], 2),
        "runs_per_s_per_core": round(per_core, 2),
        "cpu_ms_per_run": round(thr["cpu_ms_per_run"], 3),
        "runs_per_cpu_s": round(1e3 / thr["cpu_ms_per_run"], 1),
        "num_cores": cores,
        "concurrency": concurrency,
        "num_starts": args.num_starts,
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "targets_met": bool(ratio <= 2.0 and per_core >= 25.0),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
