"""Frozen config dataclasses <-> JSON trees: the one generic from_dict, merging and ``--set`` overrides.

::

    to_dict(config) ──▶ {...} ◀──merge── a JSON file ◀──apply_overrides── ["rl.lr=3e-4", ...]
                                    │
                                    ▼
    from_dict(cls, tree) ──▶ cls(**fields) with nested sections built the same way; every
        dataclass's ``__post_init__`` validates its own fields; unknown keys, wrong shapes and a
        section's own errors name the dotted key path ("sft: lr=-1 must be > 0")

Pure (dataclasses, json, typing): ``ckpt_common.cli_config`` is the flags counterpart (argparse
from the same dataclasses); this is the JSON one, kept here because only the orchestrator's job
config is a JSON tree.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any


def to_dict(obj: Any) -> Any:
    """A JSON-ready form of a config tree (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


def from_dict(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """Build dataclass ``cls`` from a (JSON) mapping, converting nested sections and tuples.

    ``path``: where ``data`` sits in the whole tree ("" at the top); unknown keys, wrong shapes and the
    errors of a section's ``__post_init__`` name it."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{path or 'config'} must be an object, got {type(data).__name__}")
    data = {k: v for k, v in data.items() if not str(k).startswith("_")}  # "_comment" keys
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{path}." if path else ""
        raise ValueError(
            f"unknown config key(s) {[where + k for k in unknown]}; known in {path or 'the top level'}: {sorted(names)}"
        )
    kwargs = {k: _convert(hints[k], v, f"{path}.{k}" if path else k) for k, v in data.items()}
    try:
        return cls(**kwargs)  # the dataclass's __post_init__ validates
    except ValueError as e:
        message = str(e)
        if not path or message.startswith((f"{path}.", f"{path}:", f"{path}=")):
            raise
        raise ValueError(f"{path}: {message}") from None  # a reused section's message names its own fields


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(options[0], value, path) if len(options) == 1 else value
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}={value!r} must be a list")
        return tuple(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def merge(base: Mapping[str, Any], update: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """Deep merge of two config dicts; sections merge, leaves are replaced."""
    out = dict(base)
    for key, value in update.items():
        where = f"{path}.{key}" if path else key
        if isinstance(out.get(key), Mapping) and isinstance(value, Mapping) and key not in ("code",):
            out[key] = merge(out[key], value, where)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"rl.lr=3e-4"`` -> (["rl", "lr"], 0.0003); the value is JSON when it parses, else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {text!r} must look like section.key=value")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return [part for part in key.strip().split(".")], value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    out = json.loads(json.dumps(data))  # deep copy of a JSON tree
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for i, key in enumerate(keys[:-1]):
            if not isinstance(node.get(key), dict):
                raise ValueError(f"override {text!r}: {'.'.join(keys[: i + 1])} is not a config section")
            node = node[key]
        node[keys[-1]] = value
    return out


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any], path: str = "") -> list[str]:
    """Dotted paths whose values differ between two config dicts."""
    out = []
    for key in sorted(set(old) | set(new)):
        where = f"{path}.{key}" if path else key
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_differences(a, b, where)
        elif a != b:
            out.append(where)
    return out
