"""Self-healing, as a user sees it: the RL job on the checkpoint-engine daemon's two vLLM engines, one
engine SIGKILLed during the run, healed by the daemon while the other keeps serving.

    .venv/bin/python examples/self_heal_demo.py [--iterations 6] [--kill-after-iteration 2]

1. `torchrun --nproc-per-node 2 -m checkpoint_engine --engine-cmd "python -m vllm_ext.launch ..."`:
   one vLLM engine per rank, started by the daemon (`--load-rendezvous {rendezvous}`: vLLM's load
   step receives the current version from the rank's parameter server; never dummy weights)
2. `python -m orchestrator --set engine.type=daemon ...`: the demo task's RL job on those engines
3. once the job has finished the iteration named, engine 1's processes are SIGKILLed; the demo
   prints every state change GET /engines reports (serving -> failed -> starting -> updating ->
   serving) with its time, then the job's own count of the event
Everything runs on this machine, on 127.0.0.1; every process ends with the demo (Ctrl-C included).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def get_engines(base: str) -> dict:
    """GET /engines; OSError while the daemon is not listening."""
    from ckpt_common.httpjson import status_json

    code, body = status_json("GET", base + "/engines", timeout_s=10.0)
    if code != 200:
        raise OSError(f"GET /engines answered {code}: {body}")
    return body


def iterations_done(metrics_path: pathlib.Path) -> int:
    if not metrics_path.exists():
        return 0
    return sum(1 for line in metrics_path.read_text().splitlines() if '"rollout_engine_requests"' in line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--kill-after-iteration", type=int, default=2)
    p.add_argument("--work-dir", default=None, help="logs, handoff files and the run (default: a temporary folder)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of the whole demo")
    args = p.parse_args()
    if not 1 <= args.kill_after_iteration < args.iterations:
        p.error("--kill-after-iteration must be >= 1 and below --iterations")
    sys.path.insert(0, str(REPO))  # run as a script from a checkout: testing/ is not installed
    from ckpt_common.procs import exit_on_signals
    from testing.daemon import DaemonStartError, repo_env, start_daemon

    exit_on_signals()  # SIGTERM unwinds like Ctrl-C: the finally block stops everything started
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="self-heal-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    handoff, run = work / "handoff", work / "run"
    env = repo_env(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    engine_cmd = [sys.executable, "-m", "vllm_ext.launch", "--model", str(handoff / "model"), "--port", "{port}"]
    print(
        "daemon:   torchrun --nproc-per-node 2 -m checkpoint_engine --engine-cmd 'python -m vllm_ext.launch ...' "
        f"(log: {work / 'daemon.log'})\nwork dir: {work}",
        flush=True,
    )
    deadline = time.monotonic() + args.timeout_s
    try:
        daemon = start_daemon(
            *("--collective-timeout-s", "900"),
            *("--engine-start-timeout-s", "1200", "--engine-log-dir", str(work)),
            # float32 like the job's own engines (engine.dtype): vLLM-CPU picks bfloat16 for "auto", slow or
            # failing where the CPU has no native bf16
            engine_cmd=[*engine_cmd, "--load-rendezvous", "{rendezvous}", "--", "--dtype", "float32"],
            env=env,
            log=work / "daemon.log",
            ready_timeout_s=args.timeout_s,
            interval_s=0.5,
        )
    except DaemonStartError as e:
        raise SystemExit(str(e)) from None
    base = daemon.url
    job_argv = [
        *(sys.executable, "-m", "orchestrator", "--config", str(REPO / "configs" / "demo.json")),
        *("--output-dir", str(run), "--no-progress", "--set", "engine.type=daemon"),
        *("--set", f"engine.endpoint={base}", "--set", f"sync.handoff_dir={handoff}"),
        *("--set", f"rl.num_iterations={args.iterations}"),
    ]
    job = None
    try:
        print(f"RL job:   python -m orchestrator ... engine.type=daemon (log: {work / 'job.log'})", flush=True)
        job = subprocess.Popen(
            job_argv, cwd=REPO, env=env, stdout=open(work / "job.log", "w"), stderr=subprocess.STDOUT
        )
        metrics = run / "metrics.jsonl"
        killed_at = None
        last_seen: list[tuple] = []
        while job.poll() is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"the demo ran past --timeout-s {args.timeout_s:.0f}")
            try:
                records = get_engines(base)["engines"]
            except OSError:
                records = []
            seen = [(r.get("state"), r.get("checkpoint"), r.get("pid")) for r in records]
            if seen != last_seen:
                t = "" if killed_at is None else f"  (+{time.monotonic() - killed_at:5.1f} s after the kill)"
                print(
                    "engines: " + " | ".join(f"r{i} {s} {c or '-'} pid {pid}" for i, (s, c, pid) in enumerate(seen)) + t
                )
                last_seen = seen
            if killed_at is None and iterations_done(metrics) >= args.kill_after_iteration and len(records) == 2:
                pid = records[1].get("pid")
                if pid:
                    print(
                        f"--- SIGKILL engine 1 (pid {pid} and its process group) after iteration "
                        f"{args.kill_after_iteration} ---",
                        flush=True,
                    )
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                    killed_at = time.monotonic()
            time.sleep(0.25)
        if job.returncode != 0:
            raise SystemExit(f"the RL job failed ({job.returncode}): see {work / 'job.log'}")
        summary = json.loads((run / "summary.json").read_text())
        pool = [json.loads(line) for line in metrics.read_text().splitlines() if "engine_recoveries" in line]
        last = pool[-1] if pool else {}
        print(
            f"the job finished: held-out {summary.get('heldout_accuracy_before')} -> "
            f"{summary.get('heldout_accuracy_after')}; engine failures {last.get('engine_failures')}, "
            f"recoveries {last.get('engine_recoveries')}, recovery_s {last.get('recovery_s')}"
        )
        return 0
    finally:
        if job is not None and job.poll() is None:
            job.send_signal(signal.SIGTERM)  # SIGINT may be ignored (a job started in the background)
            try:
                job.wait(60)
            except subprocess.TimeoutExpired:
                job.kill()
        daemon.stop(60)  # torchrun, its ranks and their engines


if __name__ == "__main__":
    raise SystemExit(main())
