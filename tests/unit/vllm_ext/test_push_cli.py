"""`ckpt-vllm-push` (`python -m vllm_ext.push`): its flags are generated from `PushConfig`; the flags
users pass keep their names, choices and defaults (`--engine-url` repeats, one per engine); a bad value
exits 2 naming the flag (no argparse call restates a default: tests/unit/test_cli_no_defaults.py)."""

from __future__ import annotations

import argparse

import pytest

from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
from vllm_ext.push import PushConfig, _parser

# flag -> (default, choices, required)
FLAGS = {
    "--model": (None, None, True),
    "--engine-url": (None, None, True),
    "--rank": (None, None, False),
    "--world-size": (None, None, False),
    "--master-port": (None, None, False),
    "--checkpoint-name": (None, None, False),
    "--bucket-size-bytes": (UpdateConfig().bucket_size_bytes, None, False),
    "--timeout-s": (300.0, None, False),
    "--transport": (ParameterServerConfig().transport, ["auto", "cpu", "cuda"], False),
    "--p2p-reader": (None, ["rank", "engine"], False),
    "--delta-base": (None, None, False),
    "--delta-base-name": (None, None, False),
    "--delta-tp-size": (None, None, False),
}


def _actions() -> dict[str, argparse.Action]:
    parser, _ = _parser()
    return {opt: a for a in parser._actions for opt in a.option_strings if opt.startswith("--") and opt != "--help"}


def test_the_parser_offers_every_flag_with_its_default_and_choices():
    actions = _actions()
    assert set(actions) == set(FLAGS)
    for flag, (default, choices, required) in FLAGS.items():
        a = actions[flag]
        assert (a.default, list(a.choices) if a.choices else None, a.required) == (default, choices, required), flag
    assert isinstance(actions["--engine-url"], argparse._AppendAction)


def test_the_flags_build_the_config_and_engine_urls_keep_their_order():
    parser, spec = _parser()
    args = parser.parse_args(["--model", "m", "--engine-url", "http://a", "--engine-url", "http://b"])
    cfg = spec.build(args, parser, engine_urls=tuple(args.engine_url))
    assert cfg == PushConfig(model="m", engine_urls=("http://a", "http://b"))
    argv = ["--model", "m", "--engine-url", "u", "--rank", "1", "--world-size", "2", "--master-port", "9"]
    argv += ["--checkpoint-name", "c", "--bucket-size-bytes", "4096", "--timeout-s", "5", "--transport", "cpu"]
    args = parser.parse_args(argv)
    cfg = spec.build(args, parser, engine_urls=tuple(args.engine_url))
    assert cfg == PushConfig("m", ("u",), 1, 2, 9, "c", 4096, 5.0, "cpu")
    assert cfg.layout({}) == (1, 2, 2)
    args = parser.parse_args(["--model", "m", "--engine-url", "u", "--p2p-reader", "engine"])
    assert spec.build(args, parser, engine_urls=("u",)).p2p_reader == "engine"
    args = parser.parse_args(["--model", "m", "--engine-url", "u", "--delta-base", "b", "--delta-tp-size", "2"])
    cfg = spec.build(args, parser, engine_urls=("u",))
    assert (cfg.delta_base, cfg.delta_base_name, cfg.delta_tp_size) == ("b", None, 2)


def test_delta_flags_need_a_base_and_a_positive_tp_size():
    with pytest.raises(ValueError, match="need delta_base"):
        PushConfig(model="m", engine_urls=("u",), delta_tp_size=2)
    with pytest.raises(ValueError, match="delta_tp_size"):
        PushConfig(model="m", engine_urls=("u",), delta_base="b", delta_tp_size=0)


def test_rank_and_world_come_from_torchrun_when_not_given():
    cfg = PushConfig(model="m", engine_urls=("a", "b"))
    assert cfg.layout({"RANK": "3", "WORLD_SIZE": "4"}) == (3, 4, 2)
    assert PushConfig(model="m", engine_urls=("a",)).layout({}) == (0, 1, 1)
    with pytest.raises(ValueError, match="not a multiple of the 2 engine URLs"):
        cfg.layout({"WORLD_SIZE": "3"})
    with pytest.raises(ValueError, match="outside the world"):
        cfg.layout({"RANK": "2", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--engine-url", "u"], "--model"),
        (["--model", "m"], "--engine-url"),
        (["--model", "m", "--engine-url", ""], "--engine-url"),
        (["--model", "m", "--engine-url", "u", "--timeout-s", "0"], "--timeout-s"),
        (["--model", "m", "--engine-url", "u", "--rank", "-1"], "--rank"),
        (["--model", "m", "--engine-url", "u", "--world-size", "0"], "--world-size"),
        (["--model", "m", "--engine-url", "u", "--bucket-size-bytes", "0"], "--bucket-size-bytes"),
        (["--model", "m", "--engine-url", "u", "--transport", "tpu"], "--transport"),
        (["--model", "m", "--engine-url", "u", "--engine-url", "v", "--world-size", "3"], "--world-size"),
    ],
)
def test_a_bad_value_exits_2_naming_its_flag(argv, flag, capsys):
    from vllm_ext.push import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err, err
