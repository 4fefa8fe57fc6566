"""The daemon's relay signs what it writes to the ranks' store when it has a token: a process that
reaches the store's port but not the token cannot make a rank run a command, replay an old one, or
stand in for a rank's result (checkpoint_engine.daemon.relay)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from checkpoint_engine.daemon.relay import ForgedMessage, Relay, relay_key, relay_key_required, seal, unseal


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
