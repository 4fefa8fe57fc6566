"""The pieces of one receiver update (`vllm_ext.receive`), each alone, without a parameter server:
the fault slot and bucket fault, the per-mode reload strategies, the weight cache's use, the engine
reads' tally and the delta intake. The receiver composed of them is tested end to end in
tests/integration/vllm/test_vllm_receiver.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from checkpoint_engine.sharding.delta import DeltaMismatch
from vllm_ext.receive.caching import CacheUse
from vllm_ext.receive.delta import DeltaIntake
from vllm_ext.receive.faults import BucketFault, FaultSlot, FaultSpec
from vllm_ext.receive.modes import BucketLoad, EndReload, StreamingReload, reload_for
from vllm_ext.receive.reads import ReadTally
from vllm_ext.weight_cache import WeightCache


class Model:
    """What a reload reports to (the receiver's `recover` and `reload_error`), recording both."""

    def __init__(self) -> None:
        self.reload_error: str | None = None
        self.recovered: list[str] = []

    def recover(self, why: str) -> None:
        self.recovered.append(why)


class Loader:
    """A reload function that records every (name, value) it is given; it fails on `fail_on`."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[list[tuple[str, float]]] = []
        self.fail_on = fail_on

    def __call__(self, pairs) -> None:
        got: list[tuple[str, float]] = []
        self.calls.append(got)
        for name, t in pairs:
            if name == self.fail_on:
                raise KeyError(name)
            got.append((name, float(t.flatten()[0])))


def t(v: float) -> torch.Tensor:
    return torch.full((4,), v)


def test_the_fault_slot_hands_its_fault_once_to_its_own_point():
    slot = FaultSlot()
    assert slot.take("bucket") is None
    slot.arm({"kind": "raise", "at": "finish"})
    assert slot.take("bucket") is None and slot.take("start") is None  # still armed
    assert slot.take("finish").at == "finish" and slot.take("finish") is None
    slot.arm(FaultSpec(kind="stall", bucket=1))
    with pytest.raises(ValueError, match="unknown fault field"):
        slot.arm({"kind": "raise", "nope": 1})
    assert slot.armed == FaultSpec(kind="stall", bucket=1)  # a bad spec leaves the armed one


def test_a_bucket_fault_fires_in_its_bucket_only_once(tmp_path):
    marker = tmp_path / "fired"
    fault = BucketFault(FaultSpec(kind="raise", bucket=1, marker_path=str(marker)))
    fault.check(0)
    assert not marker.exists()
    with pytest.raises(RuntimeError, match="injected fault in bucket 1"):
        fault.check(1)
    assert marker.exists()
    fault.check(1)  # fired already
    BucketFault(None).check(0)


def test_each_mode_gets_its_strategy():
    loader = Loader()
    assert isinstance(reload_for("streaming", loader, 5, list), StreamingReload)
    assert isinstance(reload_for("end", loader, 5, list), EndReload)
    bucket = reload_for("bucket", loader, 5, list)
    assert isinstance(bucket, BucketLoad) and not bucket.keeps


def test_streaming_feeds_each_bucket_and_end_reloads_only_at_done():
    loader = Loader()
    streaming = StreamingReload(loader, 5)
    streaming.on_bucket([])  # an empty bucket starts nothing
    assert streaming.stream is None
    streaming.on_bucket([("a", t(1))])
    streaming.on_bucket([("b", t(2))])
    streaming.on_done(lambda: pytest.fail("streaming has nothing to start at Done"))
    streaming.join(Model())
    assert loader.calls == [[("a", 1.0), ("b", 2.0)]]

    loader = Loader()
    end = EndReload(loader, 5)
    end.on_bucket([("a", t(1))])
    assert end.stream is None
    end.on_done(lambda: [("a", t(3))])
    end.join(Model())
    assert loader.calls == [[("a", 3.0)]]


def test_a_failed_reload_recovers_the_model_and_leaves_nothing_to_abort():
    model = Model()
    reload = StreamingReload(Loader(fail_on="b"), 5)
    reload.on_bucket([("a", t(1)), ("b", t(2))])
    with pytest.raises(RuntimeError, match="reload path failed: KeyError"):
        reload.join(model)
    assert reload.stream is None and model.recovered[0].startswith("reload failed: RuntimeError")
    assert reload.abort({"a", "b"}, None, model) is None and len(model.recovered) == 1


def test_an_aborted_streaming_reload_is_filled_in_when_the_cache_allows():
    loader, model = Loader(), Model()
    reload = StreamingReload(loader, 5)
    reload.on_bucket([("a", t(1))])
    assert reload.abort({"a"}, lambda: [("b", t(0))], model) is True
    assert loader.calls == [[("a", 1.0), ("b", 0.0)]] and model.recovered == []

    reload = StreamingReload(Loader(), 5)
    reload.on_bucket([("a", t(1))])
    assert reload.abort({"a"}, None, model) is False
    assert EndReload(Loader(), 5).abort(set(), None, model) is None  # nothing was started


def test_bucket_load_skips_what_the_reads_loaded_and_notes_a_partial_load():
    loader, model = Loader(), Model()
    load = BucketLoad(loader, 5, unread=lambda views: [(n, v) for n, v in views if n != "read"])
    load.on_bucket([("read", t(9)), ("a", t(1))])
    load.on_bucket([("read", t(9))])  # nothing left: the loaders do not run
    assert loader.calls == [[("a", 1.0)]] and load.loaders_s >= 0
    assert load.abort({"a"}, None, model) is None
    assert model.reload_error == "aborted load: only some buckets reached the parameters"
    assert BucketLoad(loader, 5, unread=list).abort(set(), None, Model()) is None

    with pytest.raises(RuntimeError, match="reload path failed: KeyError"):
        BucketLoad(Loader(fail_on="a"), 5, unread=list).on_bucket([("a", t(1))])


def test_cache_use_copies_unless_a_stable_view_may_go_uncopied():
    cache = WeightCache()
    use = CacheUse(cache, weight_cache=True, mode="streaming")
    buf = torch.zeros(32, dtype=torch.uint8)  # the PS's buffers are bytes
    use.on_hello(SimpleNamespace(stable_buffers=[0]), [buf])
    assert use.stable_ranges == []  # a cache is kept: every tensor is copied
    kept = use.keep("a", buf[:16].view(torch.float32))
    assert kept.data_ptr() != buf.data_ptr() and "a" in cache

    use = CacheUse(WeightCache(), weight_cache=False, mode="streaming")
    use.on_hello(SimpleNamespace(stable_buffers=[0]), [buf, torch.zeros(2)])
    assert use.keep("a", buf[:16].view(torch.float32)).data_ptr() == buf.data_ptr() and use.num_zero_copy == 1
    assert use.keep("b", torch.ones(2)).data_ptr() != buf.data_ptr()  # not in a stable buffer


def test_cache_use_commit_fill_in_and_abort():
    cache = WeightCache()
    cache.store("old", t(0))
    cache.store("a", t(0))
    use = CacheUse(cache, weight_cache=True, mode="end")
    assert use.previous({"a"}) is None  # the cache does not mirror the model yet
    use.stale()
    use.keep("a", t(1))
    assert use.kept(["a"])[0][0] == "a"
    assert use.commit({"a"}, None) is None
    assert cache.matches_model and "old" not in cache
    assert use.commit({"a"}, dict) == 0  # no slots offered: none adopted

    use = CacheUse(cache, weight_cache=True, mode="streaming")
    cache.store("b", t(2))
    assert [n for n, _ in use.previous({"a"})()] == ["b"]
    assert use.after_abort(True) is None and cache.matches_model
    assert "no copy of the previous weights" in use.after_abort(False) and not cache.matches_model
    assert "weight_cache is off" in CacheUse(cache, weight_cache=False, mode="streaming").after_abort(False)
    assert CacheUse(cache, weight_cache=True, mode="bucket").commit({"a"}, None) is None  # nothing cached


def test_read_tally_counts_tensors_read_into_their_slots():
    probe = SimpleNamespace(num_probed=3, holds=lambda name, tensor: name == "in_slot")
    stats = SimpleNamespace(sliced_tensors=2, report=lambda: {"sliced_tensors": 2})
    tally = ReadTally(SimpleNamespace(stats=stats), probe, probed_ahead=3)
    views = [("in_slot", t(1)), ("other", t(2))]
    assert tally.unread(views) == views and tally.report() is None and not tally.sliced()  # the PS pushed
    tally.on_hello(SimpleNamespace(buffers=[SimpleNamespace(kind="remote")]))
    assert [n for n, _ in tally.unread(views)] == ["other"] and tally.num_loaded_by_read == 1
    assert tally.sliced() and tally.report() == {"sliced_tensors": 2}
    probe.num_probed = 5
    assert tally.probed_in_update() == 2
    assert ReadTally(SimpleNamespace(stats=stats), None, 0).probed_in_update() == 0


def test_delta_intake_refuses_without_writing_and_in_the_load_step():
    whole = [("a", t(1))]
    intake = DeltaIntake(None, "v1", whole_only=False)
    assert intake.take(whole) == whole and not intake.is_delta and intake.nbytes == 0
    cache = WeightCache()
    cache.store("a", t(0))
    cache.matches_model = True
    use = CacheUse(cache, weight_cache=True, mode="streaming")
    with pytest.raises(DeltaMismatch, match="mixes whole tensors"):
        intake.apply(use, None, {"a"}, None, sliced=False)
    assert not cache.matches_model  # the whole tensors of a mixed update were cached
    cache.matches_model = True
    with pytest.raises(DeltaMismatch, match="cannot apply a delta update: no cache"):
        intake.apply(use, "no cache", set(), None, sliced=False)
    assert cache.matches_model  # nothing was written
