"""What each rank's managed engine runs: the `--engine-cmd` template (`{port}`, `{rank}`, `{device}`,
`{rendezvous}`, `{p2p_host}`, `{ranks_per_engine}` filled in), its environment (torchrun's variables
removed, its GPUs visible) and `EngineConfig`.

`ranks_per_engine` N > 1: one engine per N consecutive ranks (a tensor-parallel engine of N workers,
each worker fed by one rank of the group: `vllm_ext.launch ... -- --tensor-parallel-size
{ranks_per_engine}`). The group's first rank runs the process; its GPU list is the group's.

`{rendezvous}` marks an engine that takes its first weights in its own load step from this rank's
parameter server (`vllm_ext.launch --load-rendezvous {rendezvous}`, the `checkpoint_engine` load
format): the daemon fills in a private ipc:// address per start and updates the engine through it
before waiting for its health, instead of waiting for a dummy-weight engine and pushing into it.

`{p2p_host}` is the daemon's own `--p2p-host`: an engine that reads its P2P pulls itself starts its
transfer engine there while it starts (`vllm_ext.launch --load-rendezvous {rendezvous} --p2p-host
{p2p_host}`), so the daemon's one address setting reaches its engines too.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from checkpoint_engine.types import REQUESTED_ROUTES

PLACEHOLDERS = ("{port}", "{rank}", "{device}", "{rendezvous}", "{p2p_host}", "{ranks_per_engine}")


def parse_engine_cmd(text: str) -> tuple[str, ...]:
    """`--engine-cmd`: a JSON list of strings, or a shell-style string (split with shlex)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--engine-cmd must be a non-empty command template, got {text!r}")
    if text.lstrip().startswith("["):
        try:
            argv = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--engine-cmd looks like a JSON list but does not parse: {e}") from None
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"--engine-cmd as JSON must be a list of strings, got {argv!r}")
    else:
        argv = shlex.split(text)
    cmd = tuple(argv)
    check_cmd(cmd)
    return cmd


def check_cmd(cmd: object) -> None:
    """A command template: a non-empty tuple of non-empty strings with a `{port}` placeholder."""
    if not isinstance(cmd, tuple) or not cmd or not all(isinstance(a, str) and a for a in cmd):
        raise ValueError(f"EngineConfig.cmd={cmd!r} must be a non-empty tuple of non-empty strings")
    if not any("{port}" in a for a in cmd):
        raise ValueError(
            f"EngineConfig.cmd={list(cmd)!r} has no {{port}} placeholder: the daemon picks a free port "
            "per engine and must pass it, e.g. '... --port {port}'"
        )


def render_cmd(
    cmd: Sequence[str],
    *,
    port: int,
    rank: int,
    device: str,
    rendezvous: str | None = None,
    p2p_host: str | None = None,
    ranks_per_engine: int = 1,
) -> list[str]:
    """The argv of one engine: each placeholder replaced (other braces, e.g. JSON args, stay as they are)."""
    if rendezvous is None and loads_from_ps(cmd):
        raise ValueError(f"the engine command {list(cmd)!r} has a {{rendezvous}} placeholder: give its address")
    if p2p_host is None and uses_p2p_host(cmd):
        raise ValueError(f"the engine command {list(cmd)!r} has a {{p2p_host}} placeholder: give the address")
    values = {
        "{port}": str(port),
        "{rank}": str(rank),
        "{device}": device,
        "{rendezvous}": rendezvous or "",
        "{p2p_host}": p2p_host or "",
        "{ranks_per_engine}": str(ranks_per_engine),
    }
    out = []
    for arg in cmd:
        for key, value in values.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out


def loads_from_ps(cmd: Sequence[str]) -> bool:
    """The engine takes its first weights in its load step from the PS (a `{rendezvous}` placeholder)."""
    return any("{rendezvous}" in a for a in cmd)


def uses_p2p_host(cmd: Sequence[str]) -> bool:
    """The engine's command takes the daemon's P2P address (a `{p2p_host}` placeholder)."""
    return any("{p2p_host}" in a for a in cmd)


# torchrun's variables describe the daemon's process group, which the engine is no member of (an
# engine that starts its own torch.distributed group, as vLLM does, must not pick them up)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
TORCHRUN_VARS += ("ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def engine_env(environ: dict[str, str] | None = None, device: str = "cpu") -> dict[str, str]:
    """The daemon's environment without torchrun's process-group variables; a GPU engine sees only
    its ranks' devices (`cuda:N`, or `cuda:N,M` for a tensor-parallel group -> CUDA_VISIBLE_DEVICES
    naming those GPUs, within the daemon's own list)."""
    env = dict(os.environ if environ is None else environ)
    for key in list(env):
        if key in TORCHRUN_VARS or key.startswith(("TORCHELASTIC_", "TORCH_NCCL_ASYNC")):
            del env[key]
    if device.startswith("cuda:"):
        indices = [int(i) for i in device.split(":", 1)[1].split(",")]
        visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible and max(indices) >= len(visible):
            raise ValueError(f"device {device} is not among CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] if visible else str(i) for i in indices)
    return env


def engine_group(rank: int, ranks_per_engine: int) -> list[int]:
    """The ranks whose devices `rank`'s engine serves: its group of `ranks_per_engine` consecutive ranks."""
    first = rank // ranks_per_engine * ranks_per_engine
    return list(range(first, first + ranks_per_engine))


def group_device(device: str, ranks_per_engine: int) -> str:
    """The `{device}` of an engine serving `ranks_per_engine` consecutive local ranks from `device`
    (its first rank's): `cuda:2` with 2 -> `cuda:2,3`; cpu stays cpu."""
    if ranks_per_engine == 1 or not device.startswith("cuda:"):
        return device
    first = int(device.split(":", 1)[1])
    return "cuda:" + ",".join(str(first + i) for i in range(ranks_per_engine))


@dataclass(frozen=True)
class EngineConfig:
    cmd: tuple[str, ...]  # argv template with {port} (required), {rank}, {device}, {rendezvous}, {p2p_host}
    health_path: str = "/health"  # GET answers 200 once the engine can take updates (or, loading: serve)
    host: str = "127.0.0.1"  # where the daemon reaches its engine (health, sleep, updates' requests)
    # the host in the engine URLs the daemon publishes (GET /engines, etcd), which rollout clients on
    # other hosts use: the host's or pod's IP; None: `host`. The engine must listen there (the template
    # decides: e.g. --host 0.0.0.0)
    url_host: str | None = None
    start_timeout_s: float = 300.0  # process start until healthy
    stop_grace_s: float = 5.0  # SIGTERM -> SIGKILL
    poll_interval_s: float = 0.2  # watchdog and healer period
    update_timeout_s: float = 300.0  # an update of managed engines (heals included), unless the request says
    auto_heal: bool = True
    max_heal_attempts: int = 3  # consecutive failed heals of one engine before the healer gives up
    log_dir: str | None = None  # engine logs (engine-r<rank>.log); None: a fresh temporary folder
    # where each rank keeps the shared-memory segments its engine maps (`segment_ledger`); None: the
    # per-user default, which every daemon, pool and launcher of this user sweeps at an engine's start
    segment_ledger_dir: str | None = None
    # what `{p2p_host}` in `cmd` stands for: the daemon's --p2p-host (a template that uses it needs one)
    p2p_host: str | None = None
    # how updates reach a serving engine: native (vLLM's weight-transfer routes; the engine runs the
    # checkpoint_engine backend), extension (the worker extension's /collective_rpc), auto (native where
    # the engine says it serves them in GET /launcher/status: `vllm_ext.launch` does by default;
    # extension otherwise: a plain engine, a bare `vllm serve`); asked at each update
    update_route: str = "auto"
    # consecutive ranks per engine: a tensor-parallel engine of this many workers, one rank each (the
    # group's first rank runs it); must divide the world size and the ranks per host
    ranks_per_engine: int = 1

    @property
    def loads_from_ps(self) -> bool:
        return loads_from_ps(self.cmd)

    def __post_init__(self) -> None:
        from ckpt_common.validate import check_int, check_number

        check_cmd(self.cmd)
        if uses_p2p_host(self.cmd) and not (isinstance(self.p2p_host, str) and self.p2p_host):
            raise ValueError(
                f"EngineConfig.cmd={list(self.cmd)!r} has a {{p2p_host}} placeholder but p2p_host={self.p2p_host!r}: "
                "start the daemon with --p2p-host ADDR (the address its engines' transfer engines use too)"
            )
        if self.url_host is not None and (
            not isinstance(self.url_host, str) or not self.url_host or any(c in self.url_host for c in "/ ?#@")
        ):
            raise ValueError(
                f"EngineConfig.url_host={self.url_host!r} must be a host name or IP address (no scheme, "
                "port or path), e.g. 10.0.3.7"
            )
        if not self.health_path.startswith("/"):
            raise ValueError(f"EngineConfig.health_path={self.health_path!r} must start with '/'")
        for name in ("start_timeout_s", "stop_grace_s", "poll_interval_s", "update_timeout_s"):
            check_number(f"EngineConfig.{name}", getattr(self, name))
        check_int("EngineConfig.max_heal_attempts", self.max_heal_attempts, low=0)
        check_int("EngineConfig.ranks_per_engine", self.ranks_per_engine, low=1)
        if self.ranks_per_engine > 1 and self.loads_from_ps:
            raise ValueError(
                f"EngineConfig.ranks_per_engine={self.ranks_per_engine} with a {{rendezvous}} engine command: the "
                "load step feeds one tensor-parallel worker from one rank; start tensor-parallel engines with "
                "dummy weights (e.g. vllm_ext.launch --no-initial-push) and the daemon pushes into them"
            )
        if self.update_route not in REQUESTED_ROUTES:
            raise ValueError(f"EngineConfig.update_route={self.update_route!r} must be one of {list(REQUESTED_ROUTES)}")
