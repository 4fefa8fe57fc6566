"""Push a checkpoint directory into a running vLLM server, in the flow (and with the flags) of
MoonshotAI checkpoint-engine's `examples/update.py`, on this project's ParameterServer.

    # vLLM as their README starts it (dev mode for /collective_rpc, dummy weights, the extension):
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR --port 19730 \\
        --load-format dummy --worker-extension-cls checkpoint_engine.worker.VllmColocateWorkerExtension
    # one PS rank per inference device; no need to wait for vLLM first:
    torchrun --nproc-per-node N examples/moonshot_update.py --checkpoint-path DIR --inference-parallel-size N \\
        --update-method all [--save-metas-file metas.json --sleep-time 300]
    # a new vLLM instance pulls the weights from the job above while it is alive (P2P):
    torchrun --nproc-per-node N examples/moonshot_update.py --load-metas-file metas.json --endpoint URL

    rank r: register its shard ─▶ wait for its engine's /health ─▶ gather_metas ─▶ [save metas, rank 0]
            ─▶ update(req_func)             broadcast: every rank's engine
            ─▶ update(req_func, ranks=...)  P2P: the first engine's ranks read from the owners
    join:   gather_metas (nothing registered here) ─▶ load_metas(file) ─▶ update(req_func, ranks=...)

Differences from theirs: the metas file is JSON (never pickle); every wait has a deadline; after
each update the engine's prefix cache is reset (cached KV of the old weights must not be reused).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from contextlib import contextmanager

logger = logging.getLogger("moonshot_update")

ENGINE_READY_TIMEOUT_S = 900.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-path", default=None, help="HF model directory with .safetensors files")
    p.add_argument("--save-metas-file", default=None, help="rank 0 writes the global metas here (JSON)")
    p.add_argument("--load-metas-file", default=None, help="join: pull the weights another job holds")
    p.add_argument("--sleep-time", type=int, default=0, help="seconds to stay alive afterwards (serve P2P)")
    p.add_argument("--endpoint", default="http://localhost:19730", help="the vLLM server")
    p.add_argument("--inference-parallel-size", type=int, default=8, help="devices (PS ranks) per engine")
    p.add_argument("--checkpoint-name", default="my-checkpoint-iter-0")
    p.add_argument("--update-method", choices=["broadcast", "p2p", "all"], default="broadcast")
    p.add_argument("--uds", default=None, help="reach the engine through this unix socket")
    p.add_argument("--custom-dist", default=None, help="distributed backend (only torch.distributed here)")
    args = p.parse_args(argv)
    if not args.load_metas_file and not args.checkpoint_path:
        p.error("--checkpoint-path is required unless --load-metas-file is given")
    if args.inference_parallel_size < 1:
        p.error("--inference-parallel-size must be >= 1")
    return args


@contextmanager
def timed(what: str):
    t0 = time.perf_counter()
    yield
    logger.info("%s took %.2f s", what, time.perf_counter() - t0)


# -- HTTP to the engine (TCP or unix socket) -------------------------------------------------
def _request(method: str, url: str, uds: str | None, timeout_s: float, body: dict | None = None) -> int:
    import http.client
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "localhost", parts.port or 80, timeout=timeout_s)
    if uds:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect(uds)
        conn.sock = sock
    try:
        conn.request(
            method,
            parts.path or "/",
            body=None if body is None else json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def wait_engine_ready(endpoint: str, uds: str | None, timeout_s: float = ENGINE_READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if _request("GET", endpoint + "/health", uds, 10.0) == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine at {endpoint} did not answer /health within {timeout_s:.0f} s")
        time.sleep(1.0)


def reset_prefix_cache(endpoint: str, uds: str | None) -> None:
    """Best effort: vLLM's dev-mode route; without it cached prefixes would reuse the old weights' KV."""
    try:
        status = _request("POST", endpoint + "/reset_prefix_cache", uds, 60.0)
    except OSError as e:
        status = f"{type(e).__name__}: {e}"
    if status != 200:
        logger.warning("could not reset the engine's prefix cache (%s): cached prefixes may use old weights", status)


def make_req_func(endpoint: str, engine_size: int, uds: str | None, rank: int):
    """The first rank of each engine asks it to receive, with its devices' socket paths."""
    from checkpoint_engine import request_inference_to_update

    first = rank // engine_size * engine_size

    def req_func(socket_paths: list[tuple[str, str]]) -> None:
        if rank == first:
            request_inference_to_update(
                endpoint + "/collective_rpc", dict(socket_paths[first : first + engine_size]), uds=uds
            )

    return req_func


# -- what each rank registers ----------------------------------------------------------------
def my_shard(checkpoint_path: str, rank: int, world_size: int) -> tuple[list[str], dict]:
    """(files, named_tensors) this rank registers: whole files, or with an index (not in /dev/shm)
    a contiguous slice of the tensor names, read from their files."""
    index = os.path.join(checkpoint_path, "model.safetensors.index.json")
    if os.path.exists(index) and not os.path.realpath(checkpoint_path).startswith("/dev/shm/"):
        from safetensors import safe_open

        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        names = sorted(weight_map)
        per = -(-len(names) // world_size)
        by_file: dict[str, list[str]] = {}
        for name in names[rank * per : (rank + 1) * per]:
            by_file.setdefault(weight_map[name], []).append(name)
        tensors = {}
        for file, file_names in by_file.items():
            with safe_open(os.path.join(checkpoint_path, file), framework="pt") as f:
                for name in file_names:
                    tensors[name] = f.get_tensor(name)
        return [], tensors
    files = sorted(os.path.join(checkpoint_path, f) for f in os.listdir(checkpoint_path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{checkpoint_path} holds no .safetensors file")
    per = -(-len(files) // world_size)
    return files[rank * per : (rank + 1) * per], {}


# -- the two flows ---------------------------------------------------------------------------
def serve_checkpoint(ps, args, req_func, rank: int, world_size: int) -> list[dict]:
    import checkpoint_engine.distributed as dist

    is_sender = rank % args.inference_parallel_size == 0
    ps.init_process_group()
    dist.barrier()
    files, tensors = my_shard(args.checkpoint_path, rank, world_size)
    with timed(f"register {len(files)} files / {len(tensors)} tensors"):
        ps.register_checkpoint(args.checkpoint_name, files=files, named_tensors=tensors)
    if is_sender:
        wait_engine_ready(args.endpoint, args.uds)
    dist.barrier()
    with timed("gather metas"):
        ps.gather_metas(args.checkpoint_name)
    if args.save_metas_file and rank == 0:
        tmp = args.save_metas_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(ps.get_metas(args.checkpoint_name), f)
        os.replace(tmp, args.save_metas_file)  # readers never see half a file
    done = []
    if args.update_method in ("broadcast", "all"):
        with timed("update (broadcast to every engine)"):
            m = ps.update(args.checkpoint_name, req_func)
        if is_sender:
            reset_prefix_cache(args.endpoint, args.uds)
        done.append({"method": "broadcast", "metrics": m.to_dict() if m is not None else None})
    if args.update_method in ("p2p", "all"):
        receivers = list(range(args.inference_parallel_size))
        with timed(f"update (P2P to ranks {receivers})"):
            m = ps.update(args.checkpoint_name, req_func, ranks=receivers)
        if is_sender and rank in receivers:
            reset_prefix_cache(args.endpoint, args.uds)
        done.append({"method": "p2p", "metrics": m.to_dict() if m is not None else None})
    return done


def join(ps, args, req_func, rank: int) -> list[dict]:
    import checkpoint_engine.distributed as dist

    with open(args.load_metas_file) as f:
        metas = json.load(f)
    ps.init_process_group()
    if rank % args.inference_parallel_size == 0:
        wait_engine_ready(args.endpoint, args.uds)
    dist.barrier()
    with timed("gather metas before joining"):
        ps.gather_metas(args.checkpoint_name)
    ps.load_metas(metas)
    receivers = list(range(args.inference_parallel_size))
    with timed(f"update (P2P from the other job to ranks {receivers})"):
        m = ps.update(args.checkpoint_name, req_func, ranks=receivers)
    if rank == 0:
        reset_prefix_cache(args.endpoint, args.uds)
    return [{"method": "join", "metrics": m.to_dict() if m is not None else None}]


class _Stop(Exception):
    pass


def stay_alive(seconds: int) -> None:
    """Keep the registered weights available for `seconds`; SIGTERM ends the wait early (exit 0)."""
    import signal

    def stop(signum, frame):
        raise _Stop

    previous = signal.signal(signal.SIGTERM, stop)
    logger.info("staying alive %d s (other jobs may pull these weights; SIGTERM ends it)", seconds)
    try:
        time.sleep(seconds)
    except _Stop:
        logger.info("SIGTERM: done serving")
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv=None) -> int:
    args = parse_args(argv)
    for var in ("RANK", "WORLD_SIZE"):
        if var not in os.environ:
            print(f"error: ${var} is not set: run under torchrun", file=sys.stderr)
            return 2
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import checkpoint_engine.distributed as dist
    from checkpoint_engine import ParameterServer
    from ckpt_common.logs import setup_logging

    setup_logging("INFO", rank=rank)

    dist.use_backend(args.custom_dist)
    ps = ParameterServer(auto_pg=True)
    try:
        req_func = make_req_func(args.endpoint, args.inference_parallel_size, args.uds, rank)
        done = (
            join(ps, args, req_func, rank)
            if args.load_metas_file
            else serve_checkpoint(ps, args, req_func, rank, world_size)
        )
        print(json.dumps({"rank": rank, "pid": os.getpid(), "ok": True, "updates": done}), flush=True)
        if args.sleep_time > 0:
            stay_alive(args.sleep_time)
    finally:
        ps.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
