"""`checkpoint_engine.p2p.Workers`: blocking calls with a deadline on kept daemon threads (no Mooncake)."""

from __future__ import annotations

import threading
import time

import pytest

from checkpoint_engine.p2p import CallTimeout, P2PConfig, Workers, parse_cpu_list, thread_cpus


def test_calls_reuse_one_thread_and_return_results_and_exceptions():
    workers = Workers("t")
    idents = [workers.run(threading.get_ident, 5.0) for _ in range(5)]
    assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
    assert workers.run(lambda: 41 + 1, 5.0) == 42
    with pytest.raises(ZeroDivisionError):
        workers.run(lambda: 1 / 0, 5.0)
    assert workers.run(threading.get_ident, 5.0) == idents[0]  # an exception does not lose the worker


def test_a_call_past_its_deadline_keeps_its_thread_and_the_next_call_gets_another():
    workers = Workers("t")
    release = threading.Event()
    first = workers.run(threading.get_ident, 5.0)
    t0 = time.monotonic()
    with pytest.raises(CallTimeout, match="within 0.2 s"):
        workers.run(lambda: release.wait(30), 0.2)
    assert time.monotonic() - t0 < 5
    other = workers.run(threading.get_ident, 5.0)
    assert other != first  # the stuck worker is not handed out
    release.set()


def test_concurrent_callers_each_get_a_worker():
    workers = Workers("t")
    barrier = threading.Barrier(3, timeout=10)
    out: list[int] = []

    def caller():
        out.append(workers.run(lambda: (barrier.wait(), threading.get_ident())[1], 10.0))

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert len(set(out)) == 3  # all three calls ran at once (the barrier needs three)


def test_an_idle_worker_ends_and_a_later_call_starts_a_new_one():
    workers = Workers("t-idle", idle_exit_s=0.1)
    workers.run(lambda: None, 5.0)
    deadline = time.monotonic() + 10
    while any(t.name == "t-idle" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the idle worker did not end"
        time.sleep(0.02)
    assert workers.run(lambda: 7, 5.0) == 7


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


def test_workers_and_threads_started_under_thread_cpus_run_on_those_cpus():
    import os

    mine = os.sched_getaffinity(0)
    one = (min(mine),)
    assert Workers("t", cpus=one).run(lambda: os.sched_getaffinity(0), 5.0) == set(one)
    assert Workers("t").run(lambda: os.sched_getaffinity(0), 5.0) == mine  # None: inherited
    seen = []
    with thread_cpus(one):
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join(5)
    assert seen == [set(one)] and os.sched_getaffinity(0) == mine  # the caller's set is restored
    with pytest.raises(ValueError, match="cannot run on CPUs"), thread_cpus((os.cpu_count() + 7,)):
        pass
    assert os.sched_getaffinity(0) == mine
