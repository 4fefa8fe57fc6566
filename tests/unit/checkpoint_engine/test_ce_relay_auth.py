"""The daemon's relay signs what it writes to the ranks' store when it has a token: a process that
reaches the store's port but not the token cannot make a rank run a command, replay an old one, stand
in for a rank's result or exit, rewrite an engine's record (nor write back an older genuine one), or
forge an agreement; a refused value is logged once and ignored, and never costs the genuine value
landing at the same key (checkpoint_engine.daemon.relay)."""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from checkpoint_engine.daemon.relay import (
    EngineBoard,
    ForgedMessage,
    Relay,
    SealedStore,
    relay_key,
    relay_key_required,
    seal,
    unseal,
)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)


def test_seal_and_unseal_bind_the_key_name_and_body():
    key = relay_key("s3cret")
    assert relay_key(None) is None and relay_key("") is None and key != relay_key("other")
    sealed = seal(key, "cmd/3", {"op": "shutdown"})
    assert unseal(key, "cmd/3", sealed) == {"op": "shutdown"}
    with pytest.raises(ForgedMessage, match="replayed from another key"):
        unseal(key, "cmd/4", sealed)  # command 3 written again as command 4
    with pytest.raises(ForgedMessage, match="signature is wrong"):
        unseal(relay_key("guess"), "cmd/3", sealed)
    with pytest.raises(ForgedMessage, match="unsigned"):
        unseal(key, "cmd/3", '{"op": "shutdown"}')
    assert unseal(None, "cmd/3", '{"op": "x"}') == {"op": "x"}  # no token: unsigned, as before


@pytest.mark.parametrize(
    "addr, required",
    [(None, False), ("127.0.0.1", False), ("localhost", False), ("::1", False), ("10.0.0.2", True), ("node0", True)],
)
def test_a_store_other_hosts_may_reach_needs_a_token(addr, required):
    assert relay_key_required(addr) is required


def test_a_forged_command_is_skipped_and_rank_0s_runs(store):
    key = relay_key("s3cret")
    rank0, rank1 = Relay(store, 0, 2, 5.0, key=key), Relay(store, 1, 2, 5.0, key=key)
    attacker = dist.PrefixStore("ckpt-daemon/", store)
    attacker.set("cmd/0", '{"op": "shutdown"}')  # what a peer without the token can write
    got: list = []
    t = threading.Thread(target=lambda: got.append(rank1.next_command(threading.Event())))
    t.start()
    t0 = time.monotonic()
    while rank1.num_forged == 0 and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    assert rank1.num_forged >= 1 and not got  # refused, still waiting
    rank0.publish({"op": "inspect"})
    t.join(10)
    assert got == [{"op": "inspect"}]
    # a forged result for rank 1 is not taken as rank 1's
    rank0.put_result({"ok": True})
    attacker.set("res/0/1", '{"ok": true, "forged": true}')
    results = rank0.gather_results(timeout_s=2)
    assert results[0] == {"ok": True}
    assert results[1]["ok"] is False and "refused" in results[1]["error"], results


KEY = relay_key("s3cret")
WRONG = relay_key("wrong")
RECORD = {"rank": 1, "ranks": [1], "state": "serving", "checkpoint": "v1", "url": "http://10.0.0.2:9000"}


@pytest.mark.parametrize(
    "name, value",
    [
        ("engines/1", {"n": 3, "record": RECORD}),  # an engine record
        ("res/4/1", {"ok": True, "result": {}}),  # rank 1's result of command 4
        ("gone/1", {"gone": True}),  # rank 1 exited
        ("agree/2/1", None),  # an agreement (checkpoint_engine.engines.host): null, no error
    ],
)
@pytest.mark.parametrize(
    "forged, why",
    [
        (lambda name, value: json.dumps(value), "unsigned"),
        (lambda name, value: seal(WRONG, name, value), "signature is wrong"),
        (lambda name, value: seal(KEY, "engines/0" if name != "engines/0" else "x", value), "signature is wrong"),
        (lambda name, value: "not json {", "unsigned"),
        (lambda name, value: json.dumps({"body": json.dumps(value), "mac": "00" * 32}), "signature is wrong"),
    ],
    ids=["unsigned", "wrong-token", "other-key", "garbage", "bad-mac"],
)
def test_every_kind_of_value_is_bound_to_the_token_and_its_key(name, value, forged, why):
    assert unseal(KEY, name, seal(KEY, name, value)) == value
    with pytest.raises(ForgedMessage, match=why):
        unseal(KEY, name, forged(name, value))


class RacingStore:
    """Rank 1's view of the store, whose `get` of a forgery lets rank 0 publish right after the read:
    the moment rank 0's command lands while rank 1 reads the key."""

    def __init__(self, inner, forgery: bytes, publish):
        self.inner, self.forgery, self.publish = inner, forgery, publish

    def check(self, keys):
        return self.inner.check(keys)

    def get(self, k):
        raw = self.inner.get(k)
        if raw == self.forgery:
            self.publish()
        return raw

    def delete_key(self, k):
        return self.inner.delete_key(k)


def test_a_forgery_racing_rank_0s_command_does_not_lose_it(caplog):
    """The forgery is at cmd/0 when rank 1 reads it, and rank 0's command lands right after that read:
    rank 1 refuses the forgery without deleting the key, so it finds rank 0's command there next."""
    store = dist.HashStore()
    rank0, rank1 = Relay(store, 0, 2, 5.0, key=KEY), Relay(store, 1, 2, 5.0, key=KEY)
    forgery = b'{"op": "exit"}'
    dist.PrefixStore("ckpt-daemon/", store).set("cmd/0", forgery)
    rank1.store = RacingStore(rank1.store, forgery, lambda: rank0.publish({"op": "inspect"}))
    stop = threading.Event()
    threading.Timer(5, stop.set).start()  # the test's bound only
    with caplog.at_level(logging.ERROR):
        assert rank1.next_command(stop) == {"op": "inspect"}
    stop.set()
    assert rank1.num_forged == 1
    assert caplog.messages == [
        "rank 1: refused cmd/0: cmd/0: an unsigned value (not written by a rank holding the token)"
    ]


def test_a_refused_command_is_logged_once_while_it_stays(store, caplog):
    rank0, rank1 = Relay(store, 0, 2, 5.0, key=KEY), Relay(store, 1, 2, 5.0, key=KEY)
    attacker = dist.PrefixStore("ckpt-daemon/", store)
    attacker.set("cmd/0", seal(WRONG, "cmd/0", {"op": "exit"}))
    got: list = []
    with caplog.at_level(logging.ERROR):
        t = threading.Thread(target=lambda: got.append(rank1.next_command(threading.Event())))
        t.start()
        time.sleep(0.5)  # about ten reads of the same forgery
        assert not got and attacker.check(["cmd/0"])  # still waiting, the key left alone
        attacker.set("cmd/0", '{"op": "engine_stop"}')  # another forgery: logged too
        time.sleep(0.3)
        rank0.publish({"op": "inspect"})
        t.join(10)
    assert got == [{"op": "inspect"}]
    refused = [m for m in caplog.messages if "refused cmd/0" in m]
    assert len(refused) == 2 and "signature is wrong" in refused[0] and "unsigned" in refused[1], refused


@pytest.mark.parametrize("value", ['{"ok": true}', "wrong-token"])
def test_a_forged_result_waits_for_the_ranks_own(store, value):
    rank0, rank1 = Relay(store, 0, 2, 5.0, key=KEY), Relay(store, 1, 2, 5.0, key=KEY)
    attacker = dist.PrefixStore("ckpt-daemon/", store)
    rank0.publish({"op": "inspect"})
    rank0.put_result({"ok": True, "result": 0})
    attacker.set("res/0/1", seal(WRONG, "res/0/1", {"ok": False}) if value == "wrong-token" else value)
    attacker.set("gone/1", "1")  # and a forged exit: rank 0 must not stop waiting for rank 1
    threading.Timer(0.5, lambda: rank1.put_result({"ok": True, "result": 1})).start()
    t0 = time.monotonic()
    results = rank0.gather_results(timeout_s=10)
    assert results == [{"ok": True, "result": 0}, {"ok": True, "result": 1}] and time.monotonic() - t0 < 5
    assert rank0.num_forged == 2  # the result and the exit, each logged once
    rank0.done()
    assert not attacker.check(["res/0/1"]) and not attacker.check(["cmd/0"])  # the answered keys went


def test_a_rank_that_left_is_known_by_its_sealed_exit(store):
    rank0, rank1 = Relay(store, 0, 2, 30.0, key=KEY), Relay(store, 1, 2, 30.0, key=KEY)
    rank0.publish({"op": "exit"})
    rank0.put_result({"ok": True})
    rank1.leave()
    t0 = time.monotonic()
    results = rank0.gather_results()
    assert time.monotonic() - t0 < 2 and "rank 1 has exited" in results[1]["error"]


def record(state: str, **kw) -> dict:
    return {**RECORD, "state": state, **kw}


def test_engine_records_are_sealed_and_forged_ones_leave_the_view_unchanged(store, caplog):
    Relay(store, 1, 2, 5.0, key=KEY)  # the daemon makes its relay first: the board takes its key
    writer, reader = EngineBoard(store, 2), EngineBoard(store, 2)
    assert writer.key == KEY
    raw = dist.PrefixStore("ckpt-engines/", store)
    assert reader.records()[1]["state"] == "stopped"  # nothing written yet
    writer.put(record("starting"))
    old = raw.get("engines/1")
    writer.put(record("serving"))
    assert reader.records()[1] == record("serving")
    forgeries = [
        ("unsigned", json.dumps(record("failed", last_error="boom"))),
        ("wrong token", seal(WRONG, "engines/1", {"n": 99, "record": record("failed")})),
        ("another key's", seal(KEY, "engines/0", {"n": 99, "record": record("failed")})),
        ("older genuine", old),
    ]
    with caplog.at_level(logging.ERROR):
        for what, value in forgeries:
            raw.set("engines/1", value)
            for _ in range(3):  # read again and again (the healer's rounds): logged once
                assert reader.records()[1] == record("serving"), what
    messages = [m for m in caplog.messages if "refused engines/1" in m]
    assert len(messages) == 4 and reader.refusals.count == 4, messages
    assert "an older record (number 1; the newest taken is number 2)" in messages[3]
    writer.put(record("stopping"))  # the rank's own next record is taken again
    assert reader.records()[1] == record("stopping")


def test_a_refused_record_never_read_before_is_unknown_and_no_heal_follows(store):
    from checkpoint_engine.daemon.heal import Healer

    raw = dist.PrefixStore("ckpt-engines/", store)
    raw.set("engines/1", json.dumps(record("failed")))
    board = EngineBoard(store, 2, key=KEY)
    got = board.records()[1]
    assert got["state"] == "unknown" and "refused" in got["last_error"]

    class Driver:
        def __init__(self):
            self.board, self.current, self.runs = board, "v1", []

        def run(self, cmd, **kw):
            self.runs.append(cmd)
            return {"ok": True}

    driver = Driver()
    healer = Healer(driver, 3600.0, 3)
    healer.heal_once()
    healer.close(1)
    assert driver.runs == []  # a forged "failed" record is not healed


def test_without_a_token_records_are_plain_json(store):
    board = EngineBoard(store, 2, key=None)
    board.put(record("serving"))
    assert json.loads(dist.PrefixStore("ckpt-engines/", store).get("engines/1")) == record("serving")
    assert board.records()[1] == record("serving")


def test_the_sealed_store_agrees_only_on_values_sealed_for_their_key(store, caplog):
    from checkpoint_engine.daemon.store_wait import wait_for_keys

    rank0, rank1 = SealedStore(store, KEY, "rank 0"), SealedStore(store, KEY, "rank 1")
    keys = ["agree/0/0", "agree/0/1"]
    rank0.set(keys[0], json.dumps(None))
    store.set(keys[1], json.dumps("engine failed"))  # a forged error for rank 1
    with caplog.at_level(logging.ERROR):
        assert not wait_for_keys(rank0, keys, 0.3)  # the forgery is not rank 1's report
        threading.Timer(0.2, lambda: rank1.set(keys[1], json.dumps(None))).start()
        assert wait_for_keys(rank0, keys, 5)
    assert [json.loads(rank0.get(k)) for k in keys] == [None, None]
    assert [m for m in caplog.messages if "refused agree/0/1" in m] == [
        "rank 0: refused agree/0/1: agree/0/1: an unsigned value (not written by a rank holding the token)"
    ]
    store.set(keys[1], seal(WRONG, keys[1], "late forgery"))  # replaced after it was read: the genuine one stays
    assert json.loads(rank0.get(keys[1])) is None
    plain = SealedStore(store, None, "rank 0")  # no token: the store as is
    plain.set("agree/1/0", '"x"')
    assert store.get("agree/1/0") == b'"x"' and plain.check(["agree/1/0"])
