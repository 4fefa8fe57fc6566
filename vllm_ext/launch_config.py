"""The launcher's settings and the pieces it assembles before anything runs: `LaunchConfig` (its
command line is generated from the fields), the `vllm serve` command behind the gate, the extension's
non-default settings, and small process helpers. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from checkpoint_engine.transport.mooncake import parse_cpu_list
from ckpt_common.cli_config import meta
from ckpt_common.ports import free_port as free_port
from ckpt_common.validate import check_literals
from vllm_ext.engine_core_cpus import ENV as ENGINE_CORE_CPUS_ENV
from vllm_ext.settings import ReceiverConfig
from vllm_ext.start_method import ENV as START_METHOD_ENV

logger = logging.getLogger(__name__)

EXTENSION = "vllm_ext.worker.VllmColocateWorkerExtension"
RESERVED_VLLM_FLAGS = (
    "--load-format",
    "--worker-extension-cls",
    "--host",
    "--port",
    "--additional-config",
    "--model-loader-extra-config",
)
# vLLM's weight-transfer API with this project as its backend (vllm_ext.weight_transfer): the launcher
# passes it unless --no-weight-transfer, and then it is the user's to pass
WEIGHT_TRANSFER_FLAG = "--weight-transfer-config"
WEIGHT_TRANSFER_CONFIG = {"backend": "checkpoint_engine"}


@dataclass(frozen=True)
class LaunchConfig:
    """The launcher's settings; its command line is generated from these fields (ckpt_common.cli_config)."""

    model: str = field(metadata=meta("HF model directory (safetensors)"))
    host: str = field(default="127.0.0.1", metadata=meta("public address of the gate"))
    port: int = field(default=8000, metadata=meta("public port (OpenAI API, gated)"))
    engine_port: int | None = field(default=None, metadata=meta("vLLM's internal port (None: a free one)"))
    checkpoint_name: str | None = field(default=None, metadata=meta("None: the model directory's name"))
    initial_push: bool = field(
        default=True,
        metadata=meta(
            "load the checkpoint into the engine at start; --no-initial-push: open the gate when an "
            "external parameter server pushes weights"
        ),
    )
    initial_mode: Literal["load", "push"] = field(
        default="load",
        metadata=meta(
            "load: vLLM's load step receives the weights from the parameter server (load format "
            "checkpoint_engine); push: vLLM starts with dummy weights, pushed once it is healthy"
        ),
    )
    load_rendezvous: str | None = field(
        default=None,
        metadata=meta(
            "an external parameter server (e.g. the checkpoint-engine daemon) loads the weights through "
            "vLLM's load step at this ipc:// or tcp:// address (load format checkpoint_engine); the "
            "launcher runs no parameter server of its own and opens the gate once the load is in"
        ),
    )
    p2p_host: str | None = field(
        default=None,
        metadata=meta(
            "with --load-rendezvous: start the engine's own Mooncake transfer engine on this address while "
            "vLLM's load step waits, for a pull the engine reads itself (daemon --p2p-reader engine); "
            "without it, that pull starts one"
        ),
    )
    p2p_cpus: str | None = field(
        default=None,
        metadata=meta(
            "with --p2p-host: the CPUs the engine's transfer-engine threads run on, e.g. '0-3' (default: "
            "every CPU this launcher may run on; vLLM binds its compute threads to their cores, and the "
            "transfer threads would otherwise read every byte on that one core)"
        ),
    )
    p2p_cpu_list: tuple[int, ...] | None = field(default=None, init=False, repr=False)  # p2p_cpus parsed
    gate_wait_s: float = field(
        default=0.0,
        metadata=meta("hold requests that arrive before the weights this long (0: refuse at once with 503)"),
    )
    gate_remote_routes: Literal["all", "serving"] = field(
        default="all",
        metadata=meta(
            "what the gate serves to clients beyond loopback: all (every route it proxies), or serving "
            "(the OpenAI API under /v1/, /health, /metrics, /version, /ping, /tokenize, /detokenize: "
            "vLLM's dev-mode routes such as /collective_rpc, /sleep, /update_weights answer 403 to them)"
        ),
    )
    startup_timeout_s: float = 900.0
    push_timeout_s: float = 600.0
    engine_timeout_s: float = field(default=600.0, metadata=meta("engine-side deadline per PS message"))
    reload_mode: Literal["streaming", "end"] = "streaming"
    weight_transfer: bool = field(
        default=True,
        metadata=meta(
            'start vLLM with --weight-transfer-config \'{"backend": "checkpoint_engine"}\': updates may use '
            "vLLM's own routes (/pause, /start_weight_update, /update_weights, /finish_weight_update, "
            "/resume) besides the worker extension's /collective_rpc; GET /launcher/status then says "
            '"update_route": "native". --no-weight-transfer: the extension\'s route only'
        ),
    )
    weight_cache: bool = field(
        default=True,
        metadata=meta(
            "--no-weight-cache: the engine keeps no host copy of the weights (saves the model's size in "
            "memory and a copy per update; no weights checksum, no fill-in of previous values after an abort)"
        ),
    )
    reload_impl: Literal["auto", "direct", "vllm"] = field(
        default="auto",
        metadata=meta(
            "engine-side reload: direct (CPU backend, unquantized, one TP rank: vLLM's loaders and "
            "packing without its layerwise bookkeeping), vllm (vLLM's reload_weights), auto (direct "
            "where it applies; see vllm_ext.direct_reload)"
        ),
    )
    sharded_max_ranges_per_tensor: int = field(
        default=ReceiverConfig.sharded_max_ranges_per_tensor,
        metadata=meta(
            "tensor-parallel engines reading a pull themselves read only their slices; a slice of more "
            "byte ranges (a row-parallel tensor: one per row) is read as one covering range (0: row by row)"
        ),
    )
    transport: Literal["auto", "cpu", "cuda"] = "auto"
    bucket_size_bytes: int | None = None
    register_nice: int = field(
        default=19,
        metadata=meta(
            "CPU niceness of the checkpoint registration running beside vLLM's start (0..19; "
            "19: SCHED_IDLE, only CPU time vLLM leaves idle)"
        ),
    )
    engine_core_cpus: Literal["worker", "any"] = field(
        default="worker",
        metadata=meta(
            "on a CPU platform, where vLLM's engine core runs: on its worker's CPUs "
            "(VLLM_CPU_OMP_THREADS_BIND; its waits spin and yield to the worker there instead of taking "
            "another core's time), or anywhere, as vLLM leaves it (vllm_ext.engine_core_cpus)"
        ),
    )
    vllm_start_method: Literal["fork", "spawn"] = field(
        default="fork",
        metadata=meta(
            "on a CPU platform, how vLLM starts its engine core and worker: forked from its API server "
            "(they inherit its imports: about half of a start on 2 cores) or spawned, as vLLM does "
            "(each imports vLLM again) (vllm_ext.start_method)"
        ),
    )
    vllm_args: tuple[str, ...] = field(default_factory=tuple)  # after `--` on the command line

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ValueError(f"model must be a model directory, got {self.model!r}")
        for name in ("port", "engine_port"):
            v = getattr(self, name)
            if v is not None and not 0 < v < 65536:
                raise ValueError(f"{name} must be in 1..65535, got {v!r}")
        for name in ("startup_timeout_s", "push_timeout_s", "engine_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.gate_wait_s >= 0:
            raise ValueError(f"gate_wait_s must be >= 0, got {self.gate_wait_s!r}")
        check_literals(self)
        if not 0 <= self.register_nice <= 19:
            raise ValueError(f"register_nice must be in 0..19, got {self.register_nice!r}")
        if self.p2p_cpus is not None:
            if not self.p2p_host:
                raise ValueError("p2p_cpus places the engine's transfer engine: it needs p2p_host")
            cpus = parse_cpu_list(self.p2p_cpus)  # ValueError naming the bad part
            object.__setattr__(self, "p2p_cpu_list", cpus)
        v = self.sharded_max_ranges_per_tensor
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"sharded_max_ranges_per_tensor must be an int >= 0 (0: no limit), got {v!r}")
        if self.bucket_size_bytes is not None and self.bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes must be positive, got {self.bucket_size_bytes!r}")
        tp = tensor_parallel_size(self.vllm_args)
        if self.load_rendezvous is not None:
            if not self.load_rendezvous.startswith(("ipc://", "tcp://")):
                raise ValueError(f"load_rendezvous must be an ipc:// or tcp:// address, got {self.load_rendezvous!r}")
            if tp != 1:
                raise ValueError(
                    f"load_rendezvous feeds one tensor-parallel rank from one parameter-server rank, "
                    f"got --tensor-parallel-size {tp}"
                )
        elif self.initial_push and self.initial_mode == "load" and tp != 1:
            raise ValueError(
                f"initial_mode 'load' feeds one tensor-parallel rank from one parameter-server rank, "
                f"got --tensor-parallel-size {tp}; use initial_mode 'push' or an external PS"
            )
        reserved = (*RESERVED_VLLM_FLAGS, WEIGHT_TRANSFER_FLAG) if self.weight_transfer else RESERVED_VLLM_FLAGS
        clash = [a for a in self.vllm_args if a.split("=")[0] in reserved]
        if clash:
            raise ValueError(
                f"vllm_args must not set {clash}: the launcher sets {list(reserved)}"
                + (" (--no-weight-transfer leaves --weight-transfer-config to you)" if self.weight_transfer else "")
            )

    @property
    def update_route(self) -> str:
        """How updates reach this launcher's vLLM by default (`vllm_ext.weight_transfer.native_req.UpdateRoute`)."""
        return "native" if self.weight_transfer else "extension"

    @property
    def own_ps(self) -> bool:
        """The launcher pushes the first weights itself (no external load, no --no-initial-push)."""
        return self.initial_push and self.load_rendezvous is None

    @property
    def name(self) -> str:
        return self.checkpoint_name or Path(self.model).resolve().name


def vllm_has_weight_transfer() -> bool:
    """Whether the installed vLLM has the weight-transfer API (`vllm.distributed.weight_transfer`, vLLM
    0.32 and later), looked up on disk without importing vLLM (the launcher starts it before anything
    heavy loads). No vLLM at all: True (the start fails on its own, naming vLLM)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # the top-level package's location; vLLM is not imported
    if spec is None or not spec.submodule_search_locations:
        return True
    return any((Path(root) / "distributed" / "weight_transfer").is_dir() for root in spec.submodule_search_locations)


def with_installed_vllm(cfg: LaunchConfig) -> LaunchConfig:
    """`cfg`, without the weight-transfer backend where the installed vLLM predates its API (the worker
    extension's route only, with a warning) instead of a vLLM that refuses the unknown flag."""
    if cfg.weight_transfer and not vllm_has_weight_transfer():
        logger.warning(
            "the installed vLLM has no weight-transfer API (vllm.distributed.weight_transfer, vLLM >= 0.32): "
            "starting it without --weight-transfer-config; updates take the worker extension's /collective_rpc"
        )
        return replace(cfg, weight_transfer=False)
    return cfg


def tensor_parallel_size(vllm_args: tuple[str, ...]) -> int:
    """The `--tensor-parallel-size` / `-tp` among `vllm serve` arguments (1 when absent)."""
    for i, a in enumerate(vllm_args):
        name, eq, value = a.partition("=")
        if name in ("--tensor-parallel-size", "-tp"):
            raw = value if eq else (vllm_args[i + 1] if i + 1 < len(vllm_args) else "")
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name} needs an integer, got {raw!r}") from None
    return 1


def model_safetensors_files(model_dir: str) -> list[str]:
    """The model directory's safetensors files as strings (`ckpt_common.hf_dir.safetensors_files`)."""
    from ckpt_common.hf_dir import safetensors_files

    return [str(p) for p in safetensors_files(model_dir)]


def engine_settings(cfg: LaunchConfig) -> dict:
    """The extension's settings that differ from its defaults (vLLM's additional config).

    Only non-defaults are passed: vLLM hashes `additional_config` into its compile-cache key, so
    passing defaults would make the fast start miss a cache filled by a plain `vllm serve`.
    """
    defaults = ReceiverConfig()
    wanted = {
        "timeout_s": float(cfg.engine_timeout_s),
        "reload_mode": cfg.reload_mode,
        "weight_cache": cfg.weight_cache,
        "reload_impl": cfg.reload_impl,
        "sharded_max_ranges_per_tensor": cfg.sharded_max_ranges_per_tensor,
    }
    return {k: v for k, v in wanted.items() if v != getattr(defaults, k)}


def vllm_env(cfg: LaunchConfig, base: dict[str, str]) -> dict[str, str]:
    """`vllm serve`'s environment: `base`, the dev-mode endpoints the gate calls (the worker
    extension's RPCs), where vLLM's engine core runs (`engine_core_cpus`) and how vLLM starts its
    processes (`vllm_start_method`)."""
    return {
        **base,
        "VLLM_SERVER_DEV_MODE": "1",
        ENGINE_CORE_CPUS_ENV: cfg.engine_core_cpus,
        START_METHOD_ENV: cfg.vllm_start_method,
    }


def vllm_command(cfg: LaunchConfig, engine_port: int, rendezvous: str | None = None) -> list[str]:
    """`vllm serve` behind the gate: loading from the PS at `rendezvous`, else with dummy weights."""
    cmd = [
        sys.executable,
        "-m",
        "vllm_ext.serve",
        "serve",
        cfg.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(engine_port),
        "--worker-extension-cls",
        EXTENSION,
    ]
    if rendezvous is None:
        cmd += ["--load-format", "dummy"]
    else:
        from vllm_ext.loader import LOAD_FORMAT

        extra = {"rendezvous": rendezvous, "timeout_s": float(cfg.startup_timeout_s)}
        if cfg.p2p_host:
            extra["p2p_host"] = cfg.p2p_host
            cpus = cfg.p2p_cpu_list or sorted(os.sched_getaffinity(0))
            extra["p2p_cpus"] = list(cpus)
        cmd += ["--load-format", LOAD_FORMAT, "--model-loader-extra-config", json.dumps(extra)]
    settings = engine_settings(cfg)
    if settings:
        cmd += ["--additional-config", json.dumps({"checkpoint_engine": settings})]
    if cfg.weight_transfer:
        cmd += [WEIGHT_TRANSFER_FLAG, json.dumps(WEIGHT_TRANSFER_CONFIG)]
    return [*cmd, *cfg.vllm_args]


def lower_thread_priority(nice: int) -> str:
    """Make the calling thread yield the CPU to vLLM's start: SCHED_IDLE (runs only on otherwise idle
    CPU time) when `nice` is 19, else the nice value. Returns what was applied."""
    tid = threading.get_native_id()
    try:
        if nice >= 19 and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread (Linux)
            return "SCHED_IDLE"
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        return f"nice {nice}"
    except (OSError, AttributeError) as e:
        logger.debug("could not lower the registration thread's priority: %s", e)
        return "unchanged"
