"""The checkpoint engine as a trainer-side backend of vLLM's weight-transfer API.

Importing this module registers `checkpoint_engine` with vLLM's `WeightTransferTrainerFactory` (a
trainer process never loads vLLM's plug-ins), so a trainer written against vLLM's API only changes
its init info:

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm_ext.weight_transfer.trainer import CheckpointEngineTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        CheckpointEngineTrainerInitInfo(rank=0), client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights()   # every round

    send_weights: source ──register_checkpoint(named_tensors)──▶ ParameterServer (host chunks)
                  ──update(name, client_req_func)──▶ client: start_weight_update, update_weights
                  (the engine's bucket receiver, vllm_ext.weight_transfer.engine), finish_weight_update(name)
                  ──▶ the previous round's checkpoint unregistered

The version vLLM reports (`/weight_info`) is the round's checkpoint name, `<checkpoint_prefix>-<n>`.
One trainer rank and one ParameterServer rank for now (an engine of one worker); several ranks
(one PS rank per engine worker, the Megatron trainer's shared-memory handoff) are still to do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from vllm_ext.weight_transfer.infos import BACKEND_NAME, NativeInitInfo
from vllm_ext.weight_transfer.req import client_req_func

logger = logging.getLogger(__name__)


@dataclass
class CheckpointEngineTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info. `transport`: the ParameterServer's ("cpu", "cuda" or "auto")."""

    backend: ClassVar[str] = BACKEND_NAME

    checkpoint_prefix: str = "vllm-native"
    transport: str = "auto"
    update_timeout_s: float = 600.0  # the ParameterServer's deadline for one whole update

    def __post_init__(self) -> None:
        if self.rank != 0:
            raise ValueError(
                f"rank must be 0, got {self.rank}: the checkpoint_engine trainer backend runs one trainer "
                "rank for now (several ranks are still to do, issue 43)"
            )
        if not isinstance(self.checkpoint_prefix, str) or not self.checkpoint_prefix:
            raise ValueError(f"checkpoint_prefix must be a non-empty string, got {self.checkpoint_prefix!r}")
        if self.transport not in ("auto", "cpu", "cuda"):
            raise ValueError(f"transport must be 'auto', 'cpu' or 'cuda', got {self.transport!r}")
        t = self.update_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"update_timeout_s must be a number > 0, got {t!r}")


class CheckpointEngineTrainerEngine(TrainerWeightTransferEngine[CheckpointEngineTrainerInitInfo]):
    """`send_weights()`: one ParameterServer update of the source's tensors into the engine."""

    init_info_cls = CheckpointEngineTrainerInitInfo

    def __init__(self, init_info: CheckpointEngineTrainerInitInfo, *, client, source) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        from checkpoint_engine.config import ParameterServerConfig
        from checkpoint_engine.ps import ParameterServer

        self.init_info = init_info
        self.ps = ParameterServer(rank=0, world_size=1, config=ParameterServerConfig(transport=init_info.transport))
        self.round = 0
        self._registered: str | None = None

    @classmethod
    def trainer_init(cls, init_info: CheckpointEngineTrainerInitInfo, *, client, source=None):
        if source is None:
            raise ValueError("the checkpoint_engine trainer backend needs a WeightSource (e.g. ModuleSource(model))")
        client.init_weight_transfer_engine(NativeInitInfo().to_dict())  # fails unless the engine runs our backend
        return cls(init_info, client=client, source=source)

    def send_weights(self) -> None:
        self.round += 1
        name = f"{self.init_info.checkpoint_prefix}-{self.round}"
        tensors = {n: t.detach() for n, t in self.source}
        self.ps.register_checkpoint(name, named_tensors=tensors)
        try:
            self.ps.gather_metas(name)
            req_func = client_req_func(self.client, num_workers=1, weight_version=name)
            self.ps.update(name, req_func, timeout=self.init_info.update_timeout_s)
        except BaseException:
            self.ps.unregister_checkpoint(name)
            raise
        if self._registered is not None:
            self.ps.unregister_checkpoint(self._registered)
        self._registered = name
        logger.info("sent %d tensors to vLLM as version %s", len(tensors), name)

    def shutdown(self) -> None:
        self.ps.close()


WeightTransferTrainerFactory.register_engine(BACKEND_NAME, CheckpointEngineTrainerEngine)
