"""checkpoint_engine: move a trainer's newest weights into running inference engines.

The top-level names are the ones MoonshotAI's checkpoint-engine exports that mean something here,
so scripts written for it keep their imports (``from checkpoint_engine import ParameterServer,
request_inference_to_update``). Every name is resolved on first use (module ``__getattr__``):
``import checkpoint_engine`` imports neither torch nor vLLM, and ``VllmColocateWorkerExtension``
(the vLLM side, in ``vllm_ext.worker``) is imported only when asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "ParameterServer": "checkpoint_engine.ps",
    "request_inference_to_update": "checkpoint_engine.api",
    "update_weights_from_ipc": "checkpoint_engine.worker",
    "VllmColocateWorkerExtension": "checkpoint_engine.worker",  # compat shim to vllm_ext.worker
    "P2PStore": "checkpoint_engine.transport.mooncake",
}

__all__ = [
    "P2PStore",
    "ParameterServer",
    "VllmColocateWorkerExtension",
    "__version__",
    "request_inference_to_update",
    "update_weights_from_ipc",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from checkpoint_engine.api import request_inference_to_update
    from checkpoint_engine.ps import ParameterServer
    from checkpoint_engine.transport.mooncake import P2PStore
    from checkpoint_engine.worker import update_weights_from_ipc


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpoint_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
