"""The one dtype table: wire names <-> torch dtypes <-> safetensors header codes.

Messages carry names, never pickled dtype objects. Every lookup raises ValueError naming the dtype
and the known ones.
"""

from __future__ import annotations

import torch

_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)

_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}

# safetensors header names -> our names
_SAFETENSORS: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype name {name!r}; supported: {sorted(_DTYPES)}") from None


def dtype_from_safetensors(code: str) -> str:
    try:
        return _SAFETENSORS[code]
    except KeyError:
        raise ValueError(f"unsupported safetensors dtype {code!r}; supported: {sorted(_SAFETENSORS)}") from None


def torch_dtype_from_safetensors(code: str) -> torch.dtype:
    """The torch dtype of a safetensors header code ("F32", "BF16", ...)."""
    return dtype_from_name(dtype_from_safetensors(code))


def itemsize(name: str) -> int:
    return dtype_from_name(name).itemsize
