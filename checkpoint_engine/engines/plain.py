"""A plain engine process: holds named weights in memory and receives updates like a vLLM worker.

Used by tests, the demo and the benchmark (and by GPU checks where vLLM cannot run). It serves
`POST /collective_rpc` (methods: update_weights_from_ipc, weights_state, weights_digest) and vLLM's
sleep routes (`POST /sleep?level=N`, `POST /wake_up[?tags=weights|kv_cache]`, `GET /is_sleeping`) on
127.0.0.1. Fault injection flags make failure tests possible.

    python -m checkpoint_engine.engines.plain --port 8100 [--device cpu|cuda:0] [--fail-on-bucket N]
        [--load-rendezvous ipc://PATH] [--workers N]

`--workers N` stands in for a tensor-parallel engine of N workers (`PlainWorkers`): an update names
one socket per worker (one parameter-server rank each, in order), each worker receives its own in a
thread and holds the whole model, and `/collective_rpc` answers one result per worker, as vLLM does.

With `--load-rendezvous` it first waits, like vLLM's `checkpoint_engine` load format, for a parameter
server to update it through that address (`checkpoint_engine.transport.load_rendezvous`), and listens on
`--port` only once the weights are in.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from ckpt_common.httpjson import JsonRequestHandler

logger = logging.getLogger(__name__)


class PlainEngine:
    def __init__(
        self,
        device: str = "cpu",
        fail_on_bucket: int | None = None,
        die_on_bucket: int | None = None,
        load_delay_s: float = 0.0,
        timeout_s: float = 120.0,
        sleep_mode: bool = True,
    ):
        import torch
        import zmq

        from checkpoint_engine.state import EngineWeightState
        from checkpoint_engine.transport.shm import MappingCache

        self.torch = torch
        self.mappings = MappingCache()
        self.device = torch.device(device)
        self.weights: dict[str, torch.Tensor] = {}
        self.state = EngineWeightState()
        self.ctx = zmq.Context()
        self.fail_on_bucket, self.die_on_bucket = fail_on_bucket, die_on_bucket
        self.load_delay_s, self.timeout_s = load_delay_s, timeout_s
        self._lock = threading.Lock()
        self.num_updates_started = 0
        self.sleep_mode = sleep_mode
        self.asleep: set[str] = set()  # the sleeping tags (weights, kv_cache); empty: awake
        self._offloaded: dict | None = None
        self._shapes: dict = {}
        from checkpoint_engine.transport.engine_reads import EngineReads

        # pulls this engine reads itself (p2p_reader="engine"): into the weights it holds, when they fit
        self.reads = EngineReads(self._destinations, read_timeout_s=timeout_s)
        self.last_engine_reads: dict | None = None

    def _destinations(self, items):
        out = []
        for name, dtype, shape in items:
            dst = self.weights.get(name)
            ok = dst is not None and dst.device.type == "cpu" and dst.dtype == dtype and tuple(dst.shape) == shape
            out.append(dst if ok else None)
        return out

    def update_weights_from_ipc(self, zmq_handles: dict[str, str]) -> dict:
        from checkpoint_engine.sharding.delta_sync import DeltaReceiver
        from checkpoint_engine.worker import update_weights_from_ipc

        if len(zmq_handles) != 1:
            raise ValueError(f"a plain engine serves one device, got handles for {sorted(zmq_handles)}")
        handle = next(iter(zmq_handles.values()))
        with self._lock:
            if "weights" in self.asleep:
                raise RuntimeError("the weights are asleep: wake them (POST /wake_up?tags=weights) before an update")
            self.num_updates_started += 1
            bucket = {"i": 0}
            # a delta update (checkpoint_engine.sharding.delta_sync) is applied after its last bucket,
            # onto the version held now, every base checksum checked before anything is written
            delta, held = DeltaReceiver(), self.state.report()["checkpoint"]

            def run(named):
                i = bucket["i"]
                bucket["i"] += 1
                if self.die_on_bucket is not None and i == self.die_on_bucket:
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.fail_on_bucket is not None and i == self.fail_on_bucket:
                    raise RuntimeError(f"injected failure while loading bucket {i}")
                if self.load_delay_s:
                    time.sleep(self.load_delay_s)
                for name, t in named:
                    if delta.take(name, t):
                        continue
                    dst = self.weights.get(name)
                    if dst is None or dst.shape != t.shape or dst.dtype != t.dtype:
                        self.weights[name] = t.to(self.device, copy=True)
                    else:
                        dst.copy_(t)

            device_id = self.device.index if self.device.type == "cuda" else None
            update_weights_from_ipc(
                self.ctx,
                handle,
                device_id,
                run=run,
                post_hook=lambda: delta.finish(self.weights, held, self.state),
                state=self.state,
                timeout_s=self.timeout_s,
                mapping_cache=self.mappings,
                remote_reads=self.reads,
            )
            self.last_engine_reads = self.reads.stats.report() if self.reads.stats.read_s else None
            self.reads.stats = type(self.reads.stats)()
            return self.state.report()

    def reset_weights(self) -> dict:
        """Forget all weights and versions, as a restarted engine would (tests, demos)."""
        from checkpoint_engine.state import EngineWeightState

        with self._lock:
            self.weights.clear()
            self.state = EngineWeightState()
            return self.state.report()

    def weights_state(self) -> dict:
        report = self.state.report()
        if self.last_engine_reads is not None:  # the last update was read by this engine itself
            report["engine_reads"] = self.last_engine_reads
        return report

    # vLLM's sleep mode, as its HTTP routes behave: level 1 keeps the weights in host memory, level 2
    # drops them (a wake gives back tensors of the right shapes with nothing meaningful in them: zeros)
    SLEEP_TAGS = ("weights", "kv_cache")

    def sleep(self, level: int) -> None:
        with self._lock:
            if level not in (1, 2):
                raise ValueError(f"level must be 1 or 2, got {level}")
            if self.asleep:
                raise RuntimeError("already sleeping")
            self._offloaded = {k: t.cpu().clone() for k, t in self.weights.items()} if level == 1 else None
            self._shapes = {k: (t.shape, t.dtype) for k, t in self.weights.items()}
            self.weights.clear()
            self.asleep = set(self.SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None) -> bool:
        """Wake `tags` (all when None); True once fully awake."""
        with self._lock:
            tags = tags or list(self.SLEEP_TAGS)
            unknown = sorted(set(tags) - set(self.SLEEP_TAGS))
            if unknown:
                raise ValueError(f"unknown tags {unknown}; known: {list(self.SLEEP_TAGS)}")
            if "weights" in tags and "weights" in self.asleep:
                if self._offloaded is not None:
                    self.weights = {k: t.to(self.device) for k, t in self._offloaded.items()}
                else:
                    z = self.torch.zeros
                    self.weights = {
                        k: z(shape, dtype=dt, device=self.device) for k, (shape, dt) in self._shapes.items()
                    }
                self._offloaded = None
            self.asleep -= set(tags)
            return not self.asleep

    def weights_digest(self) -> dict:
        from checkpoint_engine.checksum import tensor_checksum

        with self._lock:
            return {name: tensor_checksum(t) for name, t in self.weights.items()}

    def rpc(self, method: str, args: list) -> list:
        """`/collective_rpc`: one result (one worker)."""
        return [getattr(self, method)(*args)]


class PlainWorkers:
    """N plain workers in one process, as the N workers of a tensor-parallel engine: worker i takes the
    update of the i-th socket it is given (its own PS rank), all at once (the ranks send together)."""

    def __init__(self, num_workers: int, **kwargs):
        self.workers = [PlainEngine(**kwargs) for _ in range(num_workers)]
        self.sleep_mode = self.workers[0].sleep_mode

    @property
    def asleep(self) -> set[str]:
        return self.workers[0].asleep

    def rpc(self, method: str, args: list) -> list:
        """`/collective_rpc`: every worker's result, in worker order (an update: each its own socket)."""
        if method != "update_weights_from_ipc":
            return [getattr(w, method)(*args) for w in self.workers]
        handles = args[0] if args else {}
        if not isinstance(handles, dict) or len(handles) != len(self.workers):
            raise ValueError(f"this engine has {len(self.workers)} workers, got handles for {sorted(handles)}")
        results: list = [None] * len(self.workers)
        errors: list[BaseException] = []

        def run(i: int, key: str, path: str) -> None:
            try:
                results[i] = self.workers[i].update_weights_from_ipc({key: path})
            except BaseException as e:  # noqa: BLE001 - the first worker's failure is the update's
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i, *kv), daemon=True) for i, kv in enumerate(handles.items())]
        for t in threads:
            t.start()
        for t in threads:  # each worker's waits on its PS rank have their own deadline (timeout_s)
            t.join(self.workers[0].timeout_s * 2 + 30)
        if any(t.is_alive() for t in threads):
            raise TimeoutError("a worker's update did not end within its deadline")
        if errors:
            raise errors[0]
        return results

    def weights_state(self) -> dict:
        return self.workers[0].weights_state()

    def sleep(self, level: int) -> None:
        for w in self.workers:
            w.sleep(level)

    def wake_up(self, tags: list[str] | None) -> bool:
        awake = [w.wake_up(tags) for w in self.workers]  # every worker wakes, not only up to the first asleep
        return all(awake)


METHODS = ("update_weights_from_ipc", "weights_state", "weights_digest", "reset_weights")


def make_handler(engine: PlainEngine | PlainWorkers):
    class Handler(JsonRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                self.reply(200, {"ok": True, **engine.weights_state()})
            elif self.path == "/is_sleeping":
                self.reply(200, {"is_sleeping": bool(engine.asleep)})
            else:
                self.reply(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            from urllib.parse import parse_qs, urlsplit

            url = urlsplit(self.path)
            if url.path in ("/sleep", "/wake_up"):
                query = parse_qs(url.query)
                if not engine.sleep_mode:
                    return self.reply(400, {"error": "sleep mode is not enabled (--no-sleep-mode)"})
                try:
                    if url.path == "/sleep":
                        level = int(query.get("level", ["1"])[0])
                        engine.sleep(level)
                        return self.reply(200, {"status": "sleeping", "level": level})
                    awake = engine.wake_up(query.get("tags"))
                    return self.reply(200, {"status": "awake" if awake else "sleeping", "tags": query.get("tags")})
                except (ValueError, RuntimeError) as e:
                    return self.reply(400, {"error": str(e)})
            if self.path != "/collective_rpc":
                return self.reply(404, {"error": f"no route {self.path}"})
            try:
                body = self.read_json()
            except ValueError as e:
                return self.reply(400, {"error": str(e)})
            if not isinstance(body, dict):
                return self.reply(400, {"error": "request body must be a JSON object"})
            method, args = body.get("method"), body.get("args", [])
            if method not in METHODS:
                return self.reply(400, {"error": f"unknown method {method!r}; allowed: {list(METHODS)}"})
            if not isinstance(args, list):
                return self.reply(400, {"error": "args must be a list"})
            try:
                results = engine.rpc(method, args)
            except Exception as e:  # noqa: BLE001 - reported to the caller
                return self.reply(500, {"error": f"{type(e).__name__}: {e}", "state": engine.weights_state()})
            return self.reply(200, {"results": results})

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--fail-on-bucket", type=int, default=None, help="raise while loading this bucket (tests)")
    p.add_argument("--die-on-bucket", type=int, default=None, help="SIGKILL itself at this bucket (tests)")
    p.add_argument("--load-delay-s", type=float, default=0.0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="deadline for each wait on the PS")
    p.add_argument("--no-sleep-mode", action="store_true", help="refuse /sleep, as vLLM without sleep mode")
    p.add_argument(
        "--load-rendezvous",
        default=None,
        help="ipc:// or tcp:// address: receive the first weights there (a load step) before serving HTTP",
    )
    p.add_argument("--workers", type=int, default=1, help="workers of a tensor-parallel engine, one PS rank each (CPU)")
    args = p.parse_args(argv)
    if args.load_rendezvous is not None and not args.load_rendezvous.startswith(("ipc://", "tcp://")):
        p.error(f"--load-rendezvous must be an ipc:// or tcp:// address, got {args.load_rendezvous!r}")
    if args.workers < 1 or (args.workers > 1 and (args.load_rendezvous is not None or args.device != "cpu")):
        p.error(f"--workers {args.workers}: must be >= 1, and more than one runs on cpu without --load-rendezvous")
    from ckpt_common.logs import setup_logging

    setup_logging("INFO")
    kwargs = dict(
        device=args.device,
        fail_on_bucket=args.fail_on_bucket,
        die_on_bucket=args.die_on_bucket,
        load_delay_s=args.load_delay_s,
        timeout_s=args.timeout_s,
        sleep_mode=not args.no_sleep_mode,
    )
    engine = PlainEngine(**kwargs) if args.workers == 1 else PlainWorkers(args.workers, **kwargs)
    if args.load_rendezvous is not None:
        from checkpoint_engine.transport.load_rendezvous import serve_initial_load

        # a failed load raises: the process exits non-zero, as vLLM's start fails on a failed load
        serve_initial_load(args.load_rendezvous, engine.update_weights_from_ipc, timeout_s=args.timeout_s)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"plain engine listening on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
