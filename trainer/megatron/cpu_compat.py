"""Redirect the three CUDA-only spots of megatron-core so a GPTModel runs on CPU.

megatron-core (checked against 0.16.1) builds and runs a GPTModel with the local layer spec
on CPU once three places stop asking for CUDA:

    spot                                             what it does on a CPU-only machine
    ───────────────────────────────────────────────  ─────────────────────────────────────────
    torch.cuda.current_device()                      RotaryEmbedding.get_emb moves inv_freq there;
                                                       GlobalMemoryBuffer (core attention) allocates there
    transformer.utils.get_default_causal_mask        hard-codes device="cuda"; fused_softmax
      (and the name fused_softmax imported)            imported the name, so both are redirected
    tensor_parallel.random.CudaRNGStatesTracker.fork  saves/restores CUDA RNG state; needs seeded
                                                       CUDA states

``apply_cpu_redirects()`` installs them; it does nothing where CUDA is available (unless
``force=True``) and is idempotent. Nothing happens at import time. Every redirect first checks
that the thing it replaces is where (and shaped as) megatron-core 0.16.1 has it, and raises a
``RuntimeError`` naming the installed version and the spot otherwise, so a megatron-core that
moved one of them fails loudly instead of silently running a CUDA path.

The current_device redirect is scoped: only megatron modules that call it see a ``torch`` whose
``cuda.current_device()`` answers ``"cpu"``; the process's ``torch.cuda`` is untouched. The RNG
redirect makes model-parallel RNG regions use the process's default (CPU) generator, which is
exact without dropout (the demo trains without dropout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import sys
import threading
import types
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

TESTED_MEGATRON_CORE_VERSION = "0.16.1"
_ROTARY_MODULE = "megatron.core.models.common.embeddings.rotary_pos_embedding"
_UTILS_MODULE = "megatron.core.transformer.utils"
_SOFTMAX_MODULE = "megatron.core.fusions.fused_softmax"
_RANDOM_MODULE = "megatron.core.tensor_parallel.random"

_lock = threading.Lock()
_MARK = "_ckpt_engine_cpu_redirect"


@dataclasses.dataclass(frozen=True)
class _Installed:
    """What one redirect replaced, so that ``remove_cpu_redirects`` can put it back."""

    name: str
    owner: object
    attribute: str
    original: object


_installed: dict[tuple[int, str], _Installed] = {}


def megatron_core_version() -> str:
    """The installed megatron-core version, or ``"not installed"``."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("megatron-core")
    except PackageNotFoundError:
        return "not installed"


def _moved(spot: str, detail: str) -> RuntimeError:
    return RuntimeError(
        f"megatron-core {megatron_core_version()} moved a CUDA-only spot that "
        f"trainer.megatron.cpu_compat redirects for CPU runs (written against "
        f"{TESTED_MEGATRON_CORE_VERSION}): {spot}: {detail}. Update cpu_compat.py for this version."
    )


def _import(module_name: str, spot: str) -> types.ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise _moved(spot, f"cannot import {module_name} ({exc})") from exc


def _source(obj: object, spot: str) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise _moved(spot, f"cannot read the source of {obj!r} ({exc})") from exc


# ── spot 1: the rotary embedding's torch.cuda.current_device() ─────────────────────────────


class _CpuCudaNamespace(types.ModuleType):
    """``torch.cuda`` as the rotary module sees it: ``current_device()`` is ``"cpu"``."""

    def __init__(self) -> None:
        super().__init__("torch.cuda (cpu view)")
        setattr(self, _MARK, True)

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"


class _TorchWithCpuCuda(types.ModuleType):
    """``torch`` as the rotary module sees it: everything is torch's, except ``cuda``."""

    def __init__(self) -> None:
        super().__init__("torch (cpu view)")
        self.cuda = _CpuCudaNamespace()
        setattr(self, _MARK, True)

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        setattr(self, name, value)  # later look-ups skip __getattr__
        return value


def _rotary_target() -> tuple[types.ModuleType, str]:
    spot = f"{_ROTARY_MODULE}.RotaryEmbedding.get_emb (torch.cuda.current_device())"
    module = _import(_ROTARY_MODULE, spot)
    cls = getattr(module, "RotaryEmbedding", None)
    if cls is None or not callable(getattr(cls, "get_emb", None)):
        raise _moved(spot, "RotaryEmbedding.get_emb no longer exists")
    if "torch.cuda.current_device()" not in _source(cls.get_emb, spot):
        raise _moved(spot, "get_emb no longer calls torch.cuda.current_device()")
    module_torch = getattr(module, "torch", None)
    if module_torch is not torch and not getattr(module_torch, _MARK, False):
        raise _moved(spot, f"the module's global 'torch' is {module_torch!r}, not the torch module")
    return module, spot


def _uses_current_device(module: types.ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return "torch.cuda.current_device()" in f.read()
    except OSError:
        return False


def _redirect_current_device() -> None:
    """The rotary embedding is the documented spot; megatron.core.utils' GlobalMemoryBuffer (core
    attention's matmul buffer) and others call it too, so every loaded megatron module that calls
    ``torch.cuda.current_device()`` gets the CPU view of torch. Modules imported later are covered
    by calling ``apply_cpu_redirects()`` again (it is idempotent)."""
    _rotary_target()
    view = _TorchWithCpuCuda()
    for name, module in sorted(sys.modules.items()):
        if (
            (name == "megatron" or name.startswith("megatron."))
            and isinstance(module, types.ModuleType)
            and getattr(module, "torch", None) is torch
            and _uses_current_device(module)
        ):
            _replace("current_device", module, "torch", view)


# ── spot 2: get_default_causal_mask (device="cuda"), also imported by name by fused_softmax ──


def cpu_causal_mask(sq: int) -> torch.Tensor:
    """The [sq, sq] causal mask Megatron's softmax expects (True above the diagonal), on CPU."""
    return torch.ones(sq, sq, dtype=torch.bool).triu_(diagonal=1)


setattr(cpu_causal_mask, _MARK, True)


def _mask_targets() -> list[tuple[types.ModuleType, str]]:
    spot = f'{_UTILS_MODULE}.get_default_causal_mask (device="cuda")'
    utils = _import(_UTILS_MODULE, spot)
    softmax = _import(_SOFTMAX_MODULE, spot)
    original = getattr(utils, "get_default_causal_mask", None)
    if original is None or not callable(original):
        raise _moved(spot, "transformer.utils.get_default_causal_mask no longer exists")
    if not getattr(original, _MARK, False):
        params = list(inspect.signature(original).parameters)
        if params != ["sq"]:
            raise _moved(spot, f"its parameters are {params}, expected ['sq']")
        if "cuda" not in _source(original, spot):
            raise _moved(spot, "it no longer hard-codes a CUDA device")
    if getattr(softmax, "get_default_causal_mask", None) is None:
        raise _moved(spot, "fusions.fused_softmax no longer imports get_default_causal_mask by name")
    if not getattr(softmax.get_default_causal_mask, _MARK, False) and softmax.get_default_causal_mask is not original:
        raise _moved(spot, "fused_softmax's get_default_causal_mask is not transformer.utils' function")
    return [(utils, "get_default_causal_mask"), (softmax, "get_default_causal_mask")]


def _redirect_mask() -> None:
    for module, attribute in _mask_targets():
        _replace(f"causal mask ({module.__name__})", module, attribute, cpu_causal_mask)


# ── spot 3: CudaRNGStatesTracker.fork ─────────────────────────────────────────────────────


@contextlib.contextmanager
def _fork_on_cpu(self, name: str = "model-parallel-rng"):
    """Stand-in for ``CudaRNGStatesTracker.fork``: the region uses the default CPU generator."""
    del self, name
    yield


setattr(_fork_on_cpu, _MARK, True)


def _rng_target() -> type:
    spot = f"{_RANDOM_MODULE}.CudaRNGStatesTracker.fork (CUDA RNG state)"
    module = _import(_RANDOM_MODULE, spot)
    cls = getattr(module, "CudaRNGStatesTracker", None)
    if cls is None:
        raise _moved(spot, "CudaRNGStatesTracker no longer exists")
    fork = cls.__dict__.get("fork")
    if fork is None:
        raise _moved(spot, "CudaRNGStatesTracker.fork is no longer defined on the class")
    if not getattr(fork, _MARK, False):
        params = list(inspect.signature(fork).parameters)
        if params[:2] != ["self", "name"]:
            raise _moved(spot, f"fork's parameters are {params}, expected ['self', 'name']")
        if "_set_cuda_rng_state" not in _source(fork, spot):
            raise _moved(spot, "fork no longer sets CUDA RNG state")
    return cls


def _redirect_rng() -> None:
    _replace("rng fork", _rng_target(), "fork", _fork_on_cpu)


# ── apply / check / remove ───────────────────────────────────────────────────────────────


def _replace(name: str, owner: object, attribute: str, replacement: object) -> None:
    key = (id(owner), attribute)
    if key in _installed:
        return
    _installed[key] = _Installed(name, owner, attribute, getattr(owner, attribute))
    setattr(owner, attribute, replacement)


_REDIRECTS: tuple[tuple[str, Callable[[], None]], ...] = (
    ("current_device", _redirect_current_device),
    ("causal mask", _redirect_mask),
    ("rng fork", _redirect_rng),
)


def check_cpu_redirect_targets() -> None:
    """Raise ``RuntimeError`` if any spot is not where megatron-core 0.16.1 has it; change nothing."""
    _rotary_target()
    _mask_targets()
    _rng_target()


def apply_cpu_redirects(*, force: bool = False) -> tuple[str, ...]:
    """Install the three CPU redirects if CUDA is absent (or ``force``); return what is active.

    Idempotent. All spots are checked before any is replaced, so a moved spot leaves megatron-core
    untouched.
    """
    if torch.cuda.is_available() and not force:
        logger.info("CUDA is available: megatron-core runs unmodified (no CPU redirects)")
        return ()
    with _lock:
        check_cpu_redirect_targets()
        for _, redirect in _REDIRECTS:
            redirect()
        active = tuple(sorted({entry.name for entry in _installed.values()}))
    logger.info("megatron-core %s: CPU redirects active: %s", megatron_core_version(), ", ".join(active))
    return active


def active_cpu_redirects() -> tuple[str, ...]:
    """Names of the redirects installed in this process."""
    with _lock:
        return tuple(sorted({entry.name for entry in _installed.values()}))


def remove_cpu_redirects() -> None:
    """Put back everything ``apply_cpu_redirects`` replaced (tests use this)."""
    with _lock:
        for entry in reversed(list(_installed.values())):
            setattr(entry.owner, entry.attribute, entry.original)
        _installed.clear()
