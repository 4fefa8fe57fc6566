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

Several trainer ranks (`world_size` > 1): `trainer_init` and `send_weights` run on every rank, as
vLLM's API asks. Each trainer rank is one ParameterServer rank, and the engine has one worker per
rank (an engine at tensor parallel `world_size`: one PS rank per engine worker). The PS ranks use
the trainer's default process group (torchrun's; created from its environment when there is none),
which must be exactly these `world_size` ranks. Each rank registers its share of the source:

    source_layout "replicated": every rank's source yields the whole model (DDP; FSDP through
                  `ModuleSource`, whose iteration gathers each tensor on every rank): rank r keeps
                  the tensors at positions r, r + world_size, ... of the iteration
    source_layout "distinct":   each rank's source yields its own tensors (no name on two ranks)

then every rank runs the update (the PS's collectives), and rank 0 (the sender) alone drives vLLM's
routes, naming every rank's socket: each worker of the engine takes its own rank's. A trainer rank at
or past `world_size` holds no PS rank: its `send_weights` only iterates its source, for the
collectives that iteration runs (a Megatron TP group at `world_size` 1: every TP rank writes its
slices, TP rank 0 registers them).

The project's trainers hand over `named_tensors()` (HF layout, the engines' names): wrap it in
`NamedTensorsSource(trainer.named_tensors)` with `source_layout="distinct"`. The Megatron trainer's
is collective at TP > 1: every TP rank writes its slices into one shared-memory HF buffer and TP
rank 0 yields views of it, which the ParameterServer adopts without a copy; the other TP ranks
yield nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from vllm_ext.weight_transfer.infos import BACKEND_NAME, NativeInitInfo
from vllm_ext.weight_transfer.native_req import client_req_func

logger = logging.getLogger(__name__)

SOURCE_LAYOUTS = ("replicated", "distinct")


@dataclass
class CheckpointEngineTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info. `transport`: the ParameterServer's ("cpu", "cuda" or "auto")."""

    backend: ClassVar[str] = BACKEND_NAME

    checkpoint_prefix: str = "vllm-native"
    transport: str = "auto"
    update_timeout_s: float = 600.0  # the ParameterServer's deadline for one whole update
    world_size: int = 1  # trainer ranks = ParameterServer ranks = the engine's workers
    source_layout: str = "replicated"  # "replicated" | "distinct": what each rank's source yields (above)

    def __post_init__(self) -> None:
        w = self.world_size
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {w!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {self.rank!r}")
        if self.source_layout not in SOURCE_LAYOUTS:
            raise ValueError(f"source_layout must be one of {list(SOURCE_LAYOUTS)}, got {self.source_layout!r}")
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
        self.ps = None  # a rank past world_size only iterates its source
        if init_info.rank < init_info.world_size:
            self.ps = ParameterServer(
                rank=init_info.rank,
                world_size=init_info.world_size,
                config=ParameterServerConfig(transport=init_info.transport),
            )
        self.round = 0
        self._registered: str | None = None

    @classmethod
    def trainer_init(cls, init_info: CheckpointEngineTrainerInitInfo, *, client, source=None):
        if source is None:
            raise ValueError("the checkpoint_engine trainer backend needs a WeightSource (e.g. ModuleSource(model))")
        if init_info.is_sender:  # only the sender talks to vLLM; it fails unless the engine runs our backend
            client.init_weight_transfer_engine(NativeInitInfo().to_dict())
        return cls(init_info, client=client, source=source)

    def _share(self) -> dict[str, torch.Tensor]:
        """This rank's tensors of the source (every rank iterates it whole: FSDP's gathers are collectives)."""
        info = self.init_info
        replicated = info.source_layout == "replicated"
        return {
            n: t.detach() for i, (n, t) in enumerate(self.source) if not replicated or i % info.world_size == info.rank
        }

    def send_weights(self) -> None:
        self.round += 1
        name = f"{self.init_info.checkpoint_prefix}-{self.round}"
        if self.ps is None:
            for _ in self.source:  # the iteration's collectives (a Megatron TP rank writes its slices)
                pass
            return
        tensors = self._share()
        self.ps.register_checkpoint(name, named_tensors=tensors)
        try:
            self.ps.gather_metas(name)
            if self.is_sender:
                req_func = client_req_func(self.client, num_workers=self.init_info.world_size, weight_version=name)
            else:
                req_func = _sender_drives_vllm
            self.ps.update(name, req_func, timeout=self.init_info.update_timeout_s)
        except BaseException:
            self.ps.unregister_checkpoint(name)
            raise
        if self._registered is not None:
            self.ps.unregister_checkpoint(self._registered)
        self._registered = name
        logger.info("rank %d: sent %d tensors to vLLM as version %s", self.init_info.rank, len(tensors), name)

    def shutdown(self) -> None:
        if self.ps is not None:
            self.ps.close()


class NamedTensorsSource(WeightSource):
    """vLLM's `WeightSource` over a function returning named tensors, such as a project trainer's
    `named_tensors` (HF layout, the engines' names). Each iteration calls it once; `metadata()`
    describes the last call's tensors (calling it first if there was none: a collective for the
    Megatron trainer at TP > 1, so call it on every rank alike)."""

    def __init__(self, named_tensors: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self._named_tensors = named_tensors
        self._last: Mapping[str, torch.Tensor] | None = None

    def metadata(self) -> list[ParamMeta]:
        if self._last is None:
            self._last = self._named_tensors()
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._last.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._last = self._named_tensors()
        yield from self._last.items()


def _sender_drives_vllm(socket_paths) -> None:
    """A non-sender rank's req_func: rank 0's request names every rank's socket (vLLM's API: only the
    sender calls the engine)."""


WeightTransferTrainerFactory.register_engine(BACKEND_NAME, CheckpointEngineTrainerEngine)
