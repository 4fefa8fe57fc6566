"""The daemon topology on real vLLM engines: colocated switch times, heal time, N=1 vs N=2 rollouts.

    python benchmarks/bench_topology.py [--iterations 2] [--prompts 32] [--max-tokens 32] [--train-steps 2]
        [--model-size-mib 256] [--heal-mode p2p|local] [--engine-start load|dummy] [--pin-healed-engine]
        [--daemon-p2p-cpus all|healed] [--bucket-size-mib N] [--heals 3] [--raw-repeats 20]
        [--paired-repeats 5] [--idle-heals 1] [--a-rounds 3] [--work-dir DIR] [--keep] [--cpu-trace]
    python benchmarks/bench_topology.py --model-size-mib 0 --prompts 64 --max-tokens 64   # the demo's shape

One checkpoint-engine daemon (`torchrun --nproc-per-node 2 -m checkpoint_engine --engine-cmd ...`),
each rank managing one `python -m vllm_ext.launch` server bound to its share of
the CPUs (VLLM_CPU_OMP_THREADS_BIND from a file the engine command reads at each start), on a
Qwen2-like model of --model-size-mib float32 (random weights; default 256 MiB, about 10 minutes on
2 cores; 0: the demo's tiny shape, 16 MB). The default size is where a heal moves enough bytes for
its ratio to a raw read to measure the transfer: with the demo's 16 MB, a raw read of the other
rank's 8 MB takes 4-30 ms and the pull's fixed costs (engine connect, Done) of the same order decide
the ratio. The versions go
through the handoff dir in /dev/shm, as the RL job's `engine.type=daemon` does. Every engine start
(cold, colocated, heal) is one of two kinds (--engine-start):
  load   (default) `--load-rendezvous {rendezvous}`: vLLM's load step receives the version from the
         rank's PS (the daemon waits for the load step, updates through it, then for /health); vLLM
         packs the weights once, during its start
  dummy  `--no-initial-push`: vLLM starts on dummy weights; once /version answers the daemon pushes
         the version into the running engine, which packs them again

  cold start      start_daemon_pool: both engines start with v0, pool built
  (c) N=2         pool.generate over the prompts (one untimed warm-up round)   -> tokens_per_s_n2
  (a) colocated   --iterations times: rollout (pool.generate) -> before_train (POST /engines/stop)
                  -> train (AdamW steps of the HF model on the rollout's tokens) -> push(v+1)
                  (files, POST /checkpoints, POST /engines/start: start + update, pool takes
                  the new URLs) -> switch_to_train_s, switch_to_inference_s and their share of the
                  iteration
  (b) heal        engine A (rank 0) alone: --a-rounds rounds of the prompts -> a_before tokens/s.
                  Then SIGKILL rank 1's engine (B) while A keeps generating back to back; the daemon
                  notices, restarts B (with --pin-healed-engine the whole restarted
                  process tree under `taskset` on B's core) and pulls the current version from the
                  ranks' registered memory (update ranks=[1]): with --heal-mode p2p (default: the daemon
                  runs with --p2p-host 127.0.0.1 --mode collective, so a pull goes through Mooncake's
                  transfer engine over TCP; the colocated starts then broadcast over gloo) or local (the
                  restarted engine maps the owners' memfd chunks, nothing moves). With --heal-owners
                  others the trained weights are first registered once more on rank 0 alone
                  (POST /checkpoints owner_ranks [0]) and pushed: rank 1 holds nothing, so the pull
                  reads every byte it delivers (the raw reads then read the same bytes).
                  From GET /engines (polled every 50 ms: each state's `since`) and the daemon's
                  per-update metrics: detect_s, the engine's start without the pull (reported apart:
                  start_s = start_before_pull_s, process start until the load step or, dummy, until
                  healthy; + start_after_pull_s, load: vLLM packs, compiles, allocates its cache and
                  opens the gate), heal_pull_s (the update's total_s on the receiving rank) with its
                  phases, the engine's own report of the update (transfer_s, reload_tail_s), and side
                  by side in the same run:
                    raw_read_s   the same bytes (the buckets of the owners other than rank 1, rank 1
                                 reads its own in place), the same bucket plan and owners, read by a
                                 Mooncake transfer engine in a process of its own
                                 (checkpoint_engine.transport.mooncake; not this one, whose GIL
                                 engine A's client holds; started once, before A generates:
                                 `RawReader`) bucket by bucket into a registered double buffer, as
                                 the P2P mode does; no engine.
                                 Measured while engine A generates, as during the heal: median of
                                 --raw-repeats (_best_s, _first_s: the first, with the handshake;
                                 raw_read_batch_s: every bucket in one batch read into one buffer);
                                 raw_read_idle_*: the same with nothing else running here
                    ratio_heal_vs_raw_read = heal_pull_s / raw_read_s (with --heals N: B is killed
                                 N times in a row; heal_pull_s is the median, _each_s every one)
                    ratio_heal_vs_raw_read_paired  each pull over a raw read (median of
                                 --paired-repeats) taken right after that heal, A still generating:
                                 the median of the per-heal ratios (_each: every one). The load on
                                 2 cores varies from minute to minute, so a pair is closer than
                                 medians taken minutes apart
                    heal_pull_idle_s  (--idle-heals N, default 1) B killed N more times with A idle: the
                                 pulls' median beside raw_read_idle_s -> ratio_heal_vs_raw_read_idle;
                                 each pull over --paired-repeats raw reads right after it ->
                                 ratio_heal_vs_raw_read_idle_paired (median over the idle heals)
                    raw_read_all_idle_s  every byte the pull delivers into the engine, rank 1's own half
                                 too (over TCP from rank 1's transfer engine, where the pull reads it in
                                 place: more work than the pull's) -> ratio_heal_vs_raw_read_all_idle
                    raw_read_before_heals_*  (--read-before-heals N) the same raw read, N times before
                                 the first heal with A idle: the owners' transfer engines have then served
                                 a read before the heal's pull
                    memcpy_s     the version's safetensors files from /dev/shm (mmapped) copied into a
                                 warm buffer, best of --raw-repeats; ratio_heal_vs_memcpy
                    cpu_*        (--cpu-trace) the cores each process (and each thread of the healed
                                 engine's, rank 1's, rank 0's daemon and the raw reader) used during
                                 the heals' pulls (cpu_heal_pulls, cpu_idle_heal_pulls) and during the
                                 raw reads (cpu_paired_raw_read, cpu_raw_read, ...): who else ran
                  throughput_during_heal_ratio = A's tokens/s over its rounds that ran wholly between
                  the kill and B serving again / a_before (a_after: after the heal)
  (c) N=1         every engine stopped; rank 0's engine started alone bound to all CPUs
                  -> tokens_per_s_n1 over the same prompts

SIGTERM or Ctrl-C stops the daemon, which stops its engines. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from ckpt_common.procs import die_with_parent, exit_on_signals  # after the path insert

REPO = pathlib.Path(__file__).resolve().parents[1]
POLL_S = 0.05
# How often a heal asks the daemon for the engines' records. The phases come from the records' own
# clock, so only seeing `updating` (the pull and vLLM's finish, seconds) needs a poll within it; a
# faster poll kept the daemon's rank 0, whose transfer engine serves the pull, and this process
# busy during the pull and not during the raw reads it is compared with.
HEAL_POLL_S = 0.5
# --cpu-trace: processes whose threads are reported one by one (the healed engine's and rank 1's,
# which read the pull; rank 0's, whose transfer engine serves it; the raw reader)
THREADS_TRACED = ("r1:", "r0:checkpoint_engine", "raw reader")

# The engine command: the rank's CPU binding is read from <work>/bind-r<rank> at each start, so the
# N=1 run can give one engine every CPU without a second daemon.
ENGINE_SCRIPT = """#!/bin/sh
work="$1"; port="$2"; rank="$3"; rendezvous="$4"; pin=""
[ -s "$work/taskset-r$rank" ] && pin="taskset -c $(cat "$work/taskset-r$rank")"
VLLM_CPU_OMP_THREADS_BIND="$(cat "$work/bind-r$rank")" exec $pin "{python}" -m vllm_ext.launch \\
  --model "{model}" --host 127.0.0.1 --port "$port" {start_flags} --startup-timeout-s "{timeout}" {p2p_flags} -- \\
  --dtype float32 --max-model-len {max_model_len} --max-num-seqs 256 --block-size 32 \\
  --enable-prefix-caching --seed 0 --disable-log-stats
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=2, help="colocated iterations (each: one stop, one start)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per rollout / throughput round")
    p.add_argument("--max-tokens", type=int, default=32, help="max new tokens per prompt")
    p.add_argument("--train-steps", type=int, default=2, help="AdamW steps per colocated iteration")
    p.add_argument("--model-size-mib", type=int, default=256, help="model size; 0: the demo's shape (16 MB)")
    p.add_argument("--heal-mode", choices=["p2p", "local"], default="p2p", help="how the healed engine pulls")
    p.add_argument(
        "--engine-start",
        choices=["load", "dummy"],
        default="load",
        help="load: weights through vLLM's load step; dummy: dummy weights, push once healthy",
    )
    p.add_argument(
        "--p2p-reader",
        choices=["rank", "engine"],
        default="rank",
        help="who reads the heal's pull: the daemon's rank (into its shared buffer) or the engine (into its weights)",
    )
    p.add_argument(
        "--engine-p2p-cpus",
        choices=["all", "engine"],
        default="all",
        help="with --p2p-reader engine: the engine's transfer-engine threads run on every CPU (all) or on "
        "the engine's own (engine: where vLLM's binding and --pin-healed-engine put it)",
    )
    p.add_argument(
        "--daemon-p2p-cpus",
        choices=["all", "healed"],
        default="all",
        help="with --heal-mode p2p: the daemon ranks' transfer-engine threads (those serving the owners' "
        "reads) on every CPU (all) or on the healed engine's CPUs, off engine A's (healed: --p2p-cpus)",
    )
    p.add_argument(
        "--pin-healed-engine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the restarted engine's whole process tree on its own core (taskset) during the heal",
    )
    p.add_argument(
        "--heal-owners",
        choices=["split", "others"],
        default="split",
        help="split: the healed rank holds half the version and reads it in place (what the RL job's pushes "
        "do); others: the version is registered on rank 0 alone, so the pull reads every byte from it",
    )
    p.add_argument("--bucket-size-mib", type=int, default=None, help="the daemon's bucket size (default: its own)")
    p.add_argument("--raw-repeats", type=int, default=20, help="repeats of the raw reads (best taken)")
    p.add_argument("--heals", type=int, default=3, help="heals in a row (the pull's median is reported)")
    p.add_argument(
        "--paired-repeats",
        type=int,
        default=5,
        help="raw reads right after each heal, A still generating (ratio_heal_vs_raw_read_paired)",
    )
    p.add_argument(
        "--idle-heals",
        type=int,
        default=1,
        help="after the heals during engine A's rollouts, this many with A idle, each followed by "
        "--paired-repeats raw reads (heal_pull_idle_s vs raw_read_idle_s; 0: none)",
    )
    p.add_argument(
        "--read-before-heals",
        type=int,
        default=0,
        help="raw reads of the pull's bytes from the owners right before the first heal, engine A idle "
        "(raw_read_before_heals_*): the owners' transfer engines then serve a read before the heal's (0: none)",
    )
    p.add_argument("--a-rounds", type=int, default=3, help="engine A's rounds before the heal (after a warm-up)")
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="deadline of every engine start")
    p.add_argument("--work-dir", default=None, help="default: a fresh folder in /dev/shm (shared memory)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, metrics)")
    p.add_argument(
        "--cpu-trace",
        action="store_true",
        help="sample every process's CPU time (benchmarks/cpu_trace.py): the cores each used during the "
        "heals' pulls and during the raw reads beside them (cpu_*; ~1-2%% of a core)",
    )
    args = p.parse_args(argv)
    positive = ("iterations", "prompts", "max_tokens", "train_steps", "raw_repeats", "paired_repeats", "a_rounds")
    if args.read_before_heals < 0:
        p.error(f"--read-before-heals={args.read_before_heals} must be >= 0")
    for name in (*positive, "heals"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.bucket_size_mib is not None and args.bucket_size_mib < 1:
        p.error(f"--bucket-size-mib={args.bucket_size_mib} must be >= 1")
    if args.model_size_mib < 0:
        p.error(f"--model-size-mib={args.model_size_mib} must be >= 0 (0: the demo's tiny shape)")
    if args.max_tokens > 200:
        p.error(f"--max-tokens={args.max_tokens} must be <= 200 (engines run with --max-model-len 256)")
    return args


# -- the daemon ----------------------------------------------------------------------------------------
def engine_p2p_flags(p2p_reader: str, engine_start: str, engine_p2p_cpus: str) -> str:
    """The launcher's flags for an engine that reads its heal itself: its transfer engine is up while
    its load step waits, its threads on every CPU ("all") or where the engine runs ("engine": the
    launcher's own CPU set, which the pinned engine's taskset narrows)."""
    if p2p_reader != "engine" or engine_start != "load":
        return ""
    flags = "--p2p-host 127.0.0.1"
    if engine_p2p_cpus == "all":
        flags += " --p2p-cpus " + ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return flags


def start_daemon(
    work: pathlib.Path,
    model: pathlib.Path,
    start_timeout_s: float,
    heal_mode: str = "local",
    engine_start: str = "load",
    bucket_size_mib: int | None = None,
    p2p_reader: str = "rank",
    engine_p2p_cpus: str = "all",
    daemon_p2p_cpus: str | None = None,
) -> tuple[subprocess.Popen, str]:
    from ckpt_common.httpjson import status_json
    from ckpt_common.ports import free_port

    script = work / "engine.sh"
    script.write_text(
        ENGINE_SCRIPT.replace("{python}", sys.executable)
        .replace("{model}", str(model))
        .replace("{timeout}", str(start_timeout_s))
        .replace("{max_model_len}", "256")
        .replace("{start_flags}", '--load-rendezvous "$rendezvous"' if engine_start == "load" else "--no-initial-push")
        # the engine reads the heal itself: its transfer engine starts while its load step waits
        .replace("{p2p_flags}", engine_p2p_flags(p2p_reader, engine_start, engine_p2p_cpus))
    )
    port = free_port()
    rendezvous, health = (["{rendezvous}"], "/health") if engine_start == "load" else ([], "/version")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())),
        *("-m", "checkpoint_engine", "--port", str(port), "--collective-timeout-s", "900"),
        *("--engine-cmd", json.dumps(["sh", str(script), str(work), "{port}", "{rank}", *rendezvous])),
        # dummy: vLLM's own /version (the gate's /health opens only after the push); load: the gate's
        *("--engine-health-path", health, "--engine-start-timeout-s", str(start_timeout_s)),
        *("--engine-log-dir", str(work), "--metrics-jsonl", str(work / "updates.jsonl")),
    ]
    if bucket_size_mib is not None:
        cmd += ["--bucket-size-mib", str(bucket_size_mib)]
    if heal_mode == "p2p":  # a pull (ranks=[...]) with mode collective and Mooncake goes P2P, even on one host
        cmd += ["--p2p-host", "127.0.0.1", "--mode", "collective", "--p2p-reader", p2p_reader]
        if daemon_p2p_cpus:
            cmd += ["--p2p-cpus", daemon_p2p_cpus]
    daemon = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=open(work / "daemon.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the stop below reaches torchrun's ranks
        preexec_fn=die_with_parent,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited with code {daemon.returncode}; see {work / 'daemon.log'}")
        try:
            if status_json("GET", base + "/health", timeout_s=2.0)[0] == 200:
                return daemon, base
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon's API did not answer within 180 s; see {work / 'daemon.log'}")
        time.sleep(0.2)


def stop_daemon(daemon: subprocess.Popen, base: str, graceful: bool) -> None:
    """``graceful``: POST /shutdown (the daemon stops its engines once its running command ends); then,
    or at once when interrupted (a command may wait minutes for an engine start), SIGTERM to the
    daemon's process group (torchrun and its ranks), SIGKILL after 30 s. The engines end with their
    rank (PR_SET_PDEATHSIG)."""
    from ckpt_common.httpjson import call_json

    if graceful and daemon.poll() is None:
        try:
            call_json("POST", base + "/shutdown", {}, timeout_s=10.0)
            daemon.wait(120)
        except Exception:  # noqa: BLE001 - not answering: signals below
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if daemon.poll() is not None:
            break
        try:
            os.killpg(daemon.pid, sig)
            daemon.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


# -- measurements --------------------------------------------------------------------------------------
def make_requests(tokenizer, num: int, max_tokens: int, tag: str):
    from orchestrator.engine_pool.base import GenRequest

    return [
        GenRequest(f"{tag}-{i}", tuple(tokenizer(f"{i * 37 % 90 + 10}+{i * 53 % 90 + 10}=")["input_ids"]), max_tokens)
        for i in range(num)
    ]


def rollout(pool, tokenizer, args, tag: str) -> tuple[float, int, list[list[int]]]:
    """One pool.generate over the prompts: (seconds, output tokens, prompt + response token ids)."""
    from orchestrator.engine_pool.base import SamplingSettings

    requests = make_requests(tokenizer, args.prompts, args.max_tokens, tag)
    start = time.monotonic()
    results = pool.generate(requests, SamplingSettings(temperature=1.0, top_p=1.0), timeout_s=600.0)
    seconds = time.monotonic() - start
    by_id = {r.request_id: r for r in results}
    sequences = [list(q.prompt_token_ids) + list(by_id[q.request_id].token_ids) for q in requests]
    return seconds, sum(len(r.token_ids) for r in results), sequences


def throughput(pool, tokenizer, args, tag: str) -> dict:
    rollout(pool, tokenizer, args, f"{tag}-warmup")  # first requests after a start pay one-off costs
    seconds, tokens, _ = rollout(pool, tokenizer, args, tag)
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}


def train_steps(trainer, optimizer, sequences: list[list[int]], steps: int) -> float:
    """``steps`` AdamW steps of next-token loss on the rollout's sequences (the RL step's compute, not its loss)."""
    import torch

    start = time.monotonic()
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [trainer.pad_id] * (width - len(s)) for s in sequences])
    labels = torch.tensor([s + [-100] * (width - len(s)) for s in sequences])
    for _ in range(steps):
        optimizer.zero_grad()
        trainer.model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    return time.monotonic() - start


def memcpy_s(files: list[str], repeats: int) -> tuple[float, int]:
    """Best time of a plain copy of the files' bytes from shared memory (mmapped) into a warm buffer."""
    import torch

    maps, views = [], []
    for path in files:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable view for torch; never written
        maps.append(m)
        views.append(torch.frombuffer(m, dtype=torch.uint8))
    total = sum(v.numel() for v in views)
    dst = torch.ones(total, dtype=torch.uint8)  # touched once: the copy is what is timed
    best = float("inf")
    for _ in range(repeats):
        start, offset = time.perf_counter(), 0
        for v in views:
            dst[offset : offset + v.numel()].copy_(v)
            offset += v.numel()
        best = min(best, time.perf_counter() - start)
    del views
    for m in maps:
        m.close()
    return best, total


def mooncake_raw_read(
    metas: dict, bucket_size_bytes: int, receiver: int | None, repeats: int, key: str = "raw_read"
) -> dict:
    """The bytes a P2P pull into `receiver` moves, read with a Mooncake transfer engine of our own.

    Same metas (owners' Mooncake addresses and chunk pointers), same bucket plan as the pull
    (`plan_buckets` at the pull's bucket size); the receiver's own buckets are left out, as the P2P
    mode reads them in place (`receiver` None: every bucket, each from its owner's transfer engine).
    Per bucket into half `index % 2` of a registered double buffer (what `P2PSource.fill` does,
    without an engine), and all buckets in one batch read into one buffer."""
    import torch

    from checkpoint_engine.buckets import DEFAULT_ALIGN_BYTES, align_up, plan_buckets
    from checkpoint_engine.jobs import GlobalMetas
    from checkpoint_engine.transport.mooncake import P2PConfig, P2PStore

    g = GlobalMetas.from_dict(metas)
    buckets = [b for b in plan_buckets(g.rank_metas, bucket_size_bytes) if receiver is None or b.owner_rank != receiver]
    if not buckets:
        return {f"{key}_bytes": 0}
    stride = align_up(bucket_size_bytes, DEFAULT_ALIGN_BYTES)
    total = sum(b.size_bytes for b in buckets)
    store = P2PStore(P2PConfig())
    double = torch.ones(2 * stride, dtype=torch.uint8)  # touched: the reads are what is timed
    whole = torch.ones(total, dtype=torch.uint8)
    store.register(double.data_ptr(), double.numel())
    store.register(whole.data_ptr(), whole.numel())

    def remote(b) -> int:
        return g.chunk_ptrs[b.owner_rank][b.chunk] + b.start_bytes

    per_bucket, batch, windows = [], [], []
    try:
        for _ in range(repeats):
            t0, wall0 = time.perf_counter(), time.time()
            for b in buckets:
                local = double.data_ptr() + (b.index % 2) * stride
                store.read(g.p2p_addrs[b.owner_rank], local, remote(b), b.size_bytes)
            per_bucket.append(time.perf_counter() - t0)
            windows.append((wall0, time.time()))
        for _ in range(repeats):
            t0, offset = time.perf_counter(), 0
            for owner in sorted({b.owner_rank for b in buckets}):
                mine = [b for b in buckets if b.owner_rank == owner]
                locals_ = []
                for b in mine:
                    locals_.append(whole.data_ptr() + offset)
                    offset += b.size_bytes
                store.read_batch(g.p2p_addrs[owner], locals_, [remote(b) for b in mine], [b.size_bytes for b in mine])
            batch.append(time.perf_counter() - t0)
    finally:
        store.close()
    return {
        f"{key}_s": round(statistics.median(per_bucket), 5),
        f"{key}_best_s": round(min(per_bucket), 5),
        f"{key}_first_s": round(per_bucket[0], 5),
        f"{key}_batch_s": round(statistics.median(batch), 5),
        f"{key}_bytes": total,
        f"{key}_buckets": len(buckets),
        f"{key}_windows": windows,  # each bucket-by-bucket read's wall-clock span (RawReader keeps them)
    }


def paired_ratios(heals: list[dict], raws: list[float], key: str) -> dict:
    """Each heal's pull over the raw read taken right after it, and their median (nothing without raws)."""
    if not raws:
        return {}
    each = [round(h["heal_pull_s"] / r, 2) for h, r in zip(heals, raws, strict=True)]
    return {
        f"raw_read_{key}_each_s": raws,
        f"ratio_heal_vs_raw_read_{key}_each": each,
        f"ratio_heal_vs_raw_read_{key}": round(statistics.median(each), 3),
    }


def raw_read_args(daemon, healed: dict, repeats: int) -> tuple | None:
    """`RawReader.read`'s arguments for the bytes of the pull in `healed` (None: no Mooncake)."""
    metas = daemon._call("GET", f"/metas/{healed['checkpoint']}")["ranks"][0]["result"]
    if not metas.get("p2p_addrs"):
        return None
    return metas, healed["bucket_size_bytes"], 1, repeats


class RawReader:
    """`mooncake_raw_read` in a process of its own, started once while the machine is quiet.

    Not this process: it runs engine A's rollout client, whose GIL would slow the reads (the pull ran
    in the daemon's rank process). Started once because importing torch pins the importing thread
    to each CPU in turn (CPU detection), and on this VM such a move under full load once stalled in
    the kernel for minutes. Every request has a deadline; past it the process is killed, not waited for.
    """

    def __init__(self, timeout_s: float = 120.0):
        self.windows: dict[str, list[tuple[float, float]]] = {}  # key -> the reads' wall-clock spans
        here = str(REPO / "benchmarks")
        code = f"import sys; sys.path.insert(0, {here!r}); import bench_topology as b; b.serve_raw_reads()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        self._ask({"op": "ping"}, timeout_s)

    def read(self, metas: dict, bucket_size_bytes: int, receiver: int, repeats: int, key: str, timeout_s=600.0):
        req = {"metas": metas, "bucket_size_bytes": bucket_size_bytes, "receiver": receiver, "repeats": repeats}
        answer = self._ask({"op": "read", **req, "key": key}, timeout_s)
        self.windows.setdefault(key, []).extend(map(tuple, answer.pop(f"{key}_windows", [])))
        return answer

    def _ask(self, req: dict, timeout_s: float) -> dict:
        import selectors

        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                self.proc.kill()
                raise TimeoutError(f"the raw reader did not answer {req['op']!r} within {timeout_s:g} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the raw reader exited (code {self.proc.poll()}) during {req['op']!r}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"raw read failed: {answer['error']}")
        return answer

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()  # not waited for: a process stuck in the kernel may not go at once


def serve_raw_reads() -> None:
    """The raw reader's loop: one JSON request per stdin line, one JSON answer per stdout line."""
    import torch  # noqa: F401 - imported before the ping's answer, while the machine is quiet

    out, sys.stdout = sys.stdout, sys.stderr  # anything else printed goes to stderr
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "ping":
                answer = {"ok": True}
            else:
                answer = mooncake_raw_read(
                    req["metas"], req["bucket_size_bytes"], req["receiver"], req["repeats"], key=req["key"]
                )
        except Exception as e:  # noqa: BLE001 - reported to the benchmark
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


class Generator:
    """Rounds of the prompts on one engine, back to back on a thread, each round's (start, end, tokens)."""

    def __init__(self, pool, tokenizer, args, tag: str):
        import threading

        self.rounds: list[tuple[float, float, int]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._args = (pool, tokenizer, args, tag)
        self._t = threading.Thread(target=self._run, name="engine-a", daemon=True)

    def _run(self) -> None:
        pool, tokenizer, args, tag = self._args
        i = 0
        try:
            while not self._stop.is_set():
                start = time.time()
                _, tokens, _ = rollout(pool, tokenizer, args, f"{tag}-{i}")
                self.rounds.append((start, time.time(), tokens))
                i += 1
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def start(self) -> Generator:
        self._t.start()
        return self

    def stop(self, timeout_s: float = 600.0) -> list[tuple[float, float, int]]:
        self._stop.set()
        self._t.join(timeout_s)
        if self.error is not None:
            raise RuntimeError(f"engine A's generation failed during the heal: {self.error}") from self.error
        return self.rounds


def rate(rounds: list[tuple[float, float, int]]) -> dict:
    seconds = sum(end - start for start, end, _ in rounds)
    tokens = sum(t for _, _, t in rounds)
    return {
        "rounds": len(rounds),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
    }


def last_update(work: pathlib.Path, rank: int, checkpoint: str | None = None) -> dict:
    """`rank`'s last successful update (of `checkpoint`, when given) in the daemon's metrics file."""
    lines = (work / "updates.jsonl").read_text().splitlines()
    return [
        m
        for m in map(json.loads, lines)
        if m.get("rank") == rank and m.get("ok") and checkpoint in (None, m.get("checkpoint"))
    ][-1]


def heal(client, work: pathlib.Path, timeout_s: float) -> dict:
    """SIGKILL rank 1's engine; the daemon's heal, phase by phase."""
    victim = client.engines()["engines"][1]
    current = client.engines()["current"]
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.time()
    since: dict[str, float] = {}  # state -> when the healed engine entered it (the record's own clock)
    deadline = time.monotonic() + timeout_s
    while True:
        record = client.engines()["engines"][1]
        if record["state"] == "failed" or record.get("pid") not in (None, victim["pid"]):
            since.setdefault(record["state"], record["since"])
        if record["state"] == "serving" and record["pid"] != victim["pid"] and record["checkpoint"] == current:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 1's engine was not healed within {timeout_s:.0f} s (last record: {record})")
        time.sleep(HEAL_POLL_S)
    pull = last_update(work, 1, current)  # the heal's update on the receiving rank
    failed_at = (record.get("last_failure") or {}).get("at", since.get("failed"))
    # starting -> updating: process start until the load step (load) or until healthy (dummy);
    # updating -> serving: the pull, then (load) vLLM's packing, compile, cache and gate. When the poll
    # missed `updating` (a dummy start's pull shorter than a poll), all of the rest is before the pull.
    read_s, reads, engine = pull["broadcast_s"], {}, {}
    if pull["mode"] == "p2p_engine":  # the engine read the pull: its own account of the reads
        engine = engine_reload_report(record["url"]) or {}
        reads = engine.get("engine_reads") or {}
        read_s = reads.get("read_s") or 0.0
    start_s = since["serving"] - since["starting"] - pull["total_s"]
    before = (since["updating"] - since["starting"]) if "updating" in since else start_s
    after = start_s - before
    return {
        "checkpoint": current,
        "url": record["url"],
        "killed_at": killed_at,
        "serving_at": since["serving"],
        "detect_s": round(failed_at - killed_at, 3),
        "start_s": round(start_s, 3),
        "start_before_pull_s": round(before, 3),
        "start_after_pull_s": round(after, 3),
        "heal_pull_s": round(pull["total_s"], 4),
        "pull_window": (pull["started_at_s"], pull["started_at_s"] + pull["total_s"]),  # for --cpu-trace
        "heal_pull_bytes": pull["total_bytes"],
        "heal_pull_mode": pull["mode"],
        "heal_pull_buckets": pull["num_buckets"],
        "bucket_size_bytes": pull["bucket_size_bytes"],
        # the pull's phases on the receiving rank (UpdateMetrics): buffers and link, engine connect, P2P
        # reads (p2p mode; broadcast_s in the metrics), waiting for the engine's acks, status exchanges,
        # Done -> post_hook, link closed and buffers released
        "heal_pull_phases": {
            "open_s": round(pull["open_s"], 4),
            "setup_s": round(pull["setup_s"], 4),
            "read_s": round(read_s, 4),
            "engine_wait_s": round(pull["engine_wait_s"], 4),
            "agree_s": round(pull["agree_s"], 4),
            "finish_s": round(pull["finish_s"], 4),
            "close_s": round(pull["close_s"], 4),
        },
        # the engine's own Hello -> Ready (p2p_engine): waiting for its transfer engine, the slowest
        # connection to an owner, placing the tensors (beside the connections; probed_in_update 0 when
        # every slot was found while vLLM started)
        "engine_begin": {
            **{k: reads[k] for k in ("start_s", "te_start_s", "connect_s", "destination_s", "ahead_s") if k in reads},
            **{k: engine[k] for k in ("probed_ahead", "probed_in_update") if engine.get(k) is not None},
        },
        "recovery_s": record["recovery_s"],
        "kill_to_serving_s": round(since["serving"] - killed_at, 3),
    }


def engine_reload_report(url: str) -> dict | None:
    """The healed engine's own account of its last update (vLLM worker: transfer_s, reload_tail_s)."""
    from vllm_ext.extension_req import collective_rpc

    try:
        report = collective_rpc(url, "weights_state", timeout_s=30.0)[0]
    except Exception as e:  # noqa: BLE001 - informative only
        return {"error": f"{type(e).__name__}: {e}"}
    last = report.get("last_update") or {}
    return {
        **{
            k: last.get(k)
            for k in (
                "transfer_s",
                "reload_tail_s",
                "total_s",
                "num_buckets",
                "nbytes",
                "mode",
                "engine_reads",
                "loaders_s",
                "num_loaded_by_read",
                "probed_ahead",
                "probed_in_update",
            )
        },
        "reload_impl": report.get("reload_impl"),
    }


def main(argv=None) -> dict:
    exit_on_signals((signal.SIGTERM,))  # SIGTERM unwinds like Ctrl-C: the finally below stops the daemon
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from demo.tiny_model import TinyModelConfig, make_tiny_model
    from orchestrator.config import EngineConfig, SyncConfig
    from orchestrator.engine_pool.daemon import DaemonWeightSync, _http_engine, start_daemon_pool
    from orchestrator.engine_pool.daemon_client import write_version
    from orchestrator.engine_pool.pool import EnginePool
    from orchestrator.engine_pool.pool_members import SERVING, Member
    from orchestrator.engine_pool.pool_servers import BATCH_SIZE, cpu_binds
    from trainer.base import TrainerConfig
    from trainer.hf import HFTrainer

    cpus = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(len(cpus))
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="bench-topology-", dir="/dev/shm"))
    work.mkdir(parents=True, exist_ok=True)
    handoff = work / "handoff"
    handoff.mkdir(exist_ok=True)
    model_config = (
        TinyModelConfig.for_size_bytes(args.model_size_mib * 2**20, dtype="float32")
        if args.model_size_mib
        else TinyModelConfig.tiny()
    )
    model = make_tiny_model(work / "sft", model_config, seed=0)
    for rank, bind in enumerate(cpu_binds(cpus, 2)):
        (work / f"bind-r{rank}").write_text(bind)
    load = os.getloadavg()
    out: dict = {
        "cpu": _cpu_model(),
        "cpus": len(cpus),
        "loadavg_at_start": [round(x, 2) for x in load],
        "model_bytes": model_config.num_params() * 4,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "heal_mode": args.heal_mode,
        "engine_start": args.engine_start,
        "healed_engine_pinned": args.pin_healed_engine,
        "heal_owners": args.heal_owners,
        "p2p_reader": args.p2p_reader,
        "engine_p2p_cpus": args.engine_p2p_cpus if args.p2p_reader == "engine" else None,
        "daemon_p2p_cpus": args.daemon_p2p_cpus,
    }
    daemon, base = start_daemon(
        work,
        handoff / "model",
        args.start_timeout_s,
        args.heal_mode,
        args.engine_start,
        args.bucket_size_mib,
        args.p2p_reader,
        args.engine_p2p_cpus,
        (work / "bind-r1").read_text() if args.daemon_p2p_cpus == "healed" else None,
    )
    pool = sync = None
    finished = False
    try:
        engine_config = EngineConfig(type="daemon", endpoint=base, start_timeout_s=args.start_timeout_s)
        started = time.monotonic()
        pool = start_daemon_pool(engine_config, str(model), str(handoff), timeout_s=300.0)
        out["cold_start_2_engines_s"] = round(time.monotonic() - started, 2)
        tokenizer = AutoTokenizer.from_pretrained(model)
        out["n2"] = throughput(pool, tokenizer, args, "n2")
        print(f"N=2: {out['n2']}", flush=True)

        # (a) colocated iterations
        sync = DaemonWeightSync(
            SyncConfig(timeout_s=300.0, handoff_dir=str(handoff)),
            pool,
            colocated=True,
            start_timeout_s=args.start_timeout_s,
        )
        trainer = HFTrainer(model, TrainerConfig(lr=1e-5, num_threads=len(cpus)))
        optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-5)
        iterations = []
        for i in range(args.iterations):
            rollout_s, tokens, sequences = rollout(pool, tokenizer, args, f"it{i}")
            to_train_s = sync.before_train()["switch_to_train_s"]
            train_s = train_steps(trainer, optimizer, sequences, args.train_steps)
            t0 = time.monotonic()
            pushed = sync.push(trainer.named_tensors(), version=i + 1)
            push_s = time.monotonic() - t0
            it = {
                "rollout_s": round(rollout_s, 3),
                "rollout_tokens_per_s": round(tokens / rollout_s, 1),
                "switch_to_train_s": round(to_train_s, 3),
                "train_s": round(train_s, 3),
                "push_s": round(push_s, 3),  # files + register + switch_to_inference + unregister
                "switch_to_inference_s": round(pushed.switch["switch_to_inference_s"], 3),
                "update_in_start_s": pushed.update_s,
            }
            it["iteration_s"] = round(rollout_s + to_train_s + train_s + push_s, 3)
            it["switch_share"] = round((to_train_s + pushed.switch["switch_to_inference_s"]) / it["iteration_s"], 3)
            iterations.append(it)
            print(f"colocated iteration {i + 1}: {it}", flush=True)
        out["colocated"] = {
            "iterations": iterations,
            **{
                f"mean_{k}": round(sum(it[k] for it in iterations) / len(iterations), 3)
                for k in ("switch_to_train_s", "switch_to_inference_s", "iteration_s", "switch_share")
            },
        }

        # (b) heal of a SIGKILLed engine (B, rank 1) while engine A (rank 0) keeps generating
        if args.heal_owners == "others":  # the trained weights once more, held by rank 0 alone
            name = "bench-heal-owner-r0"
            files = write_version(handoff, name, trainer.named_tensors(), 1)
            pool.daemon.register(name, files, owner_ranks=[0])
            pool.daemon.update(name, None)
        records = pool.daemon.engines()["engines"]
        reader = RawReader() if args.heal_mode == "p2p" else None  # started before A generates
        trace = None
        if args.cpu_trace:
            from cpu_trace import CpuTrace  # benchmarks/ is first on sys.path when run as a script

            names = {os.getpid(): "bench", **({reader.proc.pid: "raw reader"} if reader else {})}
            trace = CpuTrace(os.getpid(), names=names, threads_of=THREADS_TRACED).start()

        a_pool = EnginePool(
            [Member(0, engine=_http_engine(engine_config, records[0]["url"]), state=SERVING)],
            max_inflight_per_engine=256,
            batch_size=BATCH_SIZE,
        )
        try:
            rollout(a_pool, tokenizer, args, "a-warmup")
            before = Generator(a_pool, tokenizer, args, "a-before").start()
            while len(before.rounds) < args.a_rounds:
                time.sleep(POLL_S)
            a_before = rate(before.stop())
            warm = {}
            if reader and args.read_before_heals:
                raw = raw_read_args(pool.daemon, last_update(work, 1), args.read_before_heals)
                warm = reader.read(*raw, key="raw_read_before_heals") if raw else {}
            if args.pin_healed_engine:  # read by the engine command at the restart
                (work / "taskset-r1").write_text((work / "bind-r1").read_text())
            during = Generator(a_pool, tokenizer, args, "a-during").start()
            heals, paired = [], []
            try:
                for _ in range(args.heals):
                    heals.append(heal(pool.daemon, work, args.start_timeout_s + 120))
                    # right after each heal, while A still generates: the raw read beside this pull
                    raw = reader and raw_read_args(pool.daemon, heals[-1], args.paired_repeats)
                    if raw:
                        paired.append(reader.read(*raw, key="paired")["paired_s"])
            finally:
                rounds = during.stop()
                (work / "taskset-r1").unlink(missing_ok=True)
            inside = [r for r in rounds if any(h["killed_at"] <= r[0] and r[1] <= h["serving_at"] for h in heals)]
            # the last heal's details; the pull's time and read phase as the median over the heals
            healed = {k: v for k, v in heals[-1].items() if k != "engine_begin"}  # each heal's: the list below
            healed["heals"] = len(heals)
            healed["heal_pull_each_s"] = [h["heal_pull_s"] for h in heals]
            healed["heal_pull_read_each_s"] = [h["heal_pull_phases"]["read_s"] for h in heals]
            healed["heal_pull_begin_each"] = [h["engine_begin"] for h in heals]
            healed["heal_pull_s"] = round(statistics.median(healed["heal_pull_each_s"]), 4)
            healed["heal_pull_read_s"] = round(statistics.median(healed["heal_pull_read_each_s"]), 4)
            healed.update(paired_ratios(heals, paired, "paired"))
            healed.update(warm)
            a_during = rate(inside)
            after = Generator(a_pool, tokenizer, args, "a-after").start()
            while len(after.rounds) < args.a_rounds:
                time.sleep(POLL_S)
            a_after = rate(after.stop())
            # The raw Mooncake read of the pull's bytes: once with nothing else running here, once while
            # engine A generates as it did during the heal (the conditions the pull ran under)
            raw = reader and raw_read_args(pool.daemon, healed, args.raw_repeats)
            if raw:
                healed.update(reader.read(*raw, key="raw_read_idle"))
                # every byte the pull delivers, the rank's own half too (read from its own rank over TCP)
                healed.update(reader.read(raw[0], raw[1], None, raw[3], key="raw_read_all_idle"))
                busy = Generator(a_pool, tokenizer, args, "a-raw").start()
                try:
                    while not busy.rounds:  # A is generating at full speed
                        time.sleep(POLL_S)
                    healed.update(reader.read(*raw, key="raw_read"))
                finally:
                    busy.stop()
            healed["engine_reload"] = engine_reload_report(healed.pop("url"))
            idle_heals, idle_paired = [], []
            for _ in range(args.idle_heals):  # heals with engine A idle: the pull beside raw_read_idle_*
                if args.pin_healed_engine:
                    (work / "taskset-r1").write_text((work / "bind-r1").read_text())
                try:
                    idle_heals.append(heal(pool.daemon, work, args.start_timeout_s + 120))
                finally:
                    (work / "taskset-r1").unlink(missing_ok=True)
                raw = reader and raw_read_args(pool.daemon, idle_heals[-1], args.paired_repeats)
                if raw:  # right after this pull, still with nothing else running
                    idle_paired.append(reader.read(*raw, key="idle_paired")["idle_paired_s"])
            if idle_heals:
                idle = idle_heals[-1]
                healed["heal_pull_idle_each_s"] = [h["heal_pull_s"] for h in idle_heals]
                healed["heal_pull_idle_begin_each"] = [h["engine_begin"] for h in idle_heals]
                healed["heal_pull_idle_s"] = round(statistics.median(healed["heal_pull_idle_each_s"]), 4)
                healed["heal_pull_idle_phases"] = idle["heal_pull_phases"]
                healed["engine_reload_idle"] = engine_reload_report(idle["url"])
            healed.update(paired_ratios(idle_heals, idle_paired, "idle_paired"))
            if trace is not None:  # the cores each process used during the pulls, and during the raw reads
                for key, pulls in (("heal_pulls", heals), ("idle_heal_pulls", idle_heals)):
                    healed[f"cpu_{key}"] = CpuTrace.merge([trace.window(*h["pull_window"]) for h in pulls])
                for key, windows in reader.windows.items() if reader else ():
                    name = key if key.startswith("raw_read") else f"{key}_raw_read"
                    healed[f"cpu_{name}"] = CpuTrace.merge([trace.window(*w) for w in windows])
        finally:
            if trace is not None:
                trace.stop()
            a_pool.close()
            if reader is not None:
                reader.close()
        del healed["killed_at"], healed["serving_at"], healed["pull_window"]
        if "raw_read_s" in healed:
            healed["raw_read"] = (
                "Mooncake transfer engine (TCP, a process of its own) reading the pull's buckets of the other owners "
                "from their registered chunks into a registered double buffer, bucket by bucket, while engine "
                f"A generates; median of {args.raw_repeats} (raw_read_idle_*: nothing else running here)"
            )
            healed["ratio_heal_vs_raw_read"] = round(healed["heal_pull_s"] / healed["raw_read_s"], 2)
            healed["ratio_pull_read_vs_raw_read"] = round(healed["heal_pull_read_s"] / healed["raw_read_s"], 2)
            if "heal_pull_idle_s" in healed:
                healed["ratio_heal_vs_raw_read_idle"] = round(healed["heal_pull_idle_s"] / healed["raw_read_idle_s"], 2)
                if healed.get("raw_read_all_idle_s"):
                    healed["ratio_heal_vs_raw_read_all_idle"] = round(
                        healed["heal_pull_idle_s"] / healed["raw_read_all_idle_s"], 2
                    )
        else:
            healed["raw_read"] = "not measured: the daemon has no Mooncake (--heal-mode local)"
        mc_s, mc_bytes = memcpy_s(
            sorted(str(f) for f in (handoff / healed["checkpoint"]).glob("*.safetensors")), args.raw_repeats
        )
        healed.update(
            memcpy_s=round(mc_s, 5),
            memcpy_bytes=mc_bytes,
            memcpy="the version's safetensors files from /dev/shm (mmapped) copied into a warm buffer",
            ratio_heal_vs_memcpy=round(healed["heal_pull_s"] / mc_s, 2),
        )
        out["heal"] = healed
        out["a_before"], out["a_during_heal"], out["a_after"] = a_before, a_during, a_after
        out["throughput_during_heal_ratio"] = (
            round(a_during["tokens_per_s"] / a_before["tokens_per_s"], 3) if a_during["tokens_per_s"] else None
        )
        print(f"heal: {healed}", flush=True)
        print(f"engine A: before {a_before}, during the heal {a_during}, after {a_after}", flush=True)

        # (c) N=1: rank 0's engine alone, on every CPU
        current = pool.daemon.engines()["current"]
        pool.daemon.stop_engines()
        pool.park()
        (work / "bind-r0").write_text(",".join(map(str, cpus)))
        pool.daemon.start_engines(current, timeout_s=args.start_timeout_s + 60, ranks=[0])
        url = pool.daemon.engines()["engines"][0]["url"]
        single = EnginePool(
            [Member(0, engine=_http_engine(engine_config, url), state=SERVING)],
            max_inflight_per_engine=256,
            batch_size=BATCH_SIZE,
        )
        try:
            out["n1"] = throughput(single, tokenizer, args, "n1")
        finally:
            single.close()
        print(f"N=1: {out['n1']}", flush=True)
        out["n2_vs_n1"] = round(out["n2"]["tokens_per_s"] / out["n1"]["tokens_per_s"], 3)
        for k in (
            *("heal_pull_s", "raw_read_s", "ratio_heal_vs_raw_read", "heal_pull_idle_s", "raw_read_idle_s"),
            *("ratio_heal_vs_raw_read_idle", "ratio_heal_vs_raw_read_all_idle", "ratio_heal_vs_raw_read_paired"),
            "ratio_heal_vs_raw_read_idle_paired",
            *("memcpy_s", "ratio_heal_vs_memcpy"),
        ):
            out[k] = out["heal"].get(k)  # the figures at the top level too
        out["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        finished = True
    finally:
        for component in (sync, pool):
            if component is not None:
                try:
                    component.close()
                except Exception as e:  # noqa: BLE001 - stop the daemon whatever happened
                    print(f"closing {type(component).__name__}: {e}", file=sys.stderr)
        stop_daemon(daemon, base, graceful=finished)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return out


def _cpu_model() -> str:
    from trainer.cpu import cpu_info

    return cpu_info()[0] or "unknown"


if __name__ == "__main__":
    result = main()
    print(json.dumps(result))
