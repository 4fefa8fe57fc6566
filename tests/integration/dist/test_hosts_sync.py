"""Across hosts in the testbed (testing/hosts.py, testing/host_sync.py): a version moves from the
trainer's memory into plain engines on two inference hosts, over shaped links, and survives faults.

One testbed for the module: hosts "trainer", "inf0", "inf1", every link 400 Mbit/s both ways; the
trainer holds 64 MiB of tensors in memory (no file anywhere); each inference host runs a plain engine
and one parameter-server rank.

  relay          every engine holds the trainer's tensors (per-tensor checksums); the trainer's link
                 sent each byte once (<= 1.05 M), inf0 relayed it to inf1 (inf1 received >= M)
  each pulls     mode auto (each rank reads the trainer itself): the trainer's link sent 2 M, the
                 difference the relay makes
  inf1 cut off   inf1's link set down while the bucket stream runs: both ranks fail within their
  mid-update     deadlines, rank 0's error names rank 1 on inf1, no engine reports the version as
                 complete (both `incomplete`); link back up: the next update brings both to it
  trainer cut    the trainer's link down mid-pull: the update fails within its deadline naming the
  off mid-pull   trainer's host; link back: the next update completes everywhere
No process, namespace or link is left (the testbed checks its own leftovers).
"""

from __future__ import annotations

import time

import pytest

from testing.hosts import Testbed

RATE_MBIT = 400
SIZE_MIB = 64
TIMEOUT_S = 10.0

pytestmark = pytest.mark.skipif(bool(Testbed.unavailable()), reason=f"no testbed here: {Testbed.unavailable()}")


@pytest.fixture(scope="module")
def sync(tmp_path_factory):
    from testing.host_sync import HostSync

    bed = Testbed(["trainer", "inf0", "inf1"], rate_mbit=RATE_MBIT)
    try:
        hs = HostSync(bed, size_mib=SIZE_MIB, work_dir=tmp_path_factory.mktemp("hosts"), timeout_s=TIMEOUT_S)
        yield hs
        hs.close()
    finally:
        bed.close()
        assert not bed.leftovers(), bed.leftovers()


def _cut_when_flowing(sync, victim: str):
    """`during` for HostSync.update: partition `victim` once a tenth of the version left the trainer."""

    def during(procs):
        start = sync.trainer.counters().tx_bytes
        deadline = time.monotonic() + 60
        while sync.trainer.counters().tx_bytes - start < sync.nbytes // 10:
            assert time.monotonic() < deadline, "the update never started moving bytes"
            assert all(p.poll() is None for p in procs), "a rank exited before the bytes flowed"
            time.sleep(0.02)
        sync.bed[victim].partition()

    return during


def _assert_all_current(sync, run) -> None:
    assert run.ok, run.results
    assert run.digests_match == {"inf0": True, "inf1": True}, run.results
    for h in sync.inference:
        assert sync.engine_state(h)["status"] == "ready"


def test_relay_moves_each_byte_over_the_trainers_link_once(sync):
    run = sync.update("relay", bucket_mib=8)
    _assert_all_current(sync, run)
    assert [r["mode"] for r in run.results] == ["relay", "relay"]
    m = sync.nbytes
    tx = run.link_bytes["trainer"].tx_bytes
    print(f"relay: {run.e2e_s} s for {m} bytes at {RATE_MBIT} Mbit/s; trainer sent {tx / m:.3f} M")
    assert m <= tx <= 1.05 * m, run.link_bytes
    assert run.link_bytes["inf1"].rx_bytes >= m and run.link_bytes["inf0"].tx_bytes >= m, run.link_bytes

    each = sync.update("auto", bucket_mib=8)
    _assert_all_current(sync, each)
    assert [r["mode"] for r in each.results] == ["p2p", "p2p"]
    assert each.link_bytes["trainer"].tx_bytes >= 1.95 * m, each.link_bytes  # once per inference host


@pytest.mark.parametrize("victim, named", [("inf1", "rank 1 on inf1"), ("trainer", "owner rank 0 (host trainer")])
def test_a_partition_mid_update_fails_within_its_deadline_and_the_next_update_heals(sync, victim, named):
    t0 = time.monotonic()
    run = sync.update("relay", bucket_mib=4, during=_cut_when_flowing(sync, victim))
    took = time.monotonic() - t0
    try:
        assert not run.ok and all(r["rc"] == 1 for r in run.results), run.results
        assert named in run.results[0]["error"], run.results
        # every wait has a deadline: the per-bucket one, plus the root's read for the other rank
        assert all(r["local_s"] < 3 * TIMEOUT_S + 5 for r in run.results), run.results
        assert took < 3 * TIMEOUT_S + 30, took
        for h in sync.inference:
            if h.name != victim:
                state = sync.engine_state(h)
                assert state["status"] == "incomplete" and not state["weights_complete"], state
    finally:
        sync.bed[victim].heal()
    for h in sync.inference:  # the cut-off engine too, now reachable again
        assert sync.engine_state(h)["status"] == "incomplete"
    _assert_all_current(sync, sync.update("relay", bucket_mib=8))
