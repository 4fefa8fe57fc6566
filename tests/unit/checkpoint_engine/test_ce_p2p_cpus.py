"""CPU sets for the P2P transfer engine's threads (`checkpoint_engine.transport.mooncake`:
`parse_cpu_list`, `thread_cpus`, `P2PConfig.cpus`), no Mooncake."""

from __future__ import annotations

import threading

import pytest

from checkpoint_engine.transport.mooncake import P2PConfig, parse_cpu_list, rank_cpus, thread_cpus


@pytest.mark.parametrize(
    "text, cpus",
    [("0", (0,)), ("0,2-3", (0, 2, 3)), (" 3-4 , 1 ", (1, 3, 4)), ("2,2,1-2", (1, 2)), ("5-5", (5,))],
)
def test_parse_cpu_list(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "1,", "3-1", "-1", "1-", "0-x"])
def test_parse_cpu_list_names_the_bad_part(text):
    with pytest.raises(ValueError, match="bad CPU list"):
        parse_cpu_list(text)


@pytest.mark.parametrize("cpus", [(), [0], (0, -1), (True,), (1.0,)])
def test_p2p_config_rejects_bad_cpus(cpus):
    with pytest.raises(ValueError, match="p2p cpus"):
        P2PConfig(cpus=cpus)


def test_threads_started_under_thread_cpus_run_on_those_cpus():
    import os

    mine = os.sched_getaffinity(0)
    one = (min(mine),)
    seen = []
    with thread_cpus(one):
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join(5)
    assert seen == [set(one)] and os.sched_getaffinity(0) == mine  # the caller's set is restored
    with pytest.raises(ValueError, match="cannot run on CPUs"), thread_cpus((os.cpu_count() + 7,)):
        pass
    assert os.sched_getaffinity(0) == mine


@pytest.mark.parametrize(
    "spec, local_rank, local_world_size, cpus",
    [
        ("0-3", 0, 1, (0, 1, 2, 3)),
        ("0-3", 1, 2, (0, 1, 2, 3)),  # one list: every rank
        ("0-3;4-7", 1, 2, (4, 5, 6, 7)),  # one per local rank
        ("1; 0", 0, 2, (1,)),
    ],
)
def test_rank_cpus(spec, local_rank, local_world_size, cpus):
    assert rank_cpus(spec, local_rank, local_world_size) == cpus


@pytest.mark.parametrize(
    "spec, local_world_size, message",
    [
        ("0;1;2", 2, "3 lists for 2 local ranks"),
        ("0;x", 2, "bad CPU list 'x'"),
        ("", 1, "bad CPU list ''"),
    ],
)
def test_rank_cpus_names_what_is_wrong(spec, local_world_size, message):
    with pytest.raises(ValueError, match=message):
        rank_cpus(spec, 0, local_world_size)


def test_the_daemon_places_each_rank_s_transfer_engine_from_its_flag(monkeypatch, capsys):
    from checkpoint_engine.__main__ import parse_args

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = parse_args(["--p2p-host", "127.0.0.1", "--p2p-cpus", "0;1"])
    assert args.p2p_cpu_list == (1,)
    assert parse_args(["--p2p-host", "127.0.0.1"]).p2p_cpu_list is None
    for argv, message in (
        (["--p2p-cpus", "0"], "it needs --p2p-host"),
        (["--p2p-host", "127.0.0.1", "--p2p-cpus", "0;1;2"], "3 lists for 2 local ranks"),
    ):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
