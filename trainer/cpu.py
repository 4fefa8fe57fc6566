"""CPU facts that decide how the trainers run: the autocast dtype and the thread count.

bfloat16 autocast is only fast where the CPU has bf16 instructions (AVX512-BF16, AMX, ARM BF16);
elsewhere oneDNN emulates it, tens of times slower than float32. The flags alone can lie
(``ONEDNN_MAX_CPU_ISA=AVX2`` caps oneDNN's kernels while /proc/cpuinfo still lists avx512_bf16),
so ``"auto"`` picks bfloat16 only when the flags say native bf16 AND one timed matmul in this
process confirms it beats float32.

    requested "auto" ──▶ cpu flags with native bf16? ──no──▶ float32
                                │ yes
                                ▼
                  time (1024x256)@(256x1024), interleaved, best of 15: bf16 < 8 x float32? ──▶ bfloat16 | float32
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import platform
import time

logger = logging.getLogger(__name__)

AUTOCAST_DTYPES = ("auto", "float32", "bfloat16")
# x86 flags (/proc/cpuinfo "flags") and the ARM feature (/proc/cpuinfo "Features") of native bf16.
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """The autocast dtype a trainer uses and why (written to summary.json)."""

    requested: str
    chosen: str
    reason: str
    cpu_model: str
    bf16_flags: tuple[str, ...]
    float32_matmul_ms: float | None = None
    bfloat16_matmul_ms: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, tuple[str, ...]]:
    """(CPU model name, native-bf16 flags present) read from ``path`` ('' and () where unknown)."""
    model, flags = "", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "features"):
                    flags.update(value.split())
    except OSError:
        pass
    model = model or platform.processor()
    return model, tuple(f for f in _NATIVE_BF16_FLAGS if f in flags)


# Emulated bf16 (no native instructions, or oneDNN capped) runs this matmul 30-100x slower than
# float32 and native bf16 runs it 2-6x faster. On a loaded machine both timings swell and jitter
# (bf16 2.1x *slower* than float32 was seen on a native CPU under load 15), so the timings are
# interleaved (each side sees the same load) and the margin is 8x: a flipped choice would also
# change the SFT cache key and retrain a different model.
EMULATED_SLOWDOWN = 8.0
TIMING_ROUNDS = 3


def _matmul_ms(bf16: bool, repeats: int = 5) -> float:
    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 256, generator=gen), torch.randn(256, 1024, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        a @ b  # warm-up: kernel selection and first-touch
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def decide_autocast_dtype(
    requested: str, *, bf16_flags: tuple[str, ...], cpu_model: str = "", time_matmul=_matmul_ms
) -> DtypeChoice:
    """Pure decision, given the CPU's flags and a matmul timer ``time_matmul(bf16) -> ms``."""
    if requested not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast_dtype={requested!r} must be one of {AUTOCAST_DTYPES}")
    if requested != "auto":
        return DtypeChoice(requested, requested, "set in the config", cpu_model, bf16_flags)
    if not bf16_flags:
        return DtypeChoice(
            requested, "float32", "no native bf16 in the CPU flags (avx512_bf16, amx_bf16, bf16)", cpu_model, bf16_flags
        )
    fp32_ms = bf16_ms = float("inf")
    for _ in range(TIMING_ROUNDS):  # interleaved: a burst of load hits both sides alike
        fp32_ms, bf16_ms = min(fp32_ms, time_matmul(False)), min(bf16_ms, time_matmul(True))
    if bf16_ms < EMULATED_SLOWDOWN * fp32_ms:
        return DtypeChoice(
            requested,
            "bfloat16",
            f"native bf16 ({', '.join(bf16_flags)}) and a bf16 matmul is not emulated "
            f"({bf16_ms:.2f} vs {fp32_ms:.2f} ms in float32)",
            cpu_model,
            bf16_flags,
            fp32_ms,
            bf16_ms,
        )
    return DtypeChoice(
        requested,
        "float32",
        f"the CPU flags list {', '.join(bf16_flags)} but a bf16 matmul runs emulated, over "
        f"{EMULATED_SLOWDOWN:g}x slower than float32 ({bf16_ms:.2f} vs {fp32_ms:.2f} ms; "
        "e.g. ONEDNN_MAX_CPU_ISA caps it)",
        cpu_model,
        bf16_flags,
        fp32_ms,
        bf16_ms,
    )


@functools.cache
def resolve_autocast_dtype(requested: str) -> DtypeChoice:
    """The dtype to autocast to on this CPU (``"auto"`` measured once per process), logged once."""
    model, flags = cpu_info()
    choice = decide_autocast_dtype(requested, bf16_flags=flags, cpu_model=model)
    logger.info("autocast dtype %s (%s): %s; CPU %s", choice.chosen, requested, choice.reason, model or "unknown")
    return choice


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; containers and taskset narrow it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def num_threads_for(requested: int | None) -> int:
    """Threads for torch: ``requested`` capped at the usable CPUs; ``None`` means all of them."""
    cpus = usable_cpus()
    if requested is None:
        return cpus
    if requested > cpus:
        logger.info("num_threads=%d capped at the %d CPUs in this process's affinity", requested, cpus)
    return min(requested, cpus)
