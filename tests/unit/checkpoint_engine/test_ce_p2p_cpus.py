"""CPU sets for the P2P transfer engine's threads (`checkpoint_engine.p2p`: `parse_cpu_list`, `thread_cpus`,
`P2PConfig.cpus`), no Mooncake."""

from __future__ import annotations

import threading

import pytest

from checkpoint_engine.p2p import P2PConfig, parse_cpu_list, thread_cpus


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
