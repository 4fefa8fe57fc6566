"""Push a model directory's weights into running vLLM servers (one parameter-server rank each).

    python -m vllm_ext.push --model DIR --engine-url http://127.0.0.1:8000
    torchrun --nproc-per-node 2 -m vllm_ext.push --model DIR --engine-url URL0 --engine-url URL1

Rank r reads its share of the tensors (every world_size-th, in name order) and serves the engine at
`--engine-url` number r // ranks_per_engine (ranks_per_engine = world size / number of URLs; more
than one per engine is for tensor-parallel engines, untested here); the broadcast gives every
engine the whole checkpoint.
The servers run `vllm serve ... --worker-extension-cls vllm_ext.worker.VllmColocateWorkerExtension`
with VLLM_SERVER_DEV_MODE=1 (or sit behind `python -m vllm_ext.launch`). The last line printed is
one JSON object; exit code 0 when the update completed, 3 when it was aborted, 1 otherwise (2: a bad
flag, named; the flags are `PushConfig`'s fields).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from checkpoint_engine.config import P2PReader, ParameterServerConfig, Transport, UpdateConfig
from ckpt_common.cli_config import ConfigArgs, add_config_args, meta
from ckpt_common.validate import check_int, check_literals, check_number

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushConfig:
    """The push's command line, one field per flag (`--engine-url` is repeated: one per engine)."""

    model: str = field(metadata=meta("model directory with safetensors files", metavar="DIR"))
    engine_urls: tuple[str, ...] = field(
        metadata=meta("base URL of a vLLM server (repeat: one per engine, in rank order)", metavar="URL")
    )
    rank: int | None = field(default=None, metadata=meta("None: $RANK (torchrun), else 0"))
    world_size: int | None = field(default=None, metadata=meta("None: $WORLD_SIZE, else 1"))
    master_port: int | None = field(default=None, metadata=meta("rendezvous port when not under torchrun"))
    checkpoint_name: str | None = field(default=None, metadata=meta("None: the model directory's name"))
    bucket_size_bytes: int | None = field(
        default=UpdateConfig.bucket_size_bytes, metadata=meta("None: the parameter server's default")
    )
    timeout_s: float = field(
        default=300.0,
        metadata=meta("every deadline of the update: engine connect, each bucket's ack, the request, collectives"),
    )
    transport: Transport = field(
        default=ParameterServerConfig.transport, metadata=meta("the parameter server's transport (cpu, cuda, auto)")
    )
    p2p_reader: P2PReader | None = field(
        default=None,
        metadata=meta(
            "pull over Mooncake (TCP on 127.0.0.1) instead of the broadcast: every engine reads the owners' "
            "registered memory; rank: each rank reads for its engine, engine: the engine reads it itself "
            "(a tensor-parallel worker then reads only the slices its loaders take). None: broadcast"
        ),
    )
    delta_base: str | None = field(
        default=None,
        metadata=meta(
            "model directory of the version the engine holds: send only the values that changed from it, "
            "cut along the engine's tensor-parallel slices (each worker reads its own); when the engine "
            "refuses the delta (it holds another version, or no copy to apply it to), or the delta is more than "
            "half the full version, the full version follows",
            metavar="DIR",
        ),
    )
    delta_base_name: str | None = field(
        default=None, metadata=meta("the checkpoint name the engine reports for --delta-base (None: its directory's)")
    )
    delta_tp_size: int | None = field(
        default=None,
        metadata=meta("the engine's tensor-parallel size, to cut the delta by (None: the ranks per engine)"),
    )

    def __post_init__(self) -> None:
        check_literals(self)
        if not (isinstance(self.model, str) and self.model):
            raise ValueError(f"model={self.model!r} must be a model directory")
        if not self.engine_urls or not all(isinstance(u, str) and u for u in self.engine_urls):
            raise ValueError(f"engine_urls={self.engine_urls!r} must be one or more URLs (--engine-url)")
        if self.delta_base is not None and not (isinstance(self.delta_base, str) and self.delta_base):
            raise ValueError(f"delta_base={self.delta_base!r} must be a model directory")
        if self.delta_base is None and (self.delta_base_name is not None or self.delta_tp_size is not None):
            raise ValueError("delta_base_name and delta_tp_size need delta_base (--delta-base DIR)")
        numbers = (("rank", 0), ("world_size", 1), ("master_port", 1), ("bucket_size_bytes", 1), ("delta_tp_size", 1))
        for name, low in numbers:
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=low)
        check_number("timeout_s", self.timeout_s)

    def layout(self, environ: Mapping[str, str]) -> tuple[int, int, int]:
        """(rank, world size, ranks per engine): the flags, else torchrun's $RANK / $WORLD_SIZE, else 0 / 1.
        ValueError when the world size is not a multiple of the engines or the rank is outside it."""
        rank = self.rank if self.rank is not None else int(environ.get("RANK", "0"))
        world = self.world_size if self.world_size is not None else int(environ.get("WORLD_SIZE", "1"))
        if world % len(self.engine_urls):
            raise ValueError(f"world size {world} is not a multiple of the {len(self.engine_urls)} engine URLs")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside the world of {world} ranks")
        return rank, world, world // len(self.engine_urls)


def load_shard(files: list[str], rank: int, world_size: int) -> dict:
    """This rank's tensors: every world_size-th name (sorted over all files), read from disk."""
    from safetensors import safe_open

    where: dict[str, str] = {}
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for k in fh.keys():
                where[k] = f
    mine = sorted(where)[rank::world_size]
    out = {}
    for f in files:
        names = [k for k in mine if where[k] == f]
        if names:
            with safe_open(f, framework="pt") as fh:
                out.update({k: fh.get_tensor(k) for k in names})
    return out


def push(cfg: PushConfig, engine_url: str, *, rank: int, world_size: int, ranks_per_engine: int) -> dict:
    """Register this rank's shard, gather metas, update; return metrics. Raises on failure."""
    from checkpoint_engine.ps import ParameterServer
    from checkpoint_engine.sharding.delta import choose_update
    from vllm_ext.extension_req import vllm_http_req_func
    from vllm_ext.launch_config import model_safetensors_files

    name = cfg.checkpoint_name or os.path.basename(os.path.normpath(cfg.model))
    timeout_s = cfg.timeout_s
    update = UpdateConfig(
        bucket_size_bytes=cfg.bucket_size_bytes,
        engine_connect_timeout_s=timeout_s,
        engine_timeout_s=timeout_s,
        req_func_timeout_s=timeout_s,
        p2p_reader=cfg.p2p_reader or UpdateConfig.p2p_reader,
        # a pull that moves bytes: Mooncake, also when the engines could map the owners' chunks in place
        mode="collective" if cfg.p2p_reader is not None else UpdateConfig.mode,
    )
    p2p = None
    if cfg.p2p_reader is not None:
        from checkpoint_engine.transport.mooncake import P2PConfig

        p2p = P2PConfig(read_timeout_s=timeout_s)
    ps_cfg = ParameterServerConfig(transport=cfg.transport, collective_timeout_s=timeout_s, update=update, p2p=p2p)
    ps = ParameterServer(
        rank=rank,
        world_size=world_size,
        master_addr="127.0.0.1" if cfg.master_port else None,
        master_port=cfg.master_port,
        config=ps_cfg,
    )
    req_func = vllm_http_req_func(engine_url, rank=rank, ranks_per_engine=ranks_per_engine, timeout_s=timeout_s)
    ranks = list(range(world_size)) if cfg.p2p_reader is not None else None

    def send(tensors: dict) -> tuple[dict, float]:
        t0 = time.perf_counter()
        ps.register_checkpoint(name, named_tensors=tensors)
        try:
            ps.gather_metas(name)
            register_s = time.perf_counter() - t0
            return ps.update(name, req_func, ranks=ranks).to_dict(), register_s
        finally:
            ps.unregister_checkpoint(name)

    try:
        new = load_shard(model_safetensors_files(cfg.model), rank, world_size)
        delta = None
        if cfg.delta_base is not None:
            tp_size = cfg.delta_tp_size or ranks_per_engine
            delta = delta_shard(cfg, new, rank=rank, world_size=world_size, tp_size=tp_size)
        if delta is None:
            metrics, register_s = send(new)
            return {**metrics, "register_s": round(register_s, 4)}
        wire, info = delta
        # one choice for every rank (each holds a share): the sums of the shares' delta and full bytes
        totals = _summed(ps, world_size, info["nbytes"], sum(t.numel() * t.element_size() for t in new.values()))
        choice = choose_update(info["base"], info["base"], totals[0], totals[1])
        info.update(total_nbytes=totals[0], total_full_bytes=totals[1])
        if choice.kind == "full":
            info.update(kind="full", reason=choice.reason)
            metrics, register_s = send(new)
            return {**metrics, "register_s": round(register_s, 4), "delta": info}
        try:
            metrics, register_s = send(wire)
            info["kind"] = "delta"
        except Exception as e:  # noqa: BLE001 - every rank's update fails alike: each sends the full version
            info.update(kind="full", reason=f"the engine refused the delta ({type(e).__name__}: {e})")
            logger.warning("rank %d: %s; sending the full version", rank, info["reason"])
            metrics, register_s = send(new)
        return {**metrics, "register_s": round(register_s, 4), "delta": info}
    finally:
        ps.close()


def _summed(ps, world_size: int, *values: int) -> list[int]:
    """`values` summed over every PS rank (gloo; the ranks' own process group)."""
    if world_size == 1:
        return list(values)
    import torch
    import torch.distributed as dist

    ps.init_process_group()
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t)
    return [int(x) for x in t]


def delta_shard(cfg: PushConfig, new: dict, *, rank: int, world_size: int, tp_size: int) -> tuple[dict, dict]:
    """This rank's share of the delta from `cfg.delta_base` to `new` (its share of the version), cut
    along the slices of a `tp_size` engine, as wire tensors (its own header), and what it holds."""
    from checkpoint_engine.sharding.delta_slices import encode_sliced, tp_delta_slices
    from checkpoint_engine.sharding.delta_sync import HEADER, to_wire
    from vllm_ext.launch_config import model_safetensors_files

    base = load_shard(model_safetensors_files(cfg.delta_base), rank, world_size)
    if set(base) != set(new):
        raise ValueError(f"--delta-base {cfg.delta_base} holds other tensors than --model {cfg.model}")
    slices = None
    if tp_size > 1:
        with open(os.path.join(cfg.model, "config.json")) as f:
            slices = tp_delta_slices(json.load(f), tp_size, new)
    t0 = time.perf_counter()
    delta = encode_sliced(base, new, slices, compress=True)
    base_name = cfg.delta_base_name or os.path.basename(os.path.normpath(cfg.delta_base))
    version = cfg.checkpoint_name or os.path.basename(os.path.normpath(cfg.model))
    header = HEADER if world_size == 1 else f"{HEADER}/{rank}"
    wire = to_wire(delta, base_name, version, header=header)
    info = {
        "base": base_name,
        "tp_size": tp_size,
        "entries": len(delta.tensors),
        "nbytes": sum(t.numel() * t.element_size() for t in wire.values()),
        "full_bytes": delta.full_bytes,
        "changed_share": round(delta.changed_share, 6),
        "encode_s": round(time.perf_counter() - t0, 4),
    }
    return wire, info


def _parser() -> tuple[argparse.ArgumentParser, ConfigArgs]:
    """The command line: PushConfig's fields as flags (defaults and help from the dataclass); the
    repeated --engine-url is added here (argparse's append), its help from the field."""
    p = argparse.ArgumentParser(
        prog="python -m vllm_ext.push", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    spec = add_config_args(p, PushConfig, exclude=("engine_urls",))
    urls = {f.name: f for f in dataclasses.fields(PushConfig)}["engine_urls"].metadata
    p.add_argument(
        "--engine-url", action="append", required=True, help=f"{urls['help']} (required)", metavar=urls["metavar"]
    )
    return p, spec


def main(argv: list[str] | None = None) -> int:
    p, spec = _parser()
    args = p.parse_args(argv)
    cfg: PushConfig = spec.build(args, p, engine_urls=tuple(args.engine_url))  # a bad value: exit 2 naming the flag
    try:
        rank, world, per_engine = cfg.layout(os.environ)
    except ValueError as e:
        p.error(f"{e} (flags: --rank, --world-size, --engine-url)")
    from ckpt_common.logs import setup_logging

    setup_logging("WARNING", rank=rank)
    try:
        out = push(cfg, cfg.engine_urls[rank // per_engine], rank=rank, world_size=world, ranks_per_engine=per_engine)
    except Exception as e:  # noqa: BLE001 - reported as the last line and the exit code
        from checkpoint_engine.errors import UpdateFailed

        print(json.dumps({"ok": False, "rank": rank, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return 3 if isinstance(e, UpdateFailed) else 1
    print(json.dumps({"ok": True, **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
