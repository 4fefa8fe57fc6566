"""vLLM worker extension: receive checkpoint-engine updates and reload them in place.

Load it with `--worker-extension-cls vllm_ext.worker.VllmColocateWorkerExtension` (or
`LLM(..., worker_extension_cls=...)`); vLLM mixes it into its worker class, so its methods are
callable with `collective_rpc` (HTTP: `POST /collective_rpc` with `VLLM_SERVER_DEV_MODE=1`):

    update_weights_from_ipc(zmq_handles)  receive one update (the anchor project's name and shape)
    weights_state()                       version, status (initial|receiving|ready|incomplete), last error
    weights_checksum()                    checksum of the checkpoint-format weights loaded (see weight_cache)
    arm_update_fault(spec)                test-only: make the next update raise or stall in a bucket
                                          (or, through vLLM's weight-transfer routes, raise at start or finish)

Weights go through the model runner's reload path (`reload_weights(weights_iterator=...)`), which
redoes repacking and quantization processing; plain `model.load_weights` breaks on CPU once the
linear weights have been repacked. On vLLM's CPU backend with an unquantized model (one TP rank),
`reload_impl: "auto"` (the default) uses `vllm_ext.direct_reload` instead: the same loaders and
packing without the layerwise bookkeeping, allocations and copies (`"vllm"` forces vLLM's reload).
Settings come from vLLM's additional config:
`--additional-config '{"checkpoint_engine": {"timeout_s": 600, "reload_mode": "streaming"}}'`.

With vLLM's weight-transfer backend `checkpoint_engine` also configured (`vllm_ext.weight_transfer.engine`),
these methods act on that backend's receiver: one receiver per worker, whichever door an update uses.

vLLM refuses an extension whose attribute names exist on the worker class, so every helper here
carries the `_ckpt_engine_` prefix (`update_weights` would clash with vLLM's own transfer API).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

from vllm_ext.worker_handle import select_handle, tp_rank_and_size

logger = logging.getLogger(__name__)


class VllmColocateWorkerExtension:
    """Mixed into vLLM's worker; `self` is the worker (model_runner, device, vllm_config)."""

    def update_weights_from_ipc(self, zmq_handles: dict[str, str]) -> dict:
        """Receive one update from this device's PS rank; return `weights_state()`.

        Raises (and reports `incomplete` afterwards) when the update is aborted anywhere; under tensor
        parallelism it answers instead, with the error as `update_error` (see below).
        """
        if (target := self._ckpt_engine_target()) is not self:
            return target.update_weights_from_ipc(zmq_handles)
        receiver = self._ckpt_engine_receiver()
        device = self.device
        is_cuda = getattr(device, "type", "cpu") == "cuda"
        uuid = None
        if is_cuda:
            import torch

            uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = select_handle(zmq_handles, device_uuid=uuid, tp_rank=self._ckpt_engine_tp_rank())
        undefined_before = receiver.reload_error is not None
        try:
            report = receiver.receive(handle, device.index if is_cuda else None)
        except Exception as e:
            if tp_rank_and_size()[1] == 1:
                raise
            # Under tensor parallelism a raise here would leave vLLM's multiproc executor one answer
            # behind: its collective_rpc raises on the first failed worker and leaves the other workers'
            # answers queued, where the next call (the full version after a refused delta, a state
            # query) reads them as its own. Every worker answers instead; the PS learns of the failure
            # over its link, the caller from `update_error` (`vllm_ext.extension_req.check_reports`).
            logger.warning("checkpoint-engine: update failed on this worker: %s: %s", type(e).__name__, e)
            return {**receiver.report(), "update_error": f"{type(e).__name__}: {e}"}
        if undefined_before and receiver.reload_error is None:
            # The engine served from undefined weights (an aborted update with nothing to fill in): the
            # KV cache memory may hold NaNs, which attention can read from the unused slots of a reused
            # block even after the prefix cache was reset. The weights are whole again: clear it.
            receiver.last_update["kv_cache_cleared_bytes"] = self._ckpt_engine_clear_kv_cache()
            report = receiver.report()
        return report

    def weights_state(self) -> dict:
        if (target := self._ckpt_engine_target()) is not self:
            return target.weights_state()
        report = self._ckpt_engine_receiver().report()
        direct = getattr(self, "_ckpt_engine_direct_obj", None)
        stats = direct.last_stats if direct is not None else None
        decided = hasattr(self, "_ckpt_engine_direct_obj")  # on the first update
        report.update(
            reload_impl=None if not decided else "vllm" if direct is None else "direct",
            reload_impl_note=getattr(self, "_ckpt_engine_impl_note", None),
            shared_weights=getattr(self, "_ckpt_engine_shared_note", None),
            kernel_check=getattr(self, "_ckpt_engine_kernel_report", None),
            direct_reload_last=None
            if stats is None
            else {k: round(v, 4) if isinstance(v, float) else v for k, v in stats.__dict__.items()},
        )
        return report

    def weights_checksum(self) -> dict:
        return self._ckpt_engine_target()._ckpt_engine_receiver().checksum_report()

    def arm_update_fault(self, spec: dict) -> dict:
        return self._ckpt_engine_target()._ckpt_engine_receiver().arm_fault(spec)

    # -- helpers (prefixed: see the module docstring) ----------------------------------------
    def _ckpt_engine_target(self):
        """Where this worker's receiver lives: on the worker, or, when vLLM also runs the
        `checkpoint_engine` weight-transfer backend here (`vllm_ext.weight_transfer.engine`), on that engine's
        view of the worker, so that both doors share one receiver."""
        view = getattr(getattr(self, "weight_transfer_engine", None), "worker_view", None)
        return view if isinstance(view, VllmColocateWorkerExtension) else self

    def _ckpt_engine_receiver(self):
        receiver = getattr(self, "_ckpt_engine_receiver_obj", None)
        if receiver is None:
            from vllm_ext.loader import take_initial_receiver
            from vllm_ext.receiver import WeightReceiver
            from vllm_ext.settings import ReceiverConfig

            receiver = take_initial_receiver()  # the load step received the weights (load format checkpoint_engine)
            if receiver is not None:
                receiver.rebind(
                    self._ckpt_engine_reload,
                    recover_fn=self._ckpt_engine_recover,
                    cache_slots_fn=self._ckpt_engine_cache_slots,
                    partial_reload_fn=self._ckpt_engine_partial_reload,
                )
                self._ckpt_engine_receiver_obj = receiver
                logger.info("checkpoint-engine receiver taken over from the load step (%s)", receiver.config)
                self._ckpt_engine_shard_reads(receiver)
                self._ckpt_engine_check_loaded(receiver)
                return receiver
            extra = getattr(self.vllm_config, "additional_config", None) or {}
            settings = extra.get("checkpoint_engine") if isinstance(extra, Mapping) else None
            dummy = str(getattr(self.vllm_config.load_config, "load_format", "")) == "dummy"
            receiver = WeightReceiver(
                self._ckpt_engine_reload,
                recover_fn=self._ckpt_engine_recover,
                config=ReceiverConfig.from_dict(settings),
                initial_weights="dummy" if dummy else "checkpoint",
                cache_slots_fn=self._ckpt_engine_cache_slots,
                partial_reload_fn=self._ckpt_engine_partial_reload,
            )
            self._ckpt_engine_receiver_obj = receiver
            logger.info("checkpoint-engine receiver ready (%s)", receiver.config)
        self._ckpt_engine_shard_reads(receiver)
        return receiver

    def _ckpt_engine_shard_reads(self, receiver) -> None:
        """Under tensor parallelism a pull this worker reads itself (remote buffers) reads only the
        slices its loaders take (`vllm_ext.shard_probe`, on a meta-device copy of the model); set once."""
        if getattr(self, "_ckpt_engine_shards_set", False):
            return
        self._ckpt_engine_shards_set = True
        if tp_rank_and_size()[1] > 1:
            from vllm_ext.shard_probe import meta_model_probe

            limit = receiver.config.sharded_max_ranges_per_tensor
            receiver.read_slices(meta_model_probe(self.vllm_config), max_ranges_per_tensor=limit)
            logger.info("checkpoint-engine: pulls this worker reads itself take only its tensor-parallel slices")

    def _ckpt_engine_reload(self, weights_iterator) -> None:
        """One reload (vLLM's or the direct one), then the weights other modules share processed again
        (`vllm_ext.shared_weights`) and, unless `kernel_check` is off, every layer's kernel checked
        against its weights (`vllm_ext.kernel_check`: raises, so the update fails and the engine
        reports `incomplete`)."""
        from vllm.config import set_current_vllm_config

        direct = self._ckpt_engine_direct()
        if direct is None:  # vLLM's own reload (the worker's wraps the runner's under the vLLM config)
            self.reload_weights(weights_iterator=weights_iterator)
        else:
            with set_current_vllm_config(self.vllm_config):
                direct(weights_iterator)
            runner = self.model_runner
            for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as runner.reload_weights
                reset = getattr(runner, name, None)
                if callable(reset):
                    reset()
        self._ckpt_engine_after_reload(direct)

    def _ckpt_engine_models(self) -> list:
        """(prefix, model) of what this worker computes with: the model and, with speculative decoding,
        its draft model (which may share the target's embedding or head)."""
        import torch

        models = [("", self.model_runner.get_model())]
        draft = getattr(getattr(self.model_runner, "drafter", None), "model", None)
        if isinstance(draft, torch.nn.Module):
            models.append(("drafter.", draft))
        return models

    def _ckpt_engine_check_loaded(self, receiver) -> None:
        """The kernel check for weights vLLM's load step took (vLLM processed every layer after it):
        a failure turns the version incomplete, so the gate refuses generation."""
        from vllm_ext.kernel_check import KernelMismatch

        if not receiver.config.kernel_check:
            return
        try:
            self._ckpt_engine_run_kernel_check(None)
        except KernelMismatch as e:
            logger.error("the weights of the load step failed the kernel check: %s", e)
            receiver.state.invalidate(str(e))

    def _ckpt_engine_run_kernel_check(self, direct) -> None:
        from vllm.config import set_current_vllm_config

        from vllm_ext.kernel_check import check_kernels

        models = self._ckpt_engine_models()
        modules = [(f"{prefix}{name}", m) for prefix, model in models for name, m in model.named_modules()]
        refs = direct.reference_weights() if direct is not None else None
        self._ckpt_engine_kernel_report = None
        with set_current_vllm_config(self.vllm_config):
            self._ckpt_engine_kernel_report = check_kernels(modules, refs).as_dict()

    def _ckpt_engine_after_reload(self, direct) -> None:
        from vllm.config import set_current_vllm_config

        from vllm_ext.shared_weights import reprocess_shared

        with set_current_vllm_config(self.vllm_config):
            plan = reprocess_shared(self._ckpt_engine_models())
        self._ckpt_engine_shared_note = {"reprocessed": list(plan.reprocess), "refused": list(plan.refused)}
        self._ckpt_engine_kernel_report = None
        if self._ckpt_engine_receiver().config.kernel_check:
            self._ckpt_engine_run_kernel_check(direct)  # raises KernelMismatch: the update fails

    def _ckpt_engine_direct(self):
        """The direct reloader when `reload_impl` allows and the model qualifies (decided once), else None."""
        if hasattr(self, "_ckpt_engine_direct_obj"):
            return self._ckpt_engine_direct_obj
        impl = self._ckpt_engine_receiver().config.reload_impl
        direct, why = None, "reload_impl is 'vllm'"
        if impl != "vllm":
            from vllm_ext.direct_reload import build_direct_reloader

            direct, why = build_direct_reloader(self.model_runner.get_model(), self.vllm_config)
            if direct is None and impl == "direct":
                raise RuntimeError(f"reload_impl 'direct' does not apply to this engine: {why}")
        self._ckpt_engine_direct_obj = direct
        self._ckpt_engine_impl_note = (
            f"{len(direct.plan.processed)} layers packed directly, {len(direct.plan.staged)} with staging weights"
            if direct is not None
            else why
        )
        logger.info(
            "checkpoint-engine reload: %s (%s)", "direct" if direct is not None else "vllm", self._ckpt_engine_impl_note
        )
        return direct

    def _ckpt_engine_clear_kv_cache(self) -> int:
        """Zero every KV cache tensor of this worker; return the bytes cleared."""
        import torch

        cleared, todo = 0, list(getattr(self.model_runner, "kv_caches", None) or [])
        while todo:
            item = todo.pop()
            if isinstance(item, torch.Tensor):
                item.zero_()
                cleared += item.numel() * item.element_size()
            elif isinstance(item, (list, tuple)):
                todo.extend(item)
        logger.warning("cleared %.2f GiB of KV cache after undefined weights were served", cleared / 2**30)
        return cleared

    def _ckpt_engine_partial_reload(self) -> bool:
        """The direct reload keeps every layer it is not given as it is (packed); vLLM's layerwise
        reload wants each layer's every tensor."""
        return self._ckpt_engine_direct() is not None

    def _ckpt_engine_cache_slots(self) -> dict:
        direct = getattr(self, "_ckpt_engine_direct_obj", None)
        return direct.cache_slots() if direct is not None else {}

    def _ckpt_engine_recover(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)

    def _ckpt_engine_tp_rank(self) -> int:
        return tp_rank_and_size()[0]


def _prepare_vllm_process() -> None:
    """vLLM imports this module in its worker before loading the model: make the `checkpoint_engine` load
    format and weight-transfer backend known there (also without the package's `vllm.general_plugins`
    entry point, e.g. when run from a checkout) and let the engine load its compiled model from vLLM's
    cache (`vllm_ext.compile_cache`). Imported elsewhere, it stays light."""
    if "vllm" in sys.modules:
        from vllm_ext.compile_cache import repair_aot_cache_load
        from vllm_ext.loader import register_load_format
        from vllm_ext.weight_transfer.plugin import register as register_weight_transfer_backend

        register_load_format()
        register_weight_transfer_backend()
        repair_aot_cache_load()


_prepare_vllm_process()
