"""ckpt_common.cli_config: flags generated from config dataclasses and the configs built back."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from ckpt_common.cli_config import add_config_args

REPO = Path(__file__).resolve().parents[3]


@dataclasses.dataclass(frozen=True)
class Inner:
    timeout_s: float = 5.0
    retries: int = 2

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"inner.timeout_s={self.timeout_s!r} must be > 0")


@dataclasses.dataclass(frozen=True)
class Sample:
    name: str
    port: int = dataclasses.field(default=8000, metadata={"help": "public port"})
    ratio: float = 0.5
    label: str = "x"
    enabled: bool = True
    verbose: bool = False
    mode: Literal["fast", "slow"] = dataclasses.field(default="fast", metadata={"help": "how to run"})
    size: int | None = None
    threads: int | None = 1
    tag: str | None = None
    levels: tuple[int, ...] = (1, 2)
    weights: tuple[float, ...] | None = None
    extra: tuple[str, ...] = ()
    pair: tuple[int, int] = (3, 4)
    style: str = dataclasses.field(default="short", metadata={"choices": ("short", "long")})
    inner: Inner = dataclasses.field(default_factory=lambda: Inner(retries=3))

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port!r}")


def _parse(argv, **kwargs):
    parser = argparse.ArgumentParser(prog="t")
    spec = add_config_args(parser, Sample, **kwargs)
    return parser, spec, spec.build(parser.parse_args(argv), parser)


def test_defaults_equal_the_dataclass():
    _, _, cfg = _parse(["--name", "a"])
    assert cfg == Sample(name="a")
    assert cfg.inner == Inner(retries=3)  # a nested default_factory instance, not Inner()


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--port", "9"], "port", 9),
        (["--ratio", "0.25"], "ratio", 0.25),
        (["--label", "y z"], "label", "y z"),
        (["--no-enabled"], "enabled", False),
        (["--verbose"], "verbose", True),
        (["--mode", "slow"], "mode", "slow"),
        (["--size", "7"], "size", 7),
        (["--threads", "none"], "threads", None),
        (["--tag", "t"], "tag", "t"),
        (["--levels", "3", "4", "5"], "levels", (3, 4, 5)),
        (["--weights", "0.5", "1"], "weights", (0.5, 1.0)),
        (["--extra", "a", "b"], "extra", ("a", "b")),
        (["--extra"], "extra", ()),
        (["--pair", "1", "2"], "pair", (1, 2)),
        (["--style", "long"], "style", "long"),
        (["--inner-timeout-s", "1.5"], "inner", Inner(timeout_s=1.5, retries=3)),
    ],
)
def test_each_type(argv, field, value):
    _, _, cfg = _parse(["--name", "a", *argv])
    assert getattr(cfg, field) == value
    assert type(getattr(cfg, field)) is type(value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "medium"], "invalid choice"),
        (["--style", "mid"], "invalid choice"),
        (["--port", "x"], "invalid int value"),
        (["--pair", "1"], "expected 2 arguments"),
        ([], "required: --name"),
    ],
)
def test_argparse_rejects(argv, message, capsys):
    parser = argparse.ArgumentParser(prog="t")
    add_config_args(parser, Sample)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv if not argv or argv[0] == "--name" else ["--name", "a", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "0"], "port must be in 1..65535, got 0 (flag: --port)"),
        (["--inner-timeout-s", "-1"], "inner.timeout_s=-1.0 must be > 0 (flag: --inner-timeout-s)"),
    ],
)
def test_invalid_value_is_reported_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["--name", "a", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_without_a_parser_the_value_error_propagates():
    parser = argparse.ArgumentParser()
    spec = add_config_args(parser, Sample)
    with pytest.raises(ValueError, match="port must be"):
        spec.build(parser.parse_args(["--name", "a", "--port", "0"]))


def test_help_lists_every_field_with_its_default():
    parser = argparse.ArgumentParser(prog="t")
    spec = add_config_args(parser, Sample)
    text = parser.format_help()
    fields = [f.name for f in dataclasses.fields(Sample) if f.name != "inner"] + ["inner-timeout-s", "inner-retries"]
    for name in fields:
        assert f"--{name.replace('_', '-')}" in text, name
    assert "--no-enabled" in text
    assert "public port (default: 8000)" in text
    assert "how to run (default: 'fast')" in text
    assert "(default: 1 2)" in text
    assert len(spec.flags) == len(fields)


def test_exclude_only_rename_prefix_flatten_and_fixed():
    parser = argparse.ArgumentParser()
    spec = add_config_args(
        parser,
        Sample,
        prefix="s-",
        exclude=("extra", "inner.retries"),
        rename={"enabled": "on", "inner": "in"},
    )
    text = parser.format_help()
    assert "--s-extra" not in text and "--s-in-retries" not in text and "--s-in-timeout-s" in text
    assert spec.flag_for("enabled") == "--s-on"
    cfg = spec.build(parser.parse_args(["--s-name", "a", "--no-s-on", "--s-in-timeout-s", "2"]), extra=("z",))
    assert (cfg.enabled, cfg.extra, cfg.inner) == (False, ("z",), Inner(timeout_s=2.0, retries=3))

    parser = argparse.ArgumentParser()
    spec = add_config_args(parser, Sample, only=("port",), defaults={"port": 9000})
    assert spec.build(parser.parse_args([]), name="c") == Sample(name="c", port=9000)
    assert "(default: 9000)" in parser.format_help()

    parser = argparse.ArgumentParser()
    spec = add_config_args(parser, Sample, only=("port", "inner.retries"), flatten=("inner",))
    assert [f.flag for f in spec.flags] == ["--port", "--retries"]
    cfg = spec.build(parser.parse_args(["--retries", "9"]), name="b")
    assert cfg == Sample(name="b", inner=Inner(retries=9))


def test_mistakes_are_named():
    with pytest.raises(ValueError, match="no field"):
        add_config_args(argparse.ArgumentParser(), Sample, exclude=("nope",))

    @dataclasses.dataclass(frozen=True)
    class Bad:
        table: dict = dataclasses.field(default_factory=dict)

    with pytest.raises(TypeError, match="Bad.table"):
        add_config_args(argparse.ArgumentParser(), Bad)
    add_config_args(argparse.ArgumentParser(), Bad, exclude=("table",))


def test_import_is_light():
    code = (
        "import sys, ckpt_common.cli_config\n"
        "heavy = [m for m in ('torch', 'zmq', 'numpy') if m in sys.modules]\nassert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
