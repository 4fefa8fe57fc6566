"""The daemon's command line (`torchrun -m checkpoint_engine`) is generated from `DaemonConfig`: the flags
users' scripts, docs and manifests pass keep their names, choices and defaults; a shared knob's default
is its owning config's; a bad value exits 2 naming the flag (no argparse call restates a default:
tests/unit/test_cli_no_defaults.py)."""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

import pytest

from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
from checkpoint_engine.daemon.config import DaemonConfig, engine_flags
from checkpoint_engine.engines.config import EngineConfig
from checkpoint_engine.transport.mooncake import P2PConfig

REPO = pathlib.Path(__file__).resolve().parents[3]

# every flag of the daemon, its default and its choices (None: free value), as users rely on them
FLAGS = {
    "--host": ("127.0.0.1", None),
    "--port": (8400, None),
    "--uds": (None, None),
    "--token-file": (None, None),
    "--tls-cert-file": (None, None),
    "--tls-key-file": (None, None),
    "--transport": ("auto", ["auto", "cpu", "cuda"]),
    "--bucket-size-mib": (None, None),
    "--mode": ("auto", ["auto", "collective", "local", "relay"]),
    "--collective-timeout-s": (300.0, None),
    "--metrics-jsonl": (None, None),
    "--progress": (False, None),
    "--metadata-url": (None, None),
    "--p2p-host": (None, None),
    "--p2p-protocol": ("tcp", ["tcp", "rdma"]),
    "--p2p-device": ("", None),
    "--p2p-cpus": (None, None),
    "--p2p-reader": ("rank", ["rank", "engine"]),
    "--keep-relayed": (True, None),
    "--engine-cmd": (None, None),
    "--auto-heal": (True, None),
    "--engine-url-host": (None, None),
    "--engine-health-path": ("/health", None),
    "--engine-update-route": ("auto", ["auto", "native", "extension"]),
    "--ranks-per-engine": (1, None),
    "--engine-start-timeout-s": (300.0, None),
    "--engine-log-dir": (None, None),
    "--stop-timeout-s": (20.0, None),
    "--log-level": ("INFO", None),
}

# flags whose default is defined by another config: the daemon's default is that config's
SHARED = {
    "--transport": ParameterServerConfig().transport,
    "--collective-timeout-s": ParameterServerConfig().collective_timeout_s,
    "--metadata-url": ParameterServerConfig().metadata_url,
    "--mode": UpdateConfig().mode,
    "--metrics-jsonl": UpdateConfig().metrics_path,
    "--progress": UpdateConfig().progress,
    "--p2p-reader": UpdateConfig().p2p_reader,
    "--keep-relayed": UpdateConfig().keep_relayed,
    "--p2p-protocol": P2PConfig().protocol,
    "--p2p-device": P2PConfig().device_name,
    "--auto-heal": EngineConfig(cmd=("e", "{port}")).auto_heal,
    "--engine-url-host": EngineConfig(cmd=("e", "{port}")).url_host,
    "--engine-health-path": EngineConfig(cmd=("e", "{port}")).health_path,
    "--engine-update-route": EngineConfig(cmd=("e", "{port}")).update_route,
    "--ranks-per-engine": EngineConfig(cmd=("e", "{port}")).ranks_per_engine,
    "--engine-start-timeout-s": EngineConfig(cmd=("e", "{port}")).start_timeout_s,
    "--engine-log-dir": EngineConfig(cmd=("e", "{port}")).log_dir,
}


def _actions() -> dict[str, argparse.Action]:
    from checkpoint_engine.__main__ import _parser

    parser, _ = _parser()
    return {opt: a for a in parser._actions for opt in a.option_strings if opt.startswith("--") and opt != "--help"}


def test_the_parser_offers_every_flag_with_its_default_and_choices():
    actions = _actions()
    assert set(actions) == set(FLAGS) | {"--no-auto-heal", "--no-progress", "--no-keep-relayed"}
    for flag, (default, choices) in FLAGS.items():
        assert actions[flag].default == default, flag
        assert (list(actions[flag].choices) if actions[flag].choices else None) == choices, flag
    assert isinstance(actions["--auto-heal"], argparse.BooleanOptionalAction)
    assert actions["--token-file"].metavar == "PATH"


@pytest.mark.parametrize("flag", sorted(SHARED))
def test_a_shared_knob_defaults_to_its_owning_config(flag):
    assert _actions()[flag].default == SHARED[flag]


def test_the_defaults_build_the_parameter_server_s_default_config(monkeypatch):
    from checkpoint_engine.__main__ import parse_args

    monkeypatch.delenv("CKPT_ENGINE_TOKEN", raising=False)
    args = parse_args([])
    assert args.config == DaemonConfig() and args.engine_config is None and args.token is None
    assert args.config.ps_config() == ParameterServerConfig()
    cmd = "e --port {port}"
    assert parse_args(["--engine-cmd", cmd]).engine_config == EngineConfig(cmd=("e", "--port", "{port}"))


def test_every_flag_reaches_the_configs_it_sets(monkeypatch, tmp_path):
    from checkpoint_engine.__main__ import parse_args

    monkeypatch.delenv("CKPT_ENGINE_TOKEN", raising=False)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    argv = ["--host", "0.0.0.0", "--port", "9000", "--token-file", str(token), "--transport", "cpu"]
    argv += ["--bucket-size-mib", "4", "--mode", "local", "--collective-timeout-s", "30", "--metrics-jsonl", "m.jsonl"]
    argv += ["--progress", "--metadata-url", "etcd://h:1/p", "--p2p-host", "10.0.0.2", "--p2p-protocol", "rdma"]
    argv += ["--p2p-device", "mlx5_0", "--p2p-cpus", "0-1", "--p2p-reader", "engine", "--no-keep-relayed"]
    argv += ["--engine-cmd", '["e", "--port", "{port}"]', "--no-auto-heal", "--engine-url-host", "10.0.0.3"]
    argv += ["--engine-health-path", "/up", "--engine-start-timeout-s", "9", "--engine-log-dir", "logs"]
    argv += ["--stop-timeout-s", "5", "--log-level", "debug", "--ranks-per-engine", "2"]
    args = parse_args(argv)
    cfg = args.config
    assert (cfg.host, cfg.port, cfg.uds, cfg.stop_timeout_s, cfg.log_level) == ("0.0.0.0", 9000, None, 5.0, "debug")
    assert args.token == "s3cret" and args.p2p_cpu_list == (0, 1)
    assert cfg.ps_config(args.p2p_cpu_list) == ParameterServerConfig(
        transport="cpu",
        collective_timeout_s=30.0,
        metadata_url="etcd://h:1/p",
        p2p=P2PConfig("10.0.0.2", "rdma", "mlx5_0", cpus=(0, 1)),
        update=UpdateConfig(
            bucket_size_bytes=4 * 2**20,
            mode="local",
            p2p_reader="engine",
            keep_relayed=False,
            metrics_path="m.jsonl",
            progress=True,
        ),
    )
    assert args.engine_config == EngineConfig(
        cmd=("e", "--port", "{port}"),
        health_path="/up",
        url_host="10.0.0.3",
        start_timeout_s=9.0,
        auto_heal=False,
        log_dir="logs",
        update_timeout_s=30.0,
        p2p_host="10.0.0.2",
        ranks_per_engine=2,
    )


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--port", "x"], "--port"),
        (["--port", "70000"], "--port"),
        (["--mode", "fast"], "--mode"),
        (["--transport", "tpu"], "--transport"),
        (["--stop-timeout-s", "0"], "--stop-timeout-s"),
        (["--collective-timeout-s", "-1"], "--collective-timeout-s"),
        (["--engine-start-timeout-s", "0"], "--engine-start-timeout-s"),
        (["--bucket-size-mib", "0"], "--bucket-size-mib"),
        (["--log-level", "loud"], "--log-level"),
        (["--p2p-cpus", "0"], "--p2p-cpus"),
        (["--p2p-host", "10.0.0.2", "--p2p-cpus", "0-x"], "--p2p-cpus"),
        (["--engine-cmd", "e"], "--engine-cmd"),
        (["--engine-cmd", "e {port}", "--engine-health-path", "up"], "--engine-health-path"),
        (["--engine-cmd", "e {port}", "--engine-url-host", "http://a"], "--engine-url-host"),
        (["--token-file", "/nonexistent/token"], "--token-file"),
        (["--ranks-per-engine", "2"], "--ranks-per-engine"),
        (["--engine-cmd", "e {port}", "--ranks-per-engine", "0"], "--ranks-per-engine"),
        (["--engine-cmd", "e {port} {rendezvous}", "--ranks-per-engine", "2"], "--ranks-per-engine"),
    ],
)
def test_a_bad_value_exits_2_naming_its_flag(argv, flag, capsys, monkeypatch):
    from checkpoint_engine.__main__ import parse_args

    monkeypatch.delenv("CKPT_ENGINE_TOKEN", raising=False)
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err, err


def test_engine_errors_name_the_daemon_flags():
    assert engine_flags("EngineConfig.url_host='a/b' must be a host name") == ["--engine-url-host"]
    assert engine_flags("EngineConfig.start_timeout_s=0 must be a number > 0") == ["--engine-start-timeout-s"]
    assert engine_flags("--engine-cmd must be a non-empty command template") == ["--engine-cmd"]


def test_help_is_instant_and_the_docstring_is_its_description():
    import checkpoint_engine.__main__ as entry

    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "checkpoint_engine", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert entry.__doc__.splitlines()[0] in out.stdout and "--no-auto-heal" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "numpy", "aiohttp", "zmq"}, sorted(imported & {"torch", "numpy", "aiohttp", "zmq"})


def test_tls_files_go_together_and_must_exist(tmp_path):
    from checkpoint_engine.daemon.config import DaemonConfig

    f = tmp_path / "x.pem"
    f.write_text("x")
    with pytest.raises(ValueError, match="go together"):
        DaemonConfig(tls_cert_file=str(f))
    with pytest.raises(ValueError, match="not a readable file"):
        DaemonConfig(tls_cert_file=str(f), tls_key_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="unix socket"):
        DaemonConfig(tls_cert_file=str(f), tls_key_file=str(f), uds=str(tmp_path / "s"))


def test_a_store_off_loopback_needs_a_token(monkeypatch, capsys):
    from checkpoint_engine.__main__ import parse_args

    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.delenv("CKPT_ENGINE_TOKEN", raising=False)
    with pytest.raises(SystemExit) as e:
        parse_args([])
    assert e.value.code == 2 and "MASTER_ADDR=10.1.2.3" in capsys.readouterr().err
    monkeypatch.setenv("CKPT_ENGINE_TOKEN", "t")
    assert parse_args([]).token == "t"
