"""vLLM plug-in: makes `checkpoint_engine` a backend name of vLLM's weight-transfer API.

`setup.py` exposes `register` as a `vllm.general_plugins` entry point, which vLLM runs in each of its
processes (API server, engine core, workers) once the package is installed; `vllm_ext.worker` calls it
too when vLLM imports the extension in its worker. A `VLLM_PLUGINS` allow-list, where one is set, must
name `checkpoint_engine`. Registration is by module path: `vllm_ext.weight_transfer.engine` (torch, ZMQ, the
receiver) is imported only when a worker builds the engine for `--weight-transfer-config
'{"backend": "checkpoint_engine"}'`. The trainer side registers itself when `vllm_ext.weight_transfer.trainer`
is imported (a trainer process never loads vLLM's plug-ins).
"""

from __future__ import annotations

import logging

from vllm_ext.weight_transfer.infos import BACKEND_NAME

logger = logging.getLogger(__name__)

ENGINE_MODULE = "vllm_ext.weight_transfer.engine"
ENGINE_CLASS = "CheckpointEngineWeightTransferEngine"


def register() -> None:
    """Register the worker-side backend with vLLM's factory (idempotent: vLLM may call it again)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, ENGINE_MODULE, ENGINE_CLASS)
    except ValueError:  # already registered in this process (the entry point and the extension both call this)
        logger.debug("weight-transfer backend %r already registered", BACKEND_NAME)
