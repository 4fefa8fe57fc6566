"""The RL job's own weight sync across hosts: a short k1.5 run whose engines are real vLLM on two other hosts.

    sudo python benchmarks/bench_hosts_rl.py [--rate-mbit 100] [--iterations 3] [--work-dir DIR]
        [--set KEY=VALUE ...]

The multi-host testbed (testing/hosts.py), every link shaped to R both ways:

    trainer   python -m orchestrator --config configs/demo.json --set engine.type=daemon
              --set sync.source=memory: the job's versions stay in its memory (a parameter server
              of one, Mooncake at this host's address), no version is a file
    inf0/1    one torchrun agent each (--nnodes 2, --mode relay, a bearer token): a daemon rank and
              its vLLM engine (python -m vllm_ext.launch --no-initial-push, float32, eager), the
              engine's worker bound to its own core

Each iteration the job hands the daemon the new version's metas (POST /metas) and POST /update:
inf0 reads each byte over the trainer's link once and broadcasts it to inf1, both engines reload.
The engines' `--model` folder (config and tokenizer, no weights) is the one the job writes at start
under `sync.handoff_dir`; the hosts share this machine's disk, and nothing else crosses that way.

Reported (medians over the iterations, min and max; the last line one JSON object):

    weight_sync_s                    the job's push of one version (register, metas, the daemon's
                                     update of both engines, the previous version released)
    weight_sync_update_s             the daemon's POST /update alone
    link_limit_s                     M / R, M = weight_sync_bytes (one full copy of the version)
    ratio_weight_sync_vs_link_limit  weight_sync_s / (M / R)
    daemon_updates                   the updates the daemon ran (rank 0's log): the engines' start
                                     with v0, the job's initial push of v0 (again: the trainer's
                                     tensors), then one per iteration
    ratio_trainer_tx_vs_updates      bytes the trainer's link sent over the whole run / (M x those
                                     updates): 1.0 is every update's bytes once over that link (the
                                     rollouts' prompts are in the numerator too)

The demo model is small (a few MB), so at 100 Mbit/s M/R is a fraction of a second and the sync's
fixed costs (vLLM's reload of both engines, the job's register and HTTP round trips) dominate: the
ratio says how far the job's sync is from the link's limit, not the relay's per-byte efficiency
(benchmarks/bench_hosts.py measures that). `--rate-mbit` lower makes the bytes matter more.

With `--set sync.delta=true` (and a bf16 model as `--set init_model_dir=DIR`, where RL steps leave
most values' bits unchanged) a version that changed little goes as its changed values, from the
job's memory too; M is then the full version's bytes, and the line adds `weight_sync_kinds` (full or
delta per iteration), `delta_share_of_full` (each delta's bytes / M) and
`delta_ratio_weight_sync_vs_bytes_limit` (each delta's sync seconds / (its bytes / R)).
Needs root for the testbed, vLLM and Mooncake; the SFT model is trained first if `--sft-cache-dir`
does not hold it (a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testing.hosts import Testbed

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-hosts-rl-token-0123456789"
PORT = 8400
# a small HTTP client run inside a host (the bench's own process is in the root namespace)
CLIENT = """
import json, sys, urllib.request as u, urllib.error as e
method, url, token = sys.argv[1], sys.argv[2], sys.argv[3]
h = {"Authorization": "Bearer " + token} if token != "-" else {}
r = u.Request(url, data=b"{}" if method == "POST" else None, headers=h, method=method)
try:
    with u.urlopen(r, timeout=60) as resp:
        print(json.dumps([resp.status, json.loads(resp.read() or b"{}")]))
except e.HTTPError as x:
    print(json.dumps([x.code, {}]))
"""


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate-mbit", type=float, default=100.0, help="every host's link, both directions")
    p.add_argument("--iterations", type=int, default=3, help="RL iterations (one version pushed after each)")
    p.add_argument("--work-dir", default=None, help="logs, the job's output and the handoff folder")
    p.add_argument("--sft-cache-dir", default=str(REPO / ".cache" / "sft"), help="where the demo's SFT model is")
    p.add_argument("--timeout-s", type=float, default=1500.0, help="the whole job's deadline")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more setting of the job, after the bench's own (e.g. sync.delta=true); repeatable",
    )
    args = p.parse_args(argv)
    if args.iterations < 1:
        p.error(f"--iterations={args.iterations} must be >= 1")
    if args.rate_mbit <= 0:
        p.error(f"--rate-mbit={args.rate_mbit} must be > 0")
    why = Testbed.unavailable()
    if why:
        print(json.dumps({"error": f"no testbed here: {why}"}))
        return 2
    from testing.host_sync import _env

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-hosts-rl-"))
    work.mkdir(parents=True, exist_ok=True)
    handoff, out = work / "handoff", work / "run"
    token_file = work / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    env = _env() | {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with Testbed(["trainer", "inf0", "inf1"], rate_mbit=args.rate_mbit) as bed:
        trainer, inf0 = bed["trainer"], bed["inf0"]
        api = f"http://{inf0.ip}:{PORT}"
        agents, logs = [], []
        for n, host in enumerate([bed["inf0"], bed["inf1"]]):
            engine = [sys.executable, "-m", "vllm_ext.launch", "--model", str(handoff / "model"), "--port", "{port}"]
            engine += ["--host", "0.0.0.0", "--no-initial-push", "--", "--dtype", "float32", "--enforce-eager"]
            agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n)]
            agent += ["--nproc-per-node", "1", "--master-addr", inf0.ip, "--master-port", "29500"]
            agent += ["-m", "checkpoint_engine", "--host", "0.0.0.0", "--port", str(PORT)]
            agent += ["--token-file", str(token_file), "--mode", "relay", "--p2p-host", host.ip]
            agent += ["--engine-url-host", host.ip, "--engine-cmd", shlex.join(engine)]
            agent += ["--engine-health-path", "/version", "--engine-start-timeout-s", "900"]
            agent += ["--collective-timeout-s", "900", "--engine-log-dir", str(work / f"node{n}")]
            (work / f"node{n}").mkdir(exist_ok=True)
            logs.append(work / f"node{n}.log")
            # each host's engine worker on its own core (the 2 cores of this machine)
            host_env = env | {"VLLM_CPU_OMP_THREADS_BIND": str(n % (os.cpu_count() or 1))}
            agents.append(host.popen(agent, stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT, env=host_env))

        def tails() -> str:
            return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())

        def call(method: str, path: str) -> tuple[int, dict]:
            got = trainer.run([sys.executable, "-c", CLIENT, method, api + path, TOKEN], timeout_s=90, env=env)
            if got.returncode != 0:
                return 0, {"error": got.stderr[-500:]}
            return tuple(json.loads(got.stdout))

        try:
            deadline = time.monotonic() + 120
            while call("GET", "/health")[0] != 200:
                if any(a.poll() is not None for a in agents) or time.monotonic() > deadline:
                    print(json.dumps({"error": "the daemon did not start", "logs": tails()}))
                    return 1
                time.sleep(0.5)
            before = trainer.counters()
            job = [sys.executable, "-m", "orchestrator", "--config", str(REPO / "configs" / "demo.json")]
            job += ["--output-dir", str(out), "--no-progress", "--set", f"sft_cache_dir={args.sft_cache_dir}"]
            for key, value in {
                "engine.type": "daemon",
                "engine.endpoint": api,
                "sync.source": "memory",
                "sync.p2p_host": trainer.ip,
                "sync.handoff_dir": str(handoff),
                "rl.num_iterations": args.iterations,
                "eval.every_iterations": args.iterations,
                "eval.num_sampled_problems": 0,
                "data.num_heldout_per_level": 16,
                "rollout.iteration_token_budget": 4096,
                "rollout.max_new_groups_per_iteration": 16,
            }.items():
                job += ["--set", f"{key}={value}"]
            for override in args.overrides:
                job += ["--set", override]
            job_log = work / "job.log"
            started = time.monotonic()
            proc = trainer.popen(
                job, stdout=open(job_log, "w"), stderr=subprocess.STDOUT, env=env | {"CKPT_ENGINE_TOKEN": TOKEN}
            )
            try:
                code = proc.wait(timeout=args.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = None
            job_s = time.monotonic() - started
            sent = (trainer.counters() - before).tx_bytes
            if code != 0:
                print(json.dumps({"error": f"the RL job ended with {code}", "job_log": job_log.read_text()[-4000:]}))
                return 1
            code, res = call("GET", "/engines")
            states = [(e["state"], e["checkpoint"]) for e in res.get("engines", [])]
            status, _ = call("POST", "/shutdown")
            exits = []
            for a in agents:
                try:
                    exits.append(a.wait(timeout=60))
                except subprocess.TimeoutExpired:
                    exits.append(None)
        finally:
            for a in agents:
                if a.poll() is None:
                    a.kill()
                    a.wait()

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    syncs = [r for r in rows if "weight_sync_s" in r]
    if len(syncs) != args.iterations:
        print(json.dumps({"error": f"{len(syncs)} weight syncs in metrics.jsonl, expected {args.iterations}"}))
        return 1
    # M: one full version (with sync.delta the job records it: a delta's syncs carry less)
    nbytes = max(r.get("weight_sync_version_bytes", r["weight_sync_bytes"]) for r in syncs)
    deltas = [r for r in syncs if r.get("weight_sync_kind") == "delta"]
    rate_bytes_s = args.rate_mbit * 1e6 / 8
    updates = logs[0].read_text().count("checkpoint_engine.ps INFO: update '")
    limit_s = nbytes * 8 / (args.rate_mbit * 1e6)
    result = {
        "rate_mbit": args.rate_mbit,
        "iterations": args.iterations,
        "version_bytes": int(nbytes),
        "link_limit_s": round(limit_s, 4),
        "job_s": round(job_s, 1),
        "weight_sync_s": spread([r["weight_sync_s"] for r in syncs]),
        "weight_sync_update_s": spread([r["weight_sync_update_s"] for r in syncs]),
        "ratio_weight_sync_vs_link_limit": spread([r["weight_sync_s"] / limit_s for r in syncs]),
        "weight_sync_kinds": [r.get("weight_sync_kind", "full") for r in syncs],
        "delta_share_of_full": [round(r["weight_sync_bytes"] / nbytes, 3) for r in deltas],
        "delta_ratio_weight_sync_vs_bytes_limit": (
            spread([r["weight_sync_s"] / (r["weight_sync_bytes"] / rate_bytes_s) for r in deltas]) if deltas else None
        ),
        "trainer_tx_bytes": sent,
        "daemon_updates": updates,
        "ratio_trainer_tx_vs_updates": round(sent / (nbytes * updates), 3) if updates else None,
        "engines_at_end": states,
        "agents_exit": exits,
        "work_dir": str(work),
    }
    ok = states == [("serving", f"policy-v{args.iterations}")] * 2 and exits == [0, 0] and status == 200
    if not ok:
        result["error"] = "the engines did not both serve the last version, or the daemon did not stop cleanly"
    for r in syncs:
        keys = ("iteration", "weight_sync_s", "weight_sync_update_s", "weight_sync_bytes", "weight_sync_kind")
        print(json.dumps({k: r[k] for k in keys if k in r}))
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
