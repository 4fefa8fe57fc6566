"""Quiet deadline waits on the process group's store (the daemon's relay and the engines' agreements)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

dist = pytest.importorskip("torch.distributed")

from checkpoint_engine.daemon.relay import Relay  # noqa: E402 - after the skip
from checkpoint_engine.daemon.store_wait import wait_for_keys  # noqa: E402


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield s
    del s


def test_a_wait_past_its_deadline_logs_nothing(store, capfd):
    t0 = time.monotonic()
    assert not wait_for_keys(store, ["never"], 0.3)
    assert 0.3 <= time.monotonic() - t0 < 2
    store.set("a", "1")
    assert wait_for_keys(store, ["a"], 0.3)
    assert not wait_for_keys(store, ["a", "never"], 0.1)  # every key must be set
    err = capfd.readouterr().err
    assert "waitForInput" not in err and "timed out" not in err, err


def test_a_key_set_meanwhile_ends_the_wait_at_once(store):
    threading.Timer(0.2, store.set, ("late", "1")).start()
    t0 = time.monotonic()
    assert wait_for_keys(store, ["late"], 10.0)
    assert time.monotonic() - t0 < 1


def test_stop_ends_the_wait(store):
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    assert not wait_for_keys(store, ["never"], 10.0, stop=stop)
    assert time.monotonic() - t0 < 1


def test_relay_names_the_ranks_that_did_not_answer(store, capfd):
    relays = [Relay(store, r, 3, result_timeout_s=0.3) for r in range(3)]
    relays[0].publish({"op": "inspect"})
    stop = threading.Event()
    assert relays[1].next_command(stop) == {"op": "inspect"}
    relays[0].put_result({"ok": True, "result": {}})
    relays[1].put_result({"ok": True, "result": {}})
    results = relays[0].gather_results()
    assert results[:2] == [{"ok": True, "result": {}}] * 2
    assert results[2] == {
        "ok": False,
        "error": "rank 2 did not answer within 0.3 s: it may have died; the daemon must be restarted",
        "kind": "unavailable",
    }
    stop.set()
    relays[2].done()
    assert relays[2].next_command(stop) is None  # stopped: no wait
    assert "waitForInput" not in capfd.readouterr().err


def test_relay_stops_waiting_for_a_rank_that_left(store):
    relays = [Relay(store, r, 3, result_timeout_s=30.0) for r in range(3)]
    relays[0].publish({"op": "exit"})
    relays[0].put_result({"ok": True, "result": {}})
    relays[1].put_result({"ok": True, "result": {}})
    relays[2].leave()  # a signal ended rank 2 before it ran the command
    t0 = time.monotonic()
    results = relays[0].gather_results()
    assert time.monotonic() - t0 < 2  # not the relay's 30 s
    assert results == [{"ok": True, "result": {}}] * 2 + [
        {"ok": False, "error": "rank 2 has exited; the daemon must be restarted", "kind": "unavailable"}
    ]
    # a silent rank still costs the (per-call) deadline, and is named as such
    relays[0].done()
    relays[0].publish({"op": "inspect"})
    relays[0].put_result({"ok": True, "result": {}})
    t0 = time.monotonic()
    results = relays[0].gather_results(timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2
    assert results[1] == {
        "ok": False,
        "error": "rank 1 did not answer within 0.3 s: it may have died; the daemon must be restarted",
        "kind": "unavailable",
    }
    assert results[2] == {
        "ok": False,
        "error": "rank 2 has exited; the daemon must be restarted",
        "kind": "unavailable",
    }
