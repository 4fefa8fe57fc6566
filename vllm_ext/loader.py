"""vLLM load format `checkpoint_engine`: the engine's own load step takes its weights from a parameter server.

    vllm serve DIR --load-format checkpoint_engine --worker-extension-cls vllm_ext.worker.VllmColocateWorkerExtension \
        --model-loader-extra-config '{"rendezvous": "ipc:///run/me/load.sock", "timeout_s": 900}'

vLLM starts as usual (processes, model construction); when it reaches its load step, the loader
binds a ZMQ REP socket at `rendezvous` and waits (up to `timeout_s`) for the parameter server:

    PS side (launcher)                          engine side (this loader, inside vLLM's load_model)
    wait_for_loader:  {"op": "hello"}     ──▶   {"ok": true, "waiting": true}
    ps.update(name, loader_req_func(...)):
        req_func:     {"op": "load",      ──▶   WeightReceiver.receive(handle): buckets ─▶ model.load_weights
                       "zmq_handles": {...}}    (vLLM's loaders, no packing: vLLM packs right after, as for a disk load)
                                          ◀──   {"ok": true, "report": {...}}   (or {"ok": false, "error": "..."})

So the parameter server reads the checkpoint while vLLM starts, and vLLM never holds dummy weights:
no random initialisation, no packing of dummy weights, no second packing after a push. The receiver
that did the load (its version 1, its weight cache) is handed to the worker extension, which uses
it for later updates. Messages are JSON (nothing is unpickled). A bad request is answered with an
error and the loader keeps waiting; a failed or aborted load fails vLLM's start with that error.

The rendezvous protocol itself (both sides: `serve_initial_load`; `wait_for_loader`, `loader_req_func`)
needs no vLLM and lives in `checkpoint_engine.transport.load_rendezvous` (re-exported here);
`register_load_format()` registers the loader with vLLM. The worker extension does that when vLLM
imports it in the worker, before the model is loaded, so the load format needs
`--worker-extension-cls vllm_ext.worker.VllmColocateWorkerExtension` (which also carries the receiver
on to later updates). Not a `vllm.general_plugins` entry point: that would import vLLM's loader
registry (~0.5 s) in every process of every vLLM start on the machine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from checkpoint_engine.transport.load_rendezvous import read_pull_hint, serve_initial_load
from checkpoint_engine.transport.mooncake import is_cpu_set

logger = logging.getLogger(__name__)
vllm_logger = logging.getLogger("vllm.checkpoint_engine")  # inside vLLM's processes: shown in vLLM's log

LOAD_FORMAT = "checkpoint_engine"


@dataclass(frozen=True)
class LoaderSettings:
    """`--model-loader-extra-config` of the `checkpoint_engine` load format."""

    rendezvous: str  # ipc://PATH or tcp://HOST:PORT; "{rank}" is replaced by the TP rank
    timeout_s: float = 900.0  # how long the load step waits for the parameter server, and for each of its messages
    p2p_host: str | None = None  # start the engine's transfer engine here while waiting (pulls it reads itself)
    p2p_cpus: tuple[int, ...] | None = None  # where its threads run (`P2PConfig.cpus`); None: the loader's own

    def __post_init__(self) -> None:
        if not isinstance(self.rendezvous, str) or not self.rendezvous.startswith(("ipc://", "tcp://")):
            raise ValueError(f"rendezvous must be an ipc:// or tcp:// address, got {self.rendezvous!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0, got {self.timeout_s!r}")
        if self.p2p_host is not None and (not isinstance(self.p2p_host, str) or not self.p2p_host):
            raise ValueError(f"p2p_host must be a non-empty address, got {self.p2p_host!r}")
        if self.p2p_cpus is not None:
            cpus = self.p2p_cpus
            if not (isinstance(cpus, (list, tuple)) and is_cpu_set(cpus)):
                raise ValueError(f"p2p_cpus must be a non-empty list of CPU numbers >= 0, got {cpus!r}")
            object.__setattr__(self, "p2p_cpus", tuple(sorted(set(cpus))))  # from JSON: a list

    @classmethod
    def from_dict(cls, d: Mapping | None) -> LoaderSettings:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown {LOAD_FORMAT} loader setting(s) {unknown}; known: {sorted(known)}")
        if "rendezvous" not in d:
            raise ValueError(
                f"load format {LOAD_FORMAT!r} needs --model-loader-extra-config "
                '\'{"rendezvous": "ipc://PATH"}\' (where the parameter server will reach the engine)'
            )
        return cls(**d)

    def address(self, tp_rank: int, tp_size: int) -> str:
        if tp_size > 1 and "{rank}" not in self.rendezvous:
            raise ValueError(
                f"with {tp_size} tensor-parallel ranks the rendezvous needs a '{{rank}}' placeholder, "
                f"got {self.rendezvous!r}"
            )
        return self.rendezvous.replace("{rank}", str(tp_rank))


# -- handoff to the worker extension (same process) ----------------------------------------------
_initial_lock = threading.Lock()
_initial_receiver = None


def take_initial_receiver():
    """The receiver that performed this process's initial load (once), or None."""
    global _initial_receiver
    with _initial_lock:
        receiver, _initial_receiver = _initial_receiver, None
    return receiver


def _keep_initial_receiver(receiver) -> None:
    global _initial_receiver
    with _initial_lock:
        _initial_receiver = receiver


def missing_parameters(param_names: Sequence[str], loaded: set[str]) -> list[str]:
    """Parameters the load did not fill (sorted)."""
    return sorted(set(param_names) - loaded)


# -- vLLM -----------------------------------------------------------------------------------------
def register_load_format() -> None:
    """Register `checkpoint_engine` with vLLM's loader registry (idempotent)."""
    from vllm.model_executor import model_loader as registry

    if LOAD_FORMAT in getattr(registry, "_LOAD_FORMAT_TO_MODEL_LOADER", {}):
        return
    registry.register_model_loader(LOAD_FORMAT)(_loader_class())


def _loader_class():
    import torch
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class CheckpointEngineLoader(BaseModelLoader):
        """vLLM loader whose weights come from a parameter server (see the module docstring)."""

        def __init__(self, load_config):
            super().__init__(load_config)
            self.settings = LoaderSettings.from_dict(load_config.model_loader_extra_config)

        def download_model(self, model_config) -> None:
            pass  # nothing to download: the parameter server brings the weights

        def load_weights(self, model: torch.nn.Module, model_config) -> None:
            t_enter = time.perf_counter()
            from vllm.config import get_current_vllm_config, set_current_vllm_config

            from checkpoint_engine.transport.prefault import prefault
            from vllm_ext.receiver import WeightReceiver
            from vllm_ext.settings import ReceiverConfig
            from vllm_ext.worker_handle import select_handle, tp_rank_and_size

            vllm_config = get_current_vllm_config()
            extra = getattr(vllm_config, "additional_config", None) or {}
            config = ReceiverConfig.from_dict(extra.get("checkpoint_engine") if isinstance(extra, Mapping) else None)
            tp_rank, tp_size = tp_rank_and_size()
            address = self.settings.address(tp_rank, tp_size)
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            loaded: set[str] = set()

            def load(weights) -> None:  # once per bucket; re-enters vLLM's context (harmless where it is set)
                with set_current_vllm_config(vllm_config), torch.device(device):
                    names = model.load_weights(weights)
                loaded.update(names or ())

            # The load itself keeps no copy: the PS's registered memory goes to vLLM's loaders as views
            # (one copy, into the parameters, as a disk load does). The weight cache, when configured,
            # is filled by the first update (until then: no checksum, no fill-in after an abort).
            # Each bucket is loaded before its Ack: double-buffer tensors need no copy either.
            receiver = WeightReceiver(load, config=replace(config, weight_cache=False), load_per_bucket=True)
            if self.settings.p2p_host:  # ready before the PS arrives, as its own ranks' are: connected
                # to the owners the daemon expects this load to read (a heal's pull), and each tensor's
                # slot in the parameters found
                hint = read_pull_hint(address)
                receiver.remote_reads.prestart(self.settings.p2p_host, self.settings.p2p_cpus, hint.peers)
                if hint.tensors:
                    receiver.probe_ahead(hint.tensors)
            is_cuda = device.type == "cuda"

            # The parameters are fresh memory: map their pages in bulk now (one call each) rather than
            # take a page fault per 4 KiB page inside the loaders' copies.
            prefault_bytes = prefault(p.data for p in model.parameters())
            t_ready = time.perf_counter()
            t_request: list[float] = []

            def receive(handles: dict[str, str]) -> dict:
                """One update into the fresh model; every parameter must be filled (else the PS hears why)."""
                t_request.append(time.perf_counter())
                uuid = str(torch.cuda.get_device_properties(device).uuid) if is_cuda else None
                handle = select_handle(handles, device_uuid=uuid, tp_rank=tp_rank)
                report = receiver.receive(handle, device.index if is_cuda else None)
                missing = missing_parameters([n for n, _ in model.named_parameters()], loaded)
                if missing:
                    raise ValueError(
                        f"checkpoint {report.get('checkpoint')!r} has no weights for {len(missing)} "
                        f"parameter(s) of the model, e.g. {missing[:5]}"
                    )
                return report

            report = serve_initial_load(address, receive, timeout_s=self.settings.timeout_s)
            if receiver.mappings is not None:
                receiver.mappings.clear()  # nothing refers to the PS's memory any more: let it go with the PS
            receiver.config = config  # later updates run under the engine's settings,
            receiver.load_per_bucket = False  # through the worker's reload (one call per update)
            _keep_initial_receiver(receiver)
            last = report.get("last_update") or {}
            vllm_logger.info(
                "checkpoint %r from the parameter server: set-up %.2f s (%.2f GiB of parameters "
                "prefaulted), waited %.2f s, loaded %d tensors in %.2f s (mapping and transfer %.2f s, "
                "loaders %.2f s)",
                report.get("checkpoint"),
                t_ready - t_enter,
                prefault_bytes / 2**30,
                t_request[0] - t_ready,
                len(loaded),
                time.perf_counter() - t_request[0],
                last.get("transfer_s") or 0.0,
                last.get("reload_tail_s") or 0.0,
            )

    return CheckpointEngineLoader
