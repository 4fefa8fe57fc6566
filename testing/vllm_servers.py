"""Drive real vLLM servers from tests and benchmarks: processes, free ports, deadlines, requests.

Every wait polls a condition under a deadline and checks that the process is still alive; logs go
to files so a failure can show the server's last lines.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ckpt_common.httpjson import post_sse, status_json
from ckpt_common.ports import free_port
from ckpt_common.procs import (
    die_with_parent,
    group_pids,
    shm_segments,
    terminate_noting_segments,
    unlink_segments,
    wait_noting_segments,
)
from vllm_ext.launch_config import EXTENSION

REPO = Path(__file__).resolve().parents[1]
STOP_DURING_START_GRACE_S = 5.0  # ServerProcess.stop() before the server serves: SIGKILL after this
# Eager: vLLM keys its compile cache by the model's folder, and each test's model lives in a fresh tmp
# folder, so a compiled engine compiles at every start (about 45 s of a 60-110 s start on a 2-core
# CPU). test_vllm_compile_cache.py runs the compiled path: an engine that loads vLLM's compiled model,
# then takes a checkpoint-engine update and answers exactly as the engine that compiled it.
CPU_ENGINE_ARGS = (
    *("--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8", "--seed", "0"),
    "--enforce-eager",
)


def child_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra)
    return env


_FORK_INSTALLED = False


def cpu_llm(model_dir: str | Path, *, start_method: str = "fork", **overrides):
    """vLLM's in-process `LLM` on CPU as the engines here run (CPU_ENGINE_ARGS' settings, eager unless
    `enforce_eager=False`) with the repo's worker extension, on dummy weights (a push fills them) unless
    `load_format` says otherwise.

    Its engine core and worker are forked from this process (vllm_ext.start_method, as the launcher
    starts every engine of the project) unless `start_method="spawn"`: a spawned start imports vLLM
    twice more (~30 s on a slow 2-core CPU). Call it before this process runs any torch work (a forked
    child must not inherit a busy OpenMP pool)."""
    global _FORK_INSTALLED
    from vllm import LLM

    if start_method not in ("fork", "spawn"):
        raise ValueError(f"start_method must be 'fork' or 'spawn', got {start_method!r}")
    if start_method == "fork" and not _FORK_INSTALLED:
        from vllm_ext import start_method as vllm_start

        vllm_start.install(os.environ)
        _FORK_INSTALLED = True
    elif start_method == "spawn" and _FORK_INSTALLED:
        raise ValueError("this process already forks vLLM's processes: start a spawned LLM in another process")
    kwargs = dict(load_format="dummy", dtype="float32", max_model_len=256, max_num_seqs=8, seed=0, enforce_eager=True)
    return LLM(model=str(model_dir), **(kwargs | {"worker_extension_cls": EXTENSION} | overrides))


class LLMSyncClient:
    """vLLM's `VLLMWeightSyncClient` over an in-process `LLM`'s methods (what vLLM's HTTP client does
    over the server's routes), for `WeightTransferTrainerFactory.trainer_init` in one process."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version=None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)


def http_json(method: str, url: str, body: dict | None = None, *, timeout_s: float = 60.0) -> tuple[int, dict]:
    """(status, decoded answer) whatever the status (see `ckpt_common.httpjson.status_json`)."""
    return status_json(method, url, body, timeout_s=timeout_s)


def post_completions(
    base_url: str, model: str, prompts: Sequence[str], max_tokens: int, *, timeout_s: float = 120.0
) -> tuple[int, dict]:
    body = {
        "model": model,
        "prompt": list(prompts),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return http_json("POST", base_url.rstrip("/") + "/v1/completions", body, timeout_s=timeout_s)


def completion_token_ids(
    base_url: str, model: str, prompts: Sequence[str], max_tokens: int, *, timeout_s: float = 120.0
) -> list[list[int]]:
    """Greedy completions' token ids, in prompt order; RuntimeError on any non-200 answer."""
    status, body = post_completions(base_url, model, prompts, max_tokens, timeout_s=timeout_s)
    if status != 200:
        raise RuntimeError(f"completions at {base_url} answered {status}: {str(body)[:500]}")
    return [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])]


def completion_logprobs(
    base_url: str, model: str, prompts: Sequence[str], max_tokens: int, *, timeout_s: float = 120.0
) -> list[tuple[list[int], list[float]]]:
    """Greedy completions' (token ids, each token's logprob), in prompt order: a model that computes
    with other weights shows in the logprobs even where its greedy tokens happen to agree."""
    body = {
        "model": model,
        "prompt": list(prompts),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 1,
    }
    status, out = http_json("POST", base_url.rstrip("/") + "/v1/completions", body, timeout_s=timeout_s)
    if status != 200:
        raise RuntimeError(f"completions at {base_url} answered {status}: {str(out)[:500]}")
    choices = sorted(out["choices"], key=lambda c: c["index"])
    return [(c["token_ids"], [float(x) for x in c["logprobs"]["token_logprobs"]]) for c in choices]


def assert_same_logprobs(got: list, want: list, *, abs_tol: float = 1e-3) -> None:
    """Two `completion_logprobs` answers agree: the same tokens, each logprob within `abs_tol`."""
    assert [t for t, _ in got] == [t for t, _ in want], f"tokens differ: {got} vs {want}"
    worst = max(abs(a - b) for (_, la), (_, lb) in zip(got, want) for a, b in zip(la, lb))
    assert worst <= abs_tol, f"logprobs differ by up to {worst:.3g} (> {abs_tol}): {got} vs {want}"


def assert_kernels_checked(states: list[dict]) -> None:
    """Every worker's last reload checked its kernels against its weights, the head among them."""
    for rank, state in enumerate(states):
        check = state.get("kernel_check")
        assert check and check["modules_checked"] > 0 and not check["failed"], f"worker {rank}: {check}"


class StreamedCompletion:
    """One greedy completion streamed on a thread, one event per token, each token's arrival time
    noted: a request in flight while the weights change (`pause_across` measures what it saw).

    `prompt` is a string or a list of token ids. Every wait has a deadline; `timeout_s` also bounds
    each socket read (a stream that stalls longer fails)."""

    def __init__(
        self, base_url: str, model: str, prompt: str | list[int], max_tokens: int, *, timeout_s: float = 120.0
    ):
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.arrivals: list[tuple[float, int]] = []  # (monotonic time, token id), in order
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self._done = False
        self._cond = threading.Condition()
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
            "stream_interval": 1,
        }
        url = base_url.rstrip("/") + "/v1/completions"
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(url, body), name="streamed-completion", daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            for event in post_sse(url, body, timeout_s=self.timeout_s):
                now = time.monotonic()
                for choice in event.get("choices") or ():
                    with self._cond:
                        self.arrivals += [(now, int(t)) for t in choice.get("token_ids") or ()]
                        if choice.get("finish_reason") is not None:
                            self.finish_reason = choice["finish_reason"]
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread (result / wait_tokens)
            self.error = e
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    @property
    def token_ids(self) -> list[int]:
        with self._cond:
            return [t for _, t in self.arrivals]

    def wait_tokens(self, n: int, timeout_s: float) -> None:
        """Return once `n` tokens arrived; RuntimeError if the stream ended or failed first, TimeoutError
        after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.arrivals) < n:
                if self._done:
                    raise RuntimeError(
                        f"the stream ended after {len(self.arrivals)} of the {n} tokens waited for "
                        f"(finish_reason {self.finish_reason}, error {self.error!r})"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self.arrivals)} of {n} streamed tokens within {timeout_s:.0f} s")
                self._cond.wait(left)

    def result(self, timeout_s: float) -> list[int]:
        """All token ids once the stream ended; its error re-raised, TimeoutError after `timeout_s`."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the streamed completion did not end within {timeout_s:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"the streamed completion failed: {self.error!r}") from self.error
        return self.token_ids

    def pause_across(self, t0: float, t1: float) -> dict:
        """What the request saw of an event between monotonic times t0 and t1 (an update): the longest gap
        between two tokens with the event in between (or overlapping it), the typical gap (median of the
        others; the first token's wait is not a gap), and how many tokens came before t0 and after t1."""
        times = [t for t, _ in self.arrivals]
        events = [t for i, t in enumerate(times) if i == 0 or t != times[i - 1]]  # tokens of one event: one time
        gaps = list(itertools.pairwise(events))
        across = [b - a for a, b in gaps if a < t1 and b > t0]
        others = [b - a for a, b in gaps if not (a < t1 and b > t0)]
        return {
            "max_gap_across_s": round(max(across), 4) if across else None,
            "typical_gap_s": round(statistics.median(others), 4) if others else None,
            "tokens_before": sum(1 for t in times if t < t0),
            "tokens_after": sum(1 for t in times if t > t1),
            "tokens": len(times),
            "finish_reason": self.finish_reason,
        }


class ServerProcess:
    """A server subprocess with a log file; `stop()` returns its exit code."""

    def __init__(self, cmd: list[str], url: str, log_path: Path, env: dict | None = None):
        self.url = url
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            env=env or child_env(),
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def wait_for(
        self, path: str, *, timeout_s: float, ok=lambda status, body: status == 200, base_url: str | None = None
    ) -> dict:
        """Poll GET base_url+path (default: this server's url) while this process lives, until
        `ok(status, body)`; return the body."""
        url = (base_url or self.url) + path
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise RuntimeError(f"server exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                status, body = http_json("GET", url, timeout_s=5.0)
                if ok(status, body):
                    return body
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready within {timeout_s:.0f} s; log:\n{self.log_tail()}")
            time.sleep(0.05)  # readiness polling interval, bounded by the deadline

    def _serves(self) -> bool:
        """Whether the server answers its health route now (False while it starts)."""
        try:
            return http_json("GET", self.url + "/health", timeout_s=2.0)[0] == 200
        except (OSError, ValueError):  # refused, timed out, or not yet an HTTP server
            return False

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then SIGKILL to the whole session after `timeout_s`; the shared memory its
        processes mapped and a SIGKILL left behind is removed. Returns the exit code."""
        if self.alive():
            pgid = self.proc.pid  # the session we created: vLLM's children too

            def running() -> list[int]:
                self.proc.poll()  # reaps the leader once it exits
                return group_pids(pgid)

            if not self._serves():
                # still starting: vLLM's API server sits out SIGTERM until it serves, so the whole
                # session gets it (its engine core stops in a second or two) under a short grace
                noted = shm_segments(running())
                os.killpg(pgid, signal.SIGTERM)
                ended, more = wait_noting_segments(
                    running, min(timeout_s, STOP_DURING_START_GRACE_S), done=lambda: not running()
                )
                noted |= more
            else:  # until the whole session has ended, not only its leader
                ended, noted = terminate_noting_segments(self.proc, running, timeout_s, done=lambda: not running())
            if not ended:
                os.killpg(pgid, signal.SIGKILL)
                self.proc.wait(10)
            unlink_segments(noted)  # only those still there: a clean stop removed its own
        # the group can be gone while its leader is an unreaped zombie (group_pids leaves those out)
        self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


class LaunchedServer(ServerProcess):
    """`python -m vllm_ext.launch` on a free public port."""

    def __init__(
        self,
        model_dir: str | Path,
        log_path: Path,
        *,
        initial_push: bool = True,
        gate_wait_s: float = 0.0,
        engine_timeout_s: float = 600.0,
        reload_mode: str = "streaming",
        extra: Sequence[str] = (),
        vllm_args: Sequence[str] = CPU_ENGINE_ARGS,
    ):
        self.model = str(model_dir)
        self.port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "vllm_ext.launch",
            "--model",
            self.model,
            "--port",
            str(self.port),
            "--gate-wait-s",
            str(gate_wait_s),
            "--engine-timeout-s",
            str(engine_timeout_s),
            "--reload-mode",
            reload_mode,
            *extra,
        ]
        if not initial_push:
            cmd.append("--no-initial-push")
        super().__init__([*cmd, "--", *vllm_args], f"http://127.0.0.1:{self.port}", log_path)

    def status(self) -> dict:
        return http_json("GET", self.url + "/launcher/status", timeout_s=10.0)[1]

    def wait_listening(self, timeout_s: float = 120.0) -> dict:
        return self.wait_for("/launcher/status", timeout_s=timeout_s)

    def wait_ready(self, timeout_s: float = 600.0) -> dict:
        return self.wait_for("/launcher/status", timeout_s=timeout_s, ok=lambda s, b: s == 200 and b.get("ready"))

    def wait_engine_healthy(self, timeout_s: float = 600.0) -> str:
        """The internal vLLM URL once vLLM itself answers /health (weights may still be dummy)."""
        engine_url = self.wait_listening()["engine_url"]
        self.wait_for("/health", timeout_s=timeout_s, base_url=engine_url)
        return engine_url


def vllm_serve_command(
    model_dir: str | Path,
    port: int,
    *,
    vllm_args: Sequence[str] = CPU_ENGINE_ARGS,
    load_format: str = "auto",
    additional_config: dict | None = None,
    extension: bool = True,
) -> list[str]:
    """`vllm serve` (through vllm_ext.serve) loading the checkpoint itself; with the worker extension
    unless `extension` is False (vLLM exactly as a user without this project runs it)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm_ext.serve",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-format",
        load_format,
        *vllm_args,
    ]
    if extension:
        cmd += ["--worker-extension-cls", EXTENSION]
    if additional_config:
        cmd += ["--additional-config", json.dumps(additional_config)]
    return cmd


def start_push_ranks(
    model_dir: str | Path,
    engine_urls: Sequence[str],
    log_dir: Path,
    *,
    bucket_size_bytes: int | None = None,
    timeout_s: float = 60.0,
    tag: str = "push",
) -> list[ServerProcess]:
    """One `python -m vllm_ext.push` process per engine (rank r -> engine r), rendezvous on a free port."""
    port = free_port()
    world = len(engine_urls)
    procs = []
    for rank in range(world):
        cmd = [
            sys.executable,
            "-m",
            "vllm_ext.push",
            "--model",
            str(model_dir),
            "--rank",
            str(rank),
            "--world-size",
            str(world),
            "--master-port",
            str(port),
            "--timeout-s",
            str(timeout_s),
            "--transport",
            "cpu",
        ]
        for url in engine_urls:
            cmd += ["--engine-url", url]
        if bucket_size_bytes is not None:
            cmd += ["--bucket-size-bytes", str(bucket_size_bytes)]
        procs.append(ServerProcess(cmd, engine_urls[rank], Path(log_dir) / f"{tag}-r{rank}.log"))
    return procs


def wait_all(procs: Sequence[ServerProcess], timeout_s: float) -> list[tuple[int, str]]:
    """Wait for every process (one shared deadline); return (exit code, last JSON line or log tail)."""
    deadline = time.monotonic() + timeout_s
    out = []
    for p in procs:
        try:
            p.proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.stop(5)
            raise AssertionError(f"processes still running after {timeout_s:.0f} s:\n{p.log_tail()}") from None
        p.stop()
        lines = [ln for ln in p.log_tail(20000).splitlines() if ln.startswith("{")]
        out.append((p.proc.returncode, lines[-1] if lines else p.log_tail()))
    return out
