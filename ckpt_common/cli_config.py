"""Command-line flags generated from a frozen config dataclass, and the dataclass built back from them.

A config's fields, defaults and help live once, in the dataclass; its checks live once, in its
``__post_init__``. An entry point adds the fields as flags and builds the config from the parsed
namespace; argparse never restates a default::

    @dataclass(frozen=True)                        add_config_args(parser, LaunchConfig)
    class LaunchConfig:                  ──────▶     --port PORT          int, default 8000, help from metadata
        port: int = field(default=8000,              --weight-cache / --no-weight-cache
            metadata={"help": "..."})                --reload-impl {auto,direct,vllm}
        weight_cache: bool = True                    --bucket-size-bytes N (int | None: default None)
        reload_impl: Literal[...] = "auto"           --levels N [N ...]    (tuple[int, ...])
        update: UpdateConfig = ...                   --update-timeout-s T  (nested dataclass, prefixed)

    parser.parse_args() ──▶ ConfigArgs.build(args, parser) ──▶ LaunchConfig(...) ──▶ __post_init__ checks
                                                    ValueError ──▶ parser.error(message + the flag): exit 2

Field types: ``bool`` (``--x/--no-x``), ``int``, ``float``, ``str``, ``Literal[...]`` (choices), ``X | None``
(default None; for int/float fields the word ``none`` gives None), tuples and lists of those (``nargs``),
nested dataclasses (flags prefixed with the field's name unless listed in ``flatten``). Field metadata
``help`` is the flag's help (the default is appended), ``choices`` restricts a ``str`` field to a
constant kept elsewhere, ``metavar`` names the value. Fields of other types must be excluded (a
TypeError names them). Pure: argparse and dataclasses only, so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any, Literal

_SCALARS = (int, float, str)


def meta(text: str = "", **extra: Any) -> dict[str, Any]:
    """A field's metadata for its flag: ``field(default=8000, metadata=meta("public port"))``;
    ``extra``: ``choices=...``, ``metavar=...``."""
    return {"help": text, **extra}


@dataclasses.dataclass(frozen=True)
class ConfigFlag:
    """One generated flag: the field it sets (names from the top dataclass down) and its argparse dest."""

    path: tuple[str, ...]
    dest: str
    flag: str
    container: type | None  # tuple or list: argparse hands lists back, the field wants this type


@dataclasses.dataclass(frozen=True)
class ConfigArgs:
    """The flags ``add_config_args`` added for ``cls``; ``build`` turns parsed arguments into a ``cls``."""

    cls: type
    flags: tuple[ConfigFlag, ...]

    def flag_for(self, field_path: str) -> str:
        """The flag of a field (``"update.timeout_s"`` for a nested one); KeyError if it has none."""
        for f in self.flags:
            if ".".join(f.path) == field_path:
                return f.flag
        raise KeyError(f"{self.cls.__name__} has no flag for field {field_path!r}")

    def build(self, args: argparse.Namespace, parser: argparse.ArgumentParser | None = None, **fixed: Any) -> Any:
        """``cls`` from the parsed ``args``; ``fixed`` sets top-level fields that have no flag.

        Fields without a flag and not in ``fixed`` keep the dataclass's default. A ValueError from the
        dataclass's checks goes to ``parser.error`` (exit 2, the message plus the flag it names) when a
        parser is given, else it propagates.
        """
        values = {}
        for f in self.flags:
            value = getattr(args, f.dest)
            if f.container is not None and value is not None:
                value = f.container(value)
            values[f.path] = value
        try:
            return _construct(self.cls, None, (), values, fixed)
        except ValueError as e:
            if parser is None:
                raise
            parser.error(self._explain(str(e)))

    def _explain(self, message: str) -> str:
        """The message, followed by the flags of the fields it names (e.g. "... (flag: --port)")."""
        named = [f.flag for f in self.flags if re.search(rf"(?<![\w-]){re.escape(f.path[-1])}(?![\w-])", message)]
        return f"{message} (flag: {', '.join(named)})" if named else message


def add_config_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    prefix: str = "",
    exclude: Collection[str] = (),
    only: Collection[str] | None = None,
    rename: Mapping[str, str] | None = None,
    flatten: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> ConfigArgs:
    """Add a flag per field of dataclass ``cls`` to ``parser`` (or an argument group).

    ``prefix`` goes before every flag and dest (``prefix="engine-"``: ``--engine-max-model-len``).
    ``exclude`` / ``only`` / ``rename`` / ``flatten`` name fields by dotted path (``"update.timeout_s"``);
    excluding a nested dataclass excludes its fields. ``rename`` maps a field to its flag name without
    the dashes (kebab case). ``defaults`` gives a field another default in this command (the built
    config gets it when the flag is not given). A field without a default becomes a required flag.
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"add_config_args needs a dataclass type, got {cls!r}")
    rename, defaults = dict(rename or {}), dict(defaults or {})
    names = _field_paths(cls, ())
    unknown = sorted((set(exclude) | set(rename) | set(flatten) | set(only or ()) | set(defaults)) - names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; its fields: {sorted(names)}")
    flags: list[ConfigFlag] = []
    _add_fields(parser, cls, None, (), prefix, set(exclude), only, rename, set(flatten), defaults, flags)
    return ConfigArgs(cls, tuple(flags))


def _type_hints(cls: type) -> dict[str, Any]:
    """The dataclass's resolved field types. A module run by ``runpy`` (``python -m``, tests) is not the
    ``sys.modules`` entry its class names, so its annotations are resolved again in the namespace of
    the class's own functions (``__post_init__``, properties) when the first try cannot find a name."""
    try:
        return typing.get_type_hints(cls)
    except NameError:
        namespace: dict[str, Any] = {}
        for obj in vars(cls).values():
            namespace.update(getattr(getattr(obj, "fget", obj), "__globals__", {}))
        return typing.get_type_hints(cls, localns=namespace)


def _field_paths(cls: type, path: tuple[str, ...]) -> set[str]:
    hints = _type_hints(cls)
    out = set()
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        out.add(".".join((*path, f.name)))
        if dataclasses.is_dataclass(hints[f.name]):
            out |= _field_paths(hints[f.name], (*path, f.name))
    return out


def _included(dotted: str, only: Collection[str] | None) -> bool:
    """Whether a field is covered by ``only`` (itself, one of its parents, or one of its nested fields)."""
    if only is None:
        return True
    return any(dotted == o or dotted.startswith(o + ".") or o.startswith(dotted + ".") for o in only)


def _add_fields(parser, cls, instance, path, prefix, exclude, only, rename, flatten, defaults, flags) -> None:
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = ".".join((*path, f.name))
        if not f.init or dotted in exclude or not _included(dotted, only):
            continue
        hint = hints[f.name]
        default = defaults.get(dotted, _default_of(f, instance))
        if dataclasses.is_dataclass(hint):
            if default is dataclasses.MISSING:
                default = hint()
            inner_prefix = prefix if dotted in flatten else f"{prefix}{_kebab(rename.get(dotted, f.name))}-"
            inner_path = (*path, f.name)
            _add_fields(
                parser, hint, default, inner_path, inner_prefix, exclude, only, rename, flatten, defaults, flags
            )
            continue
        name = f"{prefix}{_kebab(rename.get(dotted, f.name))}"
        dest = name.replace("-", "_")
        kwargs, container = _argparse_kwargs(f"{cls.__name__}.{f.name}", hint, default, f.metadata)
        kwargs["dest"] = dest
        parser.add_argument(f"--{name}", **kwargs)
        flags.append(ConfigFlag((*path, f.name), dest, f"--{name}", container))


def _default_of(f: dataclasses.Field, instance: Any) -> Any:
    """The field's default: from the enclosing default instance (nested), else the dataclass's own."""
    if instance is not None:
        return getattr(instance, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _strip_optional(hint: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None`` / ``Optional[X]``, else (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


def _scalar(where: str, hint: Any) -> tuple[Any, list | None]:
    """(argparse type, choices) of a scalar type: int, float, str or a Literal of one of them."""
    if hint in _SCALARS:
        return hint, None
    if typing.get_origin(hint) is Literal:
        values = list(typing.get_args(hint))
        kinds = {type(v) for v in values}
        if len(kinds) == 1 and kinds <= set(_SCALARS):
            return kinds.pop(), values
    raise TypeError(f"{where}: no flag for type {hint!r}; exclude the field or add its flag by hand")


def _or_none(conv: Any) -> Any:
    """``conv``, except that the word "none" gives None (an int/float field whose None means something)."""

    def parse(text: str) -> Any:
        return None if text.strip().lower() == "none" else conv(text)

    parse.__name__ = conv.__name__  # argparse names the type in its "invalid int value" message
    return parse


def _show(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(str(v) for v in value) if value else "(none)"
    return repr(value) if isinstance(value, str) else str(value)


def _argparse_kwargs(where: str, hint: Any, default: Any, metadata: Mapping) -> tuple[dict, type | None]:
    """add_argument keyword arguments for a field, and the container type of a sequence field."""
    text = str(metadata.get("help", "")).replace("%", "%%")
    inner, optional = _strip_optional(hint)
    kwargs: dict[str, Any] = {}
    container = None
    if default is dataclasses.MISSING:
        kwargs["required"] = True
        suffix = "(required)"
    else:
        kwargs["default"] = default
        suffix = f"(default: {_show(default).replace('%', '%%')})"
    if inner is bool and not optional:
        kwargs["action"] = argparse.BooleanOptionalAction
        suffix = "(default: %(default)s)" if default is not dataclasses.MISSING else suffix
    elif typing.get_origin(inner) in (tuple, list):
        container = typing.get_origin(inner)
        args = typing.get_args(inner)
        if container is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(set(args)) != 1:
                raise TypeError(f"{where}: no flag for the mixed tuple type {hint!r}")
            kwargs["nargs"] = len(args)
        else:
            kwargs["nargs"] = "*" if default is not dataclasses.MISSING and default == container() else "+"
        kwargs["type"], kwargs["choices"] = _scalar(where, args[0])
    else:
        conv, kwargs["choices"] = _scalar(where, inner)
        kwargs["type"] = _or_none(conv) if optional and conv in (int, float) else conv
        if optional and conv in (int, float) and default not in (None, dataclasses.MISSING):
            suffix = suffix[:-1] + "; 'none' for None)"
    if "choices" in metadata:
        kwargs["choices"] = list(metadata["choices"])
    if kwargs.get("choices") is None:
        kwargs.pop("choices", None)
    if "metavar" in metadata:
        kwargs["metavar"] = metadata["metavar"]
    kwargs["help"] = f"{text} {suffix}".strip()
    return kwargs, container


def _construct(cls: type, instance: Any, path: tuple[str, ...], values: dict, fixed: Mapping[str, Any]) -> Any:
    """``cls`` from the flag values under ``path``; nested dataclasses start from their default instance."""
    hints = _type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        here = (*path, f.name)
        if here in values:
            kwargs[f.name] = values[here]
        elif dataclasses.is_dataclass(hints[f.name]) and any(p[: len(here)] == here for p in values):
            inner = getattr(instance, f.name) if instance is not None else _default_of(f, None)
            inner = hints[f.name]() if inner is dataclasses.MISSING else inner
            kwargs[f.name] = _construct(hints[f.name], inner, here, values, {})
    kwargs.update(fixed)
    return dataclasses.replace(instance, **kwargs) if instance is not None else cls(**kwargs)
