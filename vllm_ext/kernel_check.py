"""After an update: does each layer's kernel compute with the layer's weights? (what the engine serves)

A checksum of the tensors received says what arrived, not what the engine computes with: a kernel
can keep state derived from older values (on vLLM's CPU backend, the packed copy a linear layer's
GEMM reads), and then every request is answered by a model nobody sent (see `shared_weights`). This
check runs each layer's own kernel (its quant method's `apply`, the call the forward pass makes) on a
few fixed probe rows and compares the result with a plain matmul of the same rows by the weight the
layer should hold:

    for each module with an unquantized linear or embedding method:
        reference weight = the module's own `weight` (embeddings, heads, GPU linears: still in place)
                           or the caller's model-format copy (the direct reload's staging weights)
        y_kernel = quant_method.apply(module, x)      y_ref = x @ weight.T (+ bias)
        relative error |y_kernel - y_ref| / |y_ref| <= tolerance(dtype)  -> else: named, the update fails

A module whose plain weight the CPU packing dropped, with no copy to compare with, is counted as
unchecked. Cost: a 4-row GEMM per layer, twice (microseconds to milliseconds; nothing is allocated
beyond the rows' outputs). `check_kernels` returns the report; `KernelMismatch` names what failed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from vllm_ext.shared_weights import method_kind

PROBE_ROWS = 4
# relative error allowed between a kernel and a plain matmul of the same weights (different
# accumulation orders and blockings); stale weights are uncorrelated with current ones (error ~1.4)
TOLERANCE_BY_DTYPE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 3e-2, torch.float16: 1e-2}


class KernelMismatch(RuntimeError):
    """A layer's kernel does not compute with the weights it should hold."""


@dataclass
class KernelCheckReport:
    modules_checked: int = 0
    modules_unchecked: int = 0  # packed with no model-format copy to compare against
    max_rel_err: float = 0.0
    worst_module: str | None = None
    failed: list[str] = field(default_factory=list)  # "name: relative error e (tolerance t)"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["max_rel_err"] = float(f"{self.max_rel_err:.3g}")
        return d


def probe_rows(in_features: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Fixed rows (the same for every update of a layer of this width)."""
    gen = torch.Generator().manual_seed(1_000_003 + in_features)
    return torch.randn(PROBE_ROWS, in_features, generator=gen).to(device=device, dtype=dtype)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    num = torch.linalg.vector_norm((y.float() - ref.float()).flatten()).item()
    den = torch.linalg.vector_norm(ref.float().flatten()).item()
    if not math.isfinite(num):
        return math.inf
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def check_kernels(
    modules: Sequence[tuple[str, torch.nn.Module]],
    references: Mapping[torch.nn.Module, torch.Tensor] | None = None,
) -> KernelCheckReport:
    """Check every (name, module) given; raises KernelMismatch naming each failed module."""
    references = references or {}
    report = KernelCheckReport()
    with torch.no_grad():
        for name, m in modules:
            if method_kind(m) not in ("embedding", "linear"):
                continue
            weight = references.get(m)
            own = m._parameters.get("weight")
            if weight is None and own is not None and own.dim() == 2 and own.numel() > 0:
                weight = own
            if weight is None or weight.dim() != 2 or weight.numel() == 0:
                report.modules_unchecked += 1
                continue
            bias = m._parameters.get("bias")
            bias = bias if bias is not None and bias.numel() > 0 else None
            x = probe_rows(weight.shape[1], weight.dtype, weight.device)
            y = m.quant_method.apply(m, x, bias)
            ref = torch.nn.functional.linear(x, weight, bias.to(weight.dtype) if bias is not None else None)
            err = relative_error(y, ref) if y.shape == ref.shape else math.inf
            tol = TOLERANCE_BY_DTYPE.get(weight.dtype, 3e-2)
            report.modules_checked += 1
            if report.worst_module is None or err > report.max_rel_err:
                report.max_rel_err, report.worst_module = err, name
            if not err <= tol:
                report.failed.append(f"{name}: relative error {err:.3g} (tolerance {tol:g})")
    if report.failed:
        raise KernelMismatch(
            f"{len(report.failed)} layer(s) compute with other weights than they hold after the update: "
            + "; ".join(report.failed[:5])
            + (" ..." if len(report.failed) > 5 else "")
        )
    return report
