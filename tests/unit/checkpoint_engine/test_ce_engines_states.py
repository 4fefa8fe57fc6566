"""The managed engines' state table, the command template, and one engine process's lifecycle."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from checkpoint_engine.engines.config import EngineConfig, engine_env, parse_engine_cmd, render_cmd
from checkpoint_engine.engines.process import ManagedEngine
from checkpoint_engine.engines.states import STATES, TRANSITIONS, TransitionError, check_transition
from checkpoint_engine.transport.load_rendezvous import PullHint

ALLOWED = [
    ("stopped", "starting"),
    ("starting", "updating"),
    ("starting", "failed"),
    ("starting", "stopped"),
    ("updating", "serving"),
    ("updating", "incomplete"),
    ("updating", "failed"),
    ("updating", "stopped"),
    ("serving", "updating"),
    ("serving", "sleeping"),
    ("serving", "failed"),
    ("serving", "stopped"),
    ("sleeping", "serving"),  # level 1: its weights are back
    ("sleeping", "incomplete"),  # level 2: no weights until an update
    ("sleeping", "failed"),
    ("sleeping", "stopped"),
    ("incomplete", "updating"),
    ("incomplete", "failed"),
    ("incomplete", "stopped"),
    ("failed", "starting"),
    ("failed", "stopped"),
]


def test_the_table_is_exactly_the_allowed_list():
    assert set(TRANSITIONS) == set(STATES)
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == set(ALLOWED)


@pytest.mark.parametrize("old,new", ALLOWED)
def test_allowed(old, new):
    check_transition(old, new)


@pytest.mark.parametrize(
    "old,new",
    [(a, b) for a in STATES for b in STATES if (a, b) not in ALLOWED],
)
def test_illegal_transitions_name_both_states(old, new):
    with pytest.raises(TransitionError, match=f"illegal engine state transition {old} -> {new}"):
        check_transition(old, new)


def test_dummy_weights_are_never_served():
    assert "serving" not in TRANSITIONS["starting"]  # only through a complete update


@pytest.mark.parametrize("old,new", [("running", "stopped"), ("stopped", "gone")])
def test_unknown_states(old, new):
    with pytest.raises(TransitionError, match="unknown engine state"):
        check_transition(old, new)


@pytest.mark.parametrize(
    "text,argv",
    [
        ("python -m eng --port {port}", ("python", "-m", "eng", "--port", "{port}")),
        (
            '["python", "-m", "eng", "--port={port}", "--x", "a b"]',
            ("python", "-m", "eng", "--port={port}", "--x", "a b"),
        ),
        ("eng --port {port} --cfg '{\"a\": 1}'", ("eng", "--port", "{port}", "--cfg", '{"a": 1}')),
    ],
)
def test_parse_engine_cmd(text, argv):
    assert parse_engine_cmd(text) == argv


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "non-empty"),
        ("python -m eng", r"no \{port\} placeholder"),
        ('["python", 3]', "list of strings"),
        ('["python", ', "does not parse"),
    ],
)
def test_parse_engine_cmd_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_engine_cmd(text)


def test_render_cmd_fills_placeholders_and_leaves_other_braces():
    argv = render_cmd(("e", "--port={port}", "r{rank}", "{device}", '{"k": 1}'), port=9, rank=1, device="cuda:1")
    assert argv == ["e", "--port=9", "r1", "cuda:1", '{"k": 1}']


def test_render_cmd_fills_the_rendezvous_of_engines_that_load_from_the_ps():
    cmd = ("e", "--port", "{port}", "--load-rendezvous", "{rendezvous}")
    assert EngineConfig(cmd=cmd).loads_from_ps and not EngineConfig(cmd=cmd[:3]).loads_from_ps
    argv = render_cmd(cmd, port=9, rank=0, device="cpu", rendezvous="ipc:///tmp/d/load.sock")
    assert argv == ["e", "--port", "9", "--load-rendezvous", "ipc:///tmp/d/load.sock"]
    with pytest.raises(ValueError, match="has a {rendezvous} placeholder: give its address"):
        render_cmd(cmd, port=9, rank=0, device="cpu")


def test_render_cmd_fills_the_daemons_p2p_host():
    cmd = ("e", "--port", "{port}", "--p2p-host", "{p2p_host}")
    assert render_cmd(cmd, port=9, rank=0, device="cpu", p2p_host="10.0.0.2")[-2:] == ["--p2p-host", "10.0.0.2"]
    with pytest.raises(ValueError, match="has a {p2p_host} placeholder: give the address"):
        render_cmd(cmd, port=9, rank=0, device="cpu")
    assert EngineConfig(cmd=cmd, p2p_host="10.0.0.2").p2p_host == "10.0.0.2"
    for missing in (None, ""):
        with pytest.raises(ValueError, match=r"has a \{p2p_host\} placeholder but p2p_host=.*--p2p-host ADDR"):
            EngineConfig(cmd=cmd, p2p_host=missing)


def test_the_daemon_fills_p2p_host_from_its_own_flag_and_refuses_the_placeholder_without_it(capsys):
    from checkpoint_engine.__main__ import parse_args

    cmd = "python -m vllm_ext.launch --load-rendezvous {rendezvous} --p2p-host {p2p_host} --port {port}"
    args = parse_args(["--p2p-host", "10.0.0.2", "--engine-cmd", cmd])
    assert args.engine_config.p2p_host == "10.0.0.2"
    assert parse_args(["--engine-cmd", "e --port {port}"]).engine_config.p2p_host is None
    with pytest.raises(SystemExit):
        parse_args(["--engine-cmd", cmd])
    assert "has a {p2p_host} placeholder" in capsys.readouterr().err


def test_a_managed_engine_starts_with_the_daemons_p2p_host(tmp_path):
    show = "import sys; print('ARGV', sys.argv[1:], flush=True)"
    config = EngineConfig(
        cmd=(sys.executable, "-c", show, "--p2p-host", "{p2p_host}", "{port}"),
        log_dir=str(tmp_path),
        p2p_host="10.9.8.7",
    )
    engine = ManagedEngine(0, config)
    engine.start()
    engine._proc.wait(30)
    log = pathlib.Path(engine.log_path).read_text()
    assert "ARGV ['--p2p-host', '10.9.8.7'," in log, log
    engine.stop()


def test_engine_env_drops_torchrun_variables():
    env = engine_env(
        {"RANK": "1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "PATH": "/bin", "OMP_NUM_THREADS": "1"}
    )
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize(
    "device,daemon_visible,engine_visible",
    [
        ("cpu", None, None),
        ("cpu", "2,3", "2,3"),
        ("cuda:1", None, "1"),
        ("cuda:0", "2,3", "2"),
        ("cuda:1", "2, 3", "3"),
    ],
)
def test_engine_env_gives_a_gpu_engine_its_rank_device(device, daemon_visible, engine_visible):
    environ = {"PATH": "/bin"} | ({"CUDA_VISIBLE_DEVICES": daemon_visible} if daemon_visible else {})
    assert engine_env(environ, device=device).get("CUDA_VISIBLE_DEVICES") == engine_visible


@pytest.mark.parametrize(
    "device,per,daemon_visible,engine_visible",
    [
        ("cpu", 2, None, None),
        ("cuda:0", 2, None, "0,1"),
        ("cuda:2", 2, "4,5,6,7", "6,7"),
        ("cuda:4", 4, None, "4,5,6,7"),
    ],
)
def test_a_tensor_parallel_engine_sees_its_group_s_gpus(device, per, daemon_visible, engine_visible):
    from checkpoint_engine.engines.config import group_device

    environ = {"PATH": "/bin"} | ({"CUDA_VISIBLE_DEVICES": daemon_visible} if daemon_visible else {})
    assert engine_env(environ, device=group_device(device, per)).get("CUDA_VISIBLE_DEVICES") == engine_visible


def test_render_cmd_fills_the_engine_s_tensor_parallel_size():
    cmd = ("e", "--port", "{port}", "--", "--tensor-parallel-size", "{ranks_per_engine}")
    assert render_cmd(cmd, port=9, rank=0, device="cpu", ranks_per_engine=2)[-1] == "2"
    assert render_cmd(cmd, port=9, rank=0, device="cpu")[-1] == "1"


@pytest.mark.parametrize(
    "world,per,rank,ranks,members,group,leads",
    [
        (4, 1, 2, [2], [2], [2], True),
        (4, 2, 0, None, [0, 1, 2, 3], [0, 1], True),
        (4, 2, 1, [3], [2, 3], [0, 1], False),  # any rank of a group selects its engine
        (4, 2, 3, [1, 2], [0, 1, 2, 3], [2, 3], False),
        (8, 4, 4, [5], [4, 5, 6, 7], [4, 5, 6, 7], True),
    ],
)
def test_engine_groups_select_whole_engines(tmp_path, world, per, rank, ranks, members, group, leads):
    from checkpoint_engine.engines.host import EngineHost

    published: list[dict] = []
    config = EngineConfig(cmd=("e", "{port}"), log_dir=str(tmp_path), ranks_per_engine=per)
    host = EngineHost(rank, world, config, device="cpu", publish=published.append, store=object())
    try:
        assert (host.members(ranks), host.group, host.leads) == (members, group, leads)
        assert host.runs(members) == leads
        # only the engine's first rank publishes it: one record per engine, naming its ranks
        assert [(r["rank"], r["ranks"]) for r in published] == ([(rank, group)] if leads else [])
    finally:
        host.close()


def test_engine_groups_must_divide_the_world(tmp_path):
    from checkpoint_engine.engines.host import EngineHost

    config = EngineConfig(cmd=("e", "{port}"), log_dir=str(tmp_path), ranks_per_engine=2)
    with pytest.raises(ValueError, match="ranks_per_engine=2 must divide the world size 3"):
        EngineHost(0, 3, config, device="cpu", publish=None, store=object())


def test_engine_env_refuses_a_device_outside_the_visible_list():
    with pytest.raises(ValueError, match="cuda:2 is not among CUDA_VISIBLE_DEVICES=0,1"):
        engine_env({"CUDA_VISIBLE_DEVICES": "0,1"}, device="cuda:2")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("health_path", "health", "must start with '/'"),
        ("start_timeout_s", 0, "start_timeout_s=0 must be a number > 0"),
        ("max_heal_attempts", -1, "max_heal_attempts=-1 must be an int >= 0"),
        ("url_host", "", "url_host='' must be a host name or IP address"),
        ("url_host", "http://10.0.0.1", "no scheme, port or path"),
        ("url_host", "10.0.0.1/x", "no scheme, port or path"),
        ("ranks_per_engine", 0, "ranks_per_engine=0 must be an int >= 1"),
    ],
)
def test_engine_config_checks(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(cmd=("e", "{port}"), **{field: value})


# -- one real process: a tiny HTTP server standing in for an engine -------------------------------
SERVER = (
    "import http.server, sys, signal\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers()\n"
    "    def log_message(self, *a): pass\n"
    "{trap}"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


def make_engine(tmp_path, *, trap: str = "", **cfg) -> tuple[ManagedEngine, list[dict]]:
    script = tmp_path / "server.py"
    script.write_text(SERVER.replace("{trap}", trap))
    published: list[dict] = []
    config = EngineConfig(cmd=(sys.executable, str(script), "{port}"), log_dir=str(tmp_path), **cfg)
    return ManagedEngine(0, config, publish=published.append), published


def test_lifecycle_of_one_process(tmp_path):
    engine, published = make_engine(tmp_path, start_timeout_s=30)
    engine.start()
    engine.wait_healthy()
    assert engine.state == "starting" and engine.healthy and engine.poll() is None
    engine.begin_update("v1")
    engine.end_update("v1", None)
    assert engine.record()["state"] == "serving" and engine.record()["checkpoint"] == "v1"
    engine.begin_update("v2")
    engine.end_update("v2", "ValueError: unknown checkpoint 'v2'", engine_untouched=True)
    assert engine.record()["state"] == "serving" and engine.record()["checkpoint"] == "v1"
    pid = engine.pid
    engine._proc.send_signal(signal.SIGKILL)
    engine._proc.wait(10)
    assert engine.check_alive() == -9 and engine.state == "failed" and engine.record()["exit_code"] == -9
    engine.start()  # a restart
    engine.wait_healthy()
    engine.begin_update("v1")
    engine.end_update("v1", "broken")
    rec = engine.record()
    assert rec["state"] == "incomplete" and rec["restarts"] == 1 and "broken" in rec["last_error"] and pid != rec["pid"]
    engine.stop()
    assert engine.state == "stopped" and engine.poll() is not None
    seq = [p["state"] for p in published]
    changes = [st for i, st in enumerate(seq) if i == 0 or st != seq[i - 1]]
    assert changes == [
        *("stopped", "starting", "updating", "serving", "updating", "serving", "failed"),
        *("starting", "updating", "incomplete", "stopped"),
    ]
    assert json.dumps(published)  # every record is JSON


@pytest.mark.parametrize("url_host,prefix", [("10.0.3.7", "http://10.0.3.7:"), ("fd00::7", "http://[fd00::7]:")])
def test_published_url_names_the_url_host_while_the_daemon_uses_its_own(tmp_path, url_host, prefix):
    engine, published = make_engine(tmp_path, start_timeout_s=30, url_host=url_host)
    try:
        engine.start()
        engine.wait_healthy()  # through 127.0.0.1, where the engine listens
        port = engine.url.rsplit(":", 1)[1]
        assert engine.url == f"http://127.0.0.1:{port}"
        assert engine.record()["url"] == published[-1]["url"] == f"{prefix}{port}"
    finally:
        engine.stop()
    assert engine.record()["url"] == f"{prefix}{port}"  # the last address, as before


def test_a_loading_engine_finds_what_it_will_pull_beside_its_rendezvous(tmp_path):
    """The engine starts with the owners' addresses and the version's tensors in its private folder
    (it connects and places them while it starts); a start without a pull leaves nothing there."""
    show = (
        "import os, sys; p = os.path.join(os.path.dirname(sys.argv[1][len('ipc://'):]), 'pull_hint.json'); "
        "print('HINT', open(p).read() if os.path.exists(p) else None, flush=True)"
    )
    config = EngineConfig(cmd=(sys.executable, "-c", show, "{rendezvous}", "{port}"), log_dir=str(tmp_path))
    engine = ManagedEngine(0, config)
    engine.load_hint = PullHint(
        peers=(("10.0.0.1:15001", 4096), ("10.0.0.3:15001", 8192)), tensors=(("w", "float32", (2, 3)),)
    )
    engine.start()
    engine._proc.wait(30)
    log = pathlib.Path(engine.log_path).read_text()
    line = next(x for x in log.splitlines() if x.startswith("HINT "))
    assert PullHint.from_json(json.loads(line[len("HINT ") :])) == engine.load_hint, log
    engine.stop()
    engine.load_hint = PullHint()
    engine.start()
    engine._proc.wait(30)
    assert pathlib.Path(engine.log_path).read_text().rstrip().endswith("HINT None")
    engine.stop()


def test_stop_kills_an_engine_that_ignores_sigterm(tmp_path):
    trap = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    engine, _ = make_engine(tmp_path, trap=trap, stop_grace_s=0.5, start_timeout_s=30)
    engine.start()
    engine.wait_healthy()
    t0 = time.monotonic()
    engine.stop()
    assert engine.poll() == -signal.SIGKILL and time.monotonic() - t0 < 5


def test_an_engine_that_exits_at_start_is_failed_with_its_log(tmp_path):
    config = EngineConfig(
        cmd=(sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)", "{port}"), log_dir=str(tmp_path)
    )
    engine = ManagedEngine(0, config)
    engine.start()
    with pytest.raises(RuntimeError, match="exited with code 3 before it was healthy.*bad flag"):
        engine.wait_healthy()
    assert engine.state == "failed" and engine.record()["exit_code"] == 3
    with pytest.raises(RuntimeError, match="cannot take an update; start it first"):
        engine.begin_update("v1")


def test_a_missing_binary_is_failed(tmp_path):
    engine = ManagedEngine(0, EngineConfig(cmd=("/nonexistent/engine", "{port}"), log_dir=str(tmp_path)))
    with pytest.raises(RuntimeError, match="cannot run '/nonexistent/engine'.*--engine-cmd"):
        engine.start()
    assert engine.state == "failed"


def test_health_deadline(tmp_path):
    config = EngineConfig(
        cmd=(sys.executable, "-c", "import time; time.sleep(60)", "{port}"), log_dir=str(tmp_path), start_timeout_s=0.5
    )
    engine = ManagedEngine(0, config)
    engine.start()
    with pytest.raises(RuntimeError, match=r"not healthy at http://127.0.0.1:\d+/health within 0.5 s"):
        engine.wait_healthy()
    assert engine.state == "failed" and engine.poll() is not None  # stopped, reaped


def test_ranks_agree_through_the_store_with_a_deadline(tmp_path):
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from checkpoint_engine.engines.host import EngineHost, _agree
    from tests.integration.dist.harness import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    config = EngineConfig(cmd=("e", "{port}"), log_dir=str(tmp_path))
    hosts = [
        EngineHost(r, 2, config, device="cpu", publish=None, store=dist.TCPStore("127.0.0.1", port, is_master=False))
        for r in range(2)
    ]
    try:
        out: dict[int, dict] = {}
        threads = [
            threading.Thread(target=lambda r=r: out.__setitem__(r, _agree(hosts[r], [None, "boom"][r], 10.0)))
            for r in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert out == {0: {1: "boom"}, 1: {1: "boom"}}
        # rank 1 never reports: rank 0 names it once the step's deadline passes
        t0 = time.monotonic()
        assert _agree(hosts[0], None, 0.5) == {1: "rank 1 did not report within 0.5 s"}
        assert time.monotonic() - t0 < 5
    finally:
        for h in hosts:
            h.close()
        del server


# the engine creates a named segment and (like vLLM's processes killed with SIGKILL) never removes it
LEAKY = (
    "from multiprocessing import resource_tracker, shared_memory\n"
    "seg = shared_memory.SharedMemory(create=True, size=4096)\n"
    "resource_tracker.unregister(seg._name, 'shared_memory')\n"
    "open(sys.argv[0] + '.seg', 'w').write(seg.name)\n"
)


def test_a_killed_engine_s_named_shared_memory_is_removed_at_its_restart(tmp_path):
    from pathlib import Path

    engine, _ = make_engine(tmp_path, trap=LEAKY, start_timeout_s=30)
    try:
        engine.start()
        engine.wait_healthy()
        seg = Path("/dev/shm") / (tmp_path / "server.py.seg").read_text()
        assert seg.exists() and engine._ledger.segments == {str(seg)}
        engine._proc.send_signal(signal.SIGKILL)
        engine._proc.wait(10)
        assert engine.check_alive() == -9 and seg.exists()  # left behind
        engine.start()  # the heal's restart
        assert not seg.exists()
        engine.wait_healthy()
        second = Path("/dev/shm") / (tmp_path / "server.py.seg").read_text()
        assert second != seg and second.exists()
        engine.stop()
        assert not second.exists()  # a stop removes what the engine did not
    finally:
        engine.stop()


def test_an_engine_stopped_before_it_was_healthy_leaves_no_named_shared_memory(tmp_path):
    """A stop during the start (an operation cancelled, the daemon shutting down) comes before
    wait_healthy() noted the group's segments: the stop notes them itself before it signals."""
    from pathlib import Path

    engine, _ = make_engine(tmp_path, trap=LEAKY, start_timeout_s=30)
    name_file = tmp_path / "server.py.seg"
    try:
        engine.start()
        deadline = time.monotonic() + 30
        while not name_file.exists() or not name_file.read_text():
            assert time.monotonic() < deadline and engine.poll() is None
            time.sleep(0.05)  # polling for the segment's name, bounded by the deadline
        seg = Path("/dev/shm") / name_file.read_text()
        assert seg.exists() and not engine.healthy and not engine._ledger.segments
        engine.stop()  # SIGTERM: the stand-in dies without removing its segment
        assert engine.poll() is not None and not seg.exists()
    finally:
        engine.stop()
        if name_file.exists():
            Path("/dev/shm", name_file.read_text()).unlink(missing_ok=True)


# a daemon rank in miniature: one managed engine, healthy, then it waits to be killed
HOLDER = (
    "import sys, time\n"
    "from checkpoint_engine.engines.config import EngineConfig\n"
    "from checkpoint_engine.engines.process import ManagedEngine\n"
    "cfg = EngineConfig(cmd=(sys.executable, sys.argv[1], '{port}'), log_dir=sys.argv[2],\n"
    "                   segment_ledger_dir=sys.argv[3], start_timeout_s=30)\n"
    "engine = ManagedEngine(0, cfg)\n"
    "engine.start(); engine.wait_healthy()\n"
    "print(engine.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def test_segments_of_an_engine_killed_with_its_daemon_are_removed_at_the_next_start(tmp_path):
    """SIGKILL the daemon and its engine's whole group at once: nothing of theirs can remove the
    engine's segment; the next engine start of any daemon sweeps it (segment_ledger)."""
    import os
    from pathlib import Path

    from checkpoint_engine.engines.process import _killpg

    script, ledgers = tmp_path / "server.py", tmp_path / "ledgers"
    script.write_text(SERVER.replace("{trap}", LEAKY))
    repo = Path(__file__).resolve().parents[3]
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(script), str(tmp_path), str(ledgers)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    seg = None
    try:
        engine_pid = int(holder.stdout.readline())
        seg = Path("/dev/shm") / (tmp_path / "server.py.seg").read_text()
        _killpg(engine_pid, signal.SIGKILL)
        holder.kill()
        assert holder.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while _killpg(engine_pid, 0):
            assert time.monotonic() < deadline, "the engine's group did not end"
            time.sleep(0.05)
        assert seg.exists() and [p.name for p in ledgers.iterdir()] == [f"{holder.pid}-engine-r0.json"]

        config = EngineConfig(cmd=("true", "{port}"), log_dir=str(tmp_path), segment_ledger_dir=str(ledgers))
        engine = ManagedEngine(0, config)
        engine.start()  # the sweep comes before the process starts
        assert not seg.exists() and list(ledgers.iterdir()) == []
        engine.stop()
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(30)
        if seg is not None:
            seg.unlink(missing_ok=True)
