"""The daemon's settings (`torchrun -m checkpoint_engine`): `DaemonConfig`, whose fields are its flags
(ckpt_common.cli_config), and the configs it builds from them. Light: no torch, so `--help` is instant.

    DaemonConfig ──▶ ps_config(cpus)  ──▶ ParameterServerConfig(transport, collective_timeout_s, metadata_url,
         │                                    p2p=P2PConfig(p2p_host, ...), update=UpdateConfig(mode, ...))
         └─────▶ engine_config()    ──▶ EngineConfig(cmd=parse_engine_cmd(engine_cmd), ...) | None

A knob the daemon shares with one of those configs takes its default from that config's field
(`default=UpdateConfig.mode`: a dataclass keeps a field's default as its class attribute), so it is
written once; the daemon's own fields (address, token file, stop deadline, log level) are defined here.
The field checks (its own, the parameter server's and the update's) run when a DaemonConfig is made,
the managed engines' in `engine_config()`; `__main__.parse_args` runs both and what depends on the
process (the token, this rank's CPU list), so a bad flag exits 2 naming it before any rank starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from checkpoint_engine.config import MiB, P2PReader, ParameterServerConfig, Transport, UpdateConfig
from checkpoint_engine.engines.config import EngineConfig, parse_engine_cmd
from checkpoint_engine.transport.mooncake import P2PConfig, P2PProtocol, parse_rank_cpu_lists
from checkpoint_engine.types import REQUESTED_ROUTES, RequestedMode
from ckpt_common.cli_config import meta
from ckpt_common.logs import DEFAULT_LOG_LEVEL, check_log_level
from ckpt_common.procs import DEFAULT_STOP_TIMEOUT_S
from ckpt_common.validate import check_int, check_literals, check_number

TOKEN_ENV = "CKPT_ENGINE_TOKEN"  # the bearer token when no --token-file is given

# EngineConfig field -> the DaemonConfig field that sets it (`engine_flags` names its flag in an error)
_ENGINE_FIELDS = {
    "cmd": "engine_cmd",
    "health_path": "engine_health_path",
    "url_host": "engine_url_host",
    "start_timeout_s": "engine_start_timeout_s",
    "auto_heal": "auto_heal",
    "log_dir": "engine_log_dir",
    "update_timeout_s": "collective_timeout_s",
    "p2p_host": "p2p_host",
    "update_route": "engine_update_route",
    "ranks_per_engine": "ranks_per_engine",
}


def engine_flags(message: str) -> list[str]:
    """The daemon flags behind the EngineConfig fields an error message names (`EngineConfig.url_host=...`
    -> `--engine-url-host`); `--engine-cmd` when it names none."""
    named = [ours for theirs, ours in _ENGINE_FIELDS.items() if f"EngineConfig.{theirs}=" in message]
    return ["--" + name.replace("_", "-") for name in named or ["engine_cmd"]]


@dataclass(frozen=True)
class DaemonConfig:
    """The daemon's command line, one field per flag (`--help` lists them with their defaults)."""

    host: str = field(
        default="127.0.0.1",
        metadata=meta("HTTP bind address; any but a loopback address needs a bearer token (--token-file)"),
    )
    port: int = field(default=8400, metadata=meta("HTTP port"))
    uds: str | None = field(default=None, metadata=meta("serve on this unix socket instead of TCP"))
    token_file: str | None = field(
        default=None,
        metadata=meta(
            "a file holding the bearer token clients must send (Authorization: Bearer TOKEN) on every route "
            f"but the health checks; else the environment variable {TOKEN_ENV}. Required when --host is not a "
            "loopback address",
            metavar="PATH",
        ),
    )
    tls_cert_file: str | None = field(
        default=None,
        metadata=meta(
            "serve HTTPS with this certificate (PEM; with --tls-key-file), so the bearer token never crosses "
            "the network in clear text; clients then give the CA that signed it",
            metavar="PATH",
        ),
    )
    tls_key_file: str | None = field(
        default=None, metadata=meta("the private key of --tls-cert-file (PEM)", metavar="PATH")
    )
    transport: Transport = field(
        default=ParameterServerConfig.transport,
        metadata=meta(
            "cpu: memfd shared memory, gloo; cuda: pinned host memory, CUDA IPC, NCCL; auto: cuda with a GPU"
        ),
    )
    bucket_size_mib: int | None = field(
        default=None,
        metadata=meta(
            f"bucket size; None: {UpdateConfig.default_bucket_size_bytes // MiB} MiB, raised to "
            "the largest tensor, capped by the memory budget"
        ),
    )
    mode: RequestedMode = field(
        default=UpdateConfig.mode,
        metadata=meta(
            "collective: broadcast every bucket; local: every engine reads the owners' chunks in place (CPU, "
            "one host); auto: local when possible"
        ),
    )
    collective_timeout_s: float = field(
        default=ParameterServerConfig.collective_timeout_s,
        metadata=meta("deadline of a collective step across ranks, and of an update of managed engines"),
    )
    metrics_jsonl: str | None = field(
        default=UpdateConfig.metrics_path,
        metadata=meta("append one JSON line per update (per rank)"),
    )
    progress: bool = field(default=UpdateConfig.progress, metadata=meta("progress bar on rank 0 during updates"))
    metadata_url: str | None = field(
        default=ParameterServerConfig.metadata_url,
        metadata=meta("etcd://host:port/prefix for global metadata (None: in-process)"),
    )
    p2p_host: str | None = field(default=None, metadata=meta("start Mooncake's transfer engine on this address (P2P)"))
    p2p_protocol: P2PProtocol = field(default=P2PConfig.protocol, metadata=meta("Mooncake's protocol"))
    p2p_device: str = field(
        default=P2PConfig.device_name, metadata=meta("RDMA device names for Mooncake (rdma protocol)")
    )
    p2p_cpus: str | None = field(
        default=None,
        metadata=meta(
            "the CPUs the rank's transfer-engine threads run on: one list for every rank ('0-3') or one "
            "per local rank separated by ';' ('0-3;4-7'); None: those the rank may run on. Keeps the "
            "threads that serve the owners' reads off the cores of the engines generating meanwhile"
        ),
    )
    keep_relayed: bool = field(
        default=UpdateConfig.keep_relayed,
        metadata=meta(
            "--mode relay: each rank keeps its share of every version it relayed (about M / world bytes of "
            "host memory), so that heals pull the version from the ranks, also once the trainer is gone"
        ),
    )
    p2p_reader: P2PReader = field(
        default=UpdateConfig.p2p_reader,
        metadata=meta(
            "who reads a P2P pull: the PS rank (into its shared buffer) or the engine (into its parameters; CPU)"
        ),
    )
    engine_cmd: str | None = field(
        default=None,
        metadata=meta(
            "the engine each rank manages: a JSON list or a shell-style string with {port} (and {rank}, "
            "{device}, {rendezvous}: the address of its load step, {p2p_host}: this daemon's --p2p-host), e.g. "
            "'python -m checkpoint_engine.engines.plain --port {port}'"
        ),
    )
    ranks_per_engine: int = field(
        default=EngineConfig.ranks_per_engine,
        metadata=meta(
            "ranks per managed engine: N > 1 runs one tensor-parallel engine per N consecutive ranks (its "
            "first rank starts it; pass --tensor-parallel-size {ranks_per_engine} in --engine-cmd), each "
            "worker fed by one rank of the group; must divide the ranks per host"
        ),
    )
    auto_heal: bool = field(
        default=EngineConfig.auto_heal,
        metadata=meta("restart a dead managed engine and bring it to the current checkpoint"),
    )
    engine_url_host: str | None = field(
        default=EngineConfig.url_host,
        metadata=meta(
            "host or IP in the engine URLs the daemon publishes (GET /engines, etcd), for rollout clients on "
            "other hosts, e.g. the pod IP; the engine command must listen there too (e.g. --host 0.0.0.0). "
            f"None: {EngineConfig.host}"
        ),
    )
    engine_health_path: str = field(
        default=EngineConfig.health_path, metadata=meta("GET path answering 200 once an engine is up")
    )
    engine_update_route: str = field(
        default=EngineConfig.update_route,
        metadata=meta(
            "how updates reach the serving engines: native (vLLM's weight-transfer routes /pause, "
            "/start_weight_update, /update_weights, /finish_weight_update with the checkpoint's name as the "
            'version, /resume; the engine runs --weight-transfer-config \'{"backend": "checkpoint_engine"}\'), '
            "extension (the worker extension's /collective_rpc), auto (native where the engine's GET "
            "/launcher/status says so, as `vllm_ext.launch` does by default; extension otherwise)",
            choices=REQUESTED_ROUTES,
        ),
    )
    engine_start_timeout_s: float = field(
        default=EngineConfig.start_timeout_s, metadata=meta("engine start -> healthy deadline")
    )
    engine_log_dir: str | None = field(
        default=EngineConfig.log_dir,
        metadata=meta("engine logs (None: a temporary folder per rank)"),
    )
    stop_timeout_s: float = field(
        default=DEFAULT_STOP_TIMEOUT_S,
        metadata=meta(
            "SIGTERM/SIGINT -> exit deadline (engines stopped, other ranks told); past it a rank writes its "
            "threads' stacks to stderr and exits 128+signal. Keep it under torchrun's 30 s before SIGKILL"
        ),
    )
    log_level: str = field(
        default=DEFAULT_LOG_LEVEL, metadata=meta("a logging level name: DEBUG, INFO, WARNING, ERROR")
    )

    def __post_init__(self) -> None:
        check_literals(self)
        check_int("port", self.port, low=0)
        if self.port > 65535:
            raise ValueError(f"port={self.port!r} must be <= 65535")
        check_number("stop_timeout_s", self.stop_timeout_s)
        check_number("engine_start_timeout_s", self.engine_start_timeout_s)
        check_int("ranks_per_engine", self.ranks_per_engine)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: give both (or neither)")
        for name in ("tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}={path!r} is not a readable file")
        if self.tls_cert_file is not None and self.uds:
            raise ValueError("tls_cert_file serves HTTPS over TCP; a unix socket (uds) is local: drop one of them")
        if self.ranks_per_engine > 1 and self.engine_cmd is None:
            raise ValueError("ranks_per_engine groups the managed engines' ranks: it needs --engine-cmd")
        if self.bucket_size_mib is not None:
            check_int("bucket_size_mib", self.bucket_size_mib)
        check_log_level("log_level", self.log_level)
        if self.p2p_cpus is not None:
            if not self.p2p_host:
                raise ValueError("p2p_cpus places the transfer engine's threads: it needs --p2p-host")
            try:  # the syntax here; how many lists for how many local ranks when the rank starts
                parse_rank_cpu_lists(self.p2p_cpus)
            except ValueError as e:
                raise ValueError(f"p2p_cpus: {e}") from None
        self.ps_config()  # the parameter server's and the update's own checks (EngineConfig's: engine_config)

    def ssl_context(self):
        """The server's TLS context (None: plain HTTP)."""
        if self.tls_cert_file is None:
            return None
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return ctx

    def ps_config(self, p2p_cpus: tuple[int, ...] | None = None) -> ParameterServerConfig:
        """Every rank's ParameterServerConfig; `p2p_cpus`: this rank's list (from `p2p_cpus` and its local rank)."""
        p2p = None
        if self.p2p_host:
            p2p = P2PConfig(self.p2p_host, self.p2p_protocol, self.p2p_device, cpus=p2p_cpus)
        return ParameterServerConfig(
            transport=self.transport,
            collective_timeout_s=self.collective_timeout_s,
            p2p=p2p,
            metadata_url=self.metadata_url,
            update=UpdateConfig(
                bucket_size_bytes=None if self.bucket_size_mib is None else self.bucket_size_mib * MiB,
                mode=self.mode,
                p2p_reader=self.p2p_reader,
                keep_relayed=self.keep_relayed,
                metrics_path=self.metrics_jsonl,
                progress=self.progress,
            ),
        )

    def engine_config(self) -> EngineConfig | None:
        """The managed engines' config, None without --engine-cmd; ValueError (`engine_flags` names the flag)."""
        if self.engine_cmd is None:
            return None
        return EngineConfig(
            cmd=parse_engine_cmd(self.engine_cmd),
            health_path=self.engine_health_path,
            url_host=self.engine_url_host,
            start_timeout_s=self.engine_start_timeout_s,
            auto_heal=self.auto_heal,
            log_dir=self.engine_log_dir,
            update_timeout_s=self.collective_timeout_s,
            p2p_host=self.p2p_host,
            update_route=self.engine_update_route,
            ranks_per_engine=self.ranks_per_engine,
        )
