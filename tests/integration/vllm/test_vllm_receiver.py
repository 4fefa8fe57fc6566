"""The vLLM adapter's engine-agnostic parts, without vLLM: receiver, cache, checksum, handles.

A real ParameterServer (world size 1, CPU transport) pushes into a `WeightReceiver` whose reload
function writes into a dict "model", so streaming, aborts and fallbacks are checked exactly.
"""

from __future__ import annotations

import logging

import pytest
import torch

from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
from checkpoint_engine.errors import UpdateFailed
from checkpoint_engine.ps import ParameterServer
from checkpoint_engine.sharding.slices import SourceSlice
from ckpt_common.dtypes import dtype_name
from vllm_ext.receive.faults import FaultSpec
from vllm_ext.receiver import WeightReceiver
from vllm_ext.settings import ReceiverConfig
from vllm_ext.weight_cache import WeightCache, checkpoint_checksum
from vllm_ext.worker_handle import select_handle


def make_ckpt(seed: int, num: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(64, 48 + i, generator=g) for i in range(num)}
    out["norm.bf16"] = torch.randn(17, generator=g).to(torch.bfloat16)
    out["ids.int8"] = torch.randint(-5, 5, (9,), generator=g, dtype=torch.int8)
    return out


class DictModel:
    """A fake engine model: reload_fn copies pairs in; can be told to fail."""

    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}
        self.fail_after: int | None = None
        self.recovered = 0

    def reload(self, pairs) -> None:
        for n, (name, t) in enumerate(pairs):
            if self.fail_after is not None and n >= self.fail_after:
                raise KeyError(f"no parameter named {name!r}")
            self.weights[name] = t.clone()

    def recover(self) -> None:
        self.recovered += 1


def push(ps, receiver: WeightReceiver, name: str, ckpt: dict) -> None:
    if name not in ps.checkpoints():
        ps.register_checkpoint(name, named_tensors=ckpt)
        ps.gather_metas(name)
    try:
        ps.update(name, lambda paths: receiver.receive(paths[0][1], None))
    finally:  # a failed update returns on the PS side before the engine side has finished aborting
        assert receiver.wait_idle(30)


def make_receiver(model: DictModel, mode: str = "streaming", weight_cache: bool = True) -> WeightReceiver:
    return WeightReceiver(
        model.reload,
        recover_fn=model.recover,
        config=ReceiverConfig(timeout_s=20, reload_mode=mode, reload_timeout_s=20, weight_cache=weight_cache),
    )


def push_a_then_fail_b(ps, r: WeightReceiver) -> tuple[dict, dict]:
    """Push A, then B with a fault in bucket 2; return (a, b)."""
    a, b = make_ckpt(1), make_ckpt(2)
    push(ps, r, "A", a)
    r.arm_fault({"kind": "raise", "bucket": 2})
    with pytest.raises(UpdateFailed, match="injected fault in bucket 2"):
        push(ps, r, "B", b)
    return a, b


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("mode", ["streaming", "end"])
def test_updates_land_exactly_and_reuse_the_cache(ps, mode):
    model = DictModel()
    r = make_receiver(model, mode)
    a, b = make_ckpt(1), make_ckpt(2)
    push(ps, r, "A", a)
    assert_same(model.weights, a)
    rep = r.report()
    assert (rep["version"], rep["status"], rep["checkpoint"]) == (1, "ready", "A")
    assert rep["last_update"]["num_buckets"] > 2 and rep["last_update"]["num_tensors"] == len(a)
    assert r.checksum_report()["checksum"] == checkpoint_checksum(a)
    allocations = r.cache.num_allocations
    push(ps, r, "B", b)
    assert_same(model.weights, b)
    assert r.cache.num_allocations == allocations  # same shapes: the cached tensors were reused
    assert (r.report()["version"], r.report()["checkpoint"]) == (2, "B")
    assert r.checksum_report()["checksum"] == checkpoint_checksum(b)


def test_streaming_abort_fills_in_previous_values(ps):
    model = DictModel()
    r = make_receiver(model)
    a, b = push_a_then_fail_b(ps, r)
    rep = r.report()
    assert (rep["status"], rep["weights_complete"], rep["version"]) == ("incomplete", False, 1)
    assert "injected fault" in rep["last_error"]
    from_b = {n for n in b if torch.equal(model.weights[n], b[n]) and not torch.equal(b[n], a[n])}
    assert 0 < len(from_b) < len(b)  # some layers new, the rest refilled from the previous version
    mixed = {n: (b[n] if n in from_b else a[n]) for n in a}
    assert_same(model.weights, mixed)
    assert r.checksum_report()["checksum"] == checkpoint_checksum(mixed)  # honest: what the model holds
    push(ps, r, "B", b)
    assert_same(model.weights, b)
    assert (r.report()["status"], r.report()["version"]) == ("ready", 2)


def test_end_mode_abort_leaves_model_untouched(ps):
    model = DictModel()
    r = make_receiver(model, "end")
    a, b = make_ckpt(1), make_ckpt(2)
    push(ps, r, "A", a)
    r.arm_fault(FaultSpec(kind="raise", bucket=3))
    with pytest.raises(UpdateFailed):
        push(ps, r, "B", b)
    assert_same(model.weights, a)
    assert r.report()["status"] == "incomplete"
    assert r.checksum_report()["checksum"] is None  # the cache no longer mirrors the model
    push(ps, r, "B", b)
    assert_same(model.weights, b)


def test_first_update_aborted_reports_undefined_layers(ps):
    model = DictModel()
    r = make_receiver(model)
    r.arm_fault({"kind": "raise", "bucket": 1})
    with pytest.raises(UpdateFailed):
        push(ps, r, "A", make_ckpt(1))
    rep = r.report()
    assert rep["status"] == "incomplete" and "undefined values" in rep["reload_error"]
    assert r.checksum_report()["checksum"] is None


def test_reload_failure_aborts_and_recovers(ps):
    model = DictModel()
    r = make_receiver(model)
    model.fail_after = 5
    with pytest.raises(UpdateFailed, match="reload path failed"):
        push(ps, r, "A", make_ckpt(1))
    rep = r.report()
    assert rep["status"] == "incomplete" and "reload failed" in rep["reload_error"]
    assert model.recovered == 1
    model.fail_after = None
    push(ps, r, "A", make_ckpt(1))
    assert r.report()["status"] == "ready" and r.report()["reload_error"] is None


def test_stall_fault_writes_marker(ps, tmp_path):
    model = DictModel()
    r = make_receiver(model)
    marker = tmp_path / "marker"
    r.arm_fault({"kind": "stall", "bucket": 1, "stall_s": 0.01, "marker_path": str(marker)})
    push(ps, r, "A", make_ckpt(1))
    assert marker.exists() and r.report()["status"] == "ready"


def test_dummy_initial_weights_are_reported_incomplete(ps):
    r = WeightReceiver(DictModel().reload, initial_weights="dummy", config=ReceiverConfig(timeout_s=20))
    rep = r.report()
    assert (rep["status"], rep["weights_complete"], rep["initial_weights"]) == ("initial", False, "dummy")
    assert make_receiver(DictModel()).report()["weights_complete"] is True  # started from the checkpoint
    push(ps, r, "A", make_ckpt(1))
    assert r.report()["weights_complete"] is True
    with pytest.raises(ValueError, match="initial_weights"):
        WeightReceiver(DictModel().reload, initial_weights="random")


def test_concurrent_receive_is_refused():
    r = make_receiver(DictModel())
    r._busy.acquire()
    try:
        with pytest.raises(RuntimeError, match="already in progress"):
            r.receive("ipc://@nothing", None)
    finally:
        r._busy.release()


@pytest.mark.parametrize(
    "cls,kwargs,field",
    [
        (ReceiverConfig, {"timeout_s": 0}, "timeout_s"),
        (ReceiverConfig, {"reload_timeout_s": -1}, "reload_timeout_s"),
        (ReceiverConfig, {"reload_mode": "layer"}, "reload_mode"),
        (FaultSpec, {"kind": "explode"}, "kind"),
        (FaultSpec, {"kind": "raise", "bucket": -1}, "bucket"),
        (FaultSpec, {"kind": "stall", "stall_s": 0}, "stall_s"),
        (FaultSpec, {"kind": "raise", "at": "load"}, "at must be 'bucket', 'start' or 'finish'"),
        (FaultSpec, {"kind": "stall", "at": "start"}, "a fault at 'start' can only raise"),
    ],
)
def test_config_validation_names_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


def test_a_fault_at_start_or_finish_is_only_taken_there(tmp_path):
    r = make_receiver(DictModel())
    marker = tmp_path / "fired"
    r.arm_fault({"kind": "raise", "at": "finish", "marker_path": str(marker)})
    assert r.take_fault("bucket") is None and r.take_fault("start") is None  # still armed
    assert not marker.exists()
    assert r.take_fault("finish").at == "finish" and marker.exists()
    assert r.take_fault("finish") is None  # disarmed once taken


def test_receiver_config_from_dict_rejects_unknown_keys():
    assert ReceiverConfig.from_dict(None) == ReceiverConfig()
    assert ReceiverConfig.from_dict({"timeout_s": 5}).timeout_s == 5
    with pytest.raises(ValueError, match="timeout"):
        ReceiverConfig.from_dict({"timeout": 5})


@pytest.mark.parametrize(
    "handles,uuid,tp_rank,want",
    [
        ({"cpu-h-0": "ipc://a"}, None, 0, "ipc://a"),
        ({"cpu-h-0": "ipc://a"}, None, 3, "ipc://a"),  # the only handle, whatever the rank
        ({"GPU-1": "ipc://a", "GPU-2": "ipc://b"}, "GPU-2", 0, "ipc://b"),  # UUID wins over rank
        ({"cpu-h-0": "ipc://a", "cpu-h-1": "ipc://b"}, None, 1, "ipc://b"),
        ({"cpu-h-0": "ipc://a", "cpu-h-1": "ipc://b"}, "GPU-9", 0, "ipc://a"),
    ],
)
def test_select_handle(handles, uuid, tp_rank, want):
    assert select_handle(handles, device_uuid=uuid, tp_rank=tp_rank) == want


@pytest.mark.parametrize("handles,tp_rank", [({}, 0), ({"a": "x", "b": "y"}, 2), (["x"], 0)])
def test_select_handle_errors(handles, tp_rank):
    with pytest.raises(ValueError):
        select_handle(handles, device_uuid=None, tp_rank=tp_rank)


def test_checksum_is_order_free_and_sensitive():
    a = make_ckpt(1)
    base = checkpoint_checksum(a)
    assert checkpoint_checksum(list(reversed(list(a.items())))) == base
    flipped = dict(a)
    t = a["layers.0.w"].clone()
    t.view(torch.int32)[0, 0] ^= 1  # one bit
    flipped["layers.0.w"] = t
    renamed = {("x." + k if k == "ids.int8" else k): v for k, v in a.items()}
    reshaped = dict(a, **{"layers.1.w": a["layers.1.w"].reshape(-1)})
    retyped = dict(a, **{"ids.int8": a["ids.int8"].view(torch.uint8)})
    variants = [flipped, renamed, reshaped, retyped]
    assert len({base, *map(checkpoint_checksum, variants)}) == 1 + len(variants)


def test_weight_cache_reallocates_only_on_shape_change():
    c = WeightCache()
    x = torch.arange(6.0)
    kept = c.store("w", x)
    assert c.store("w", x + 1) is kept and torch.equal(kept, x + 1) and c.num_allocations == 1
    assert c.store("w", torch.zeros(2, 3)).shape == (2, 3) and c.num_allocations == 2
    c.store("v", x)
    c.retain_only({"w"})
    assert "v" not in c and len(c) == 1
    assert c.checksum() is None  # not marked as mirroring a model
    c.matches_model = True
    assert c.checksum() == checkpoint_checksum({"w": torch.zeros(2, 3)})


def test_weight_cache_adopts_engine_memory_keeping_values():
    c = WeightCache()
    c.store("w", torch.arange(6.0))
    c.store("v", torch.ones(3))
    staging = torch.zeros(9)
    slots = {"w": staging[:6], "v": staging[6:8], "absent": staging[8:]}  # v: shape differs, absent: not cached
    assert c.adopt(slots) == 1
    assert c.get("w").data_ptr() == staging.data_ptr() and torch.equal(staging[:6], torch.arange(6.0))
    assert torch.equal(c.get("v"), torch.ones(3)) and "absent" not in c
    assert c.store("w", torch.full((6,), 7.0)).data_ptr() == staging.data_ptr()  # later stores land in place
    assert torch.equal(staging[:6], torch.full((6,), 7.0)) and c.adopt(slots) == 1  # adopting again: no-op


def test_receiver_keeps_its_cache_in_engine_slots_after_a_complete_update(ps):
    """The engine offers memory (the direct reload's staging); the next update is copied straight there."""
    model = DictModel()
    a, b = make_ckpt(1), make_ckpt(2)
    slots = {n: torch.empty_like(t) for n, t in a.items() if n.startswith("layers.")}
    r = WeightReceiver(
        model.reload,
        recover_fn=model.recover,
        cache_slots_fn=lambda: slots,
        config=ReceiverConfig(timeout_s=20, reload_timeout_s=20),
    )
    push(ps, r, "A", a)
    assert r.report()["cache_tensors_in_engine_memory"] == len(slots)
    assert all(torch.equal(slots[n], a[n]) for n in slots)  # the values moved with the cache
    push(ps, r, "B", b)
    assert_same(model.weights, b)
    assert all(torch.equal(slots[n], b[n]) and r.cache.get(n) is slots[n] for n in slots)
    assert r.checksum_report()["checksum"] == checkpoint_checksum(b)


def test_stream_overlaps_reload_with_transfer(ps):
    """In streaming mode the reload consumes tensors while later buckets are still arriving."""
    ckpt = make_ckpt(1, num=16)
    cached_at_first_item: list[int] = []
    r = None

    def reload(pairs):
        for n, _ in enumerate(pairs):
            if n == 0:
                cached_at_first_item.append(len(r.cache))

    r = WeightReceiver(reload, config=ReceiverConfig(timeout_s=20))
    # bucket 1 stalls: the reload thread, started at bucket 0, gets its first tensor meanwhile
    r.arm_fault({"kind": "stall", "bucket": 1, "stall_s": 0.5})
    push(ps, r, "A", ckpt)
    assert r.report()["last_update"]["num_buckets"] > 5
    assert cached_at_first_item and cached_at_first_item[0] < len(ckpt)
    assert r.report()["status"] == "ready"


def test_rl_sequence_reuses_host_chunks_and_engine_mappings():
    """register v+1, update, unregister v (as the orchestrator does): from v3 on, the PS writes into
    v1's chunks and the engine finds them still mapped; every update lands exactly."""
    cfg = ParameterServerConfig(
        transport="cpu",
        reuse_host_memory=True,
        update=UpdateConfig(bucket_size_bytes=16 * 1024, engine_timeout_s=20, engine_connect_timeout_s=20),
    )
    server = ParameterServer(rank=0, world_size=1, config=cfg)
    model = DictModel()
    r = make_receiver(model)
    try:
        reports = []
        for v in range(1, 6):
            ckpt = make_ckpt(v)
            push(server, r, f"v{v}", ckpt)
            if v > 1:
                server.unregister_checkpoint(f"v{v - 1}")
            assert_same(model.weights, ckpt)
            assert r.checksum_report()["checksum"] == checkpoint_checksum(ckpt)
            reports.append(r.report()["last_update"])
        num_segments = reports[0]["segments_mapped"]
        assert num_segments >= 1 and reports[0]["segments_reused"] == 0
        assert reports[1]["segments_mapped"] == num_segments  # v1 is still registered: new chunks
        for rep in reports[2:]:
            assert (rep["segments_mapped"], rep["segments_reused"]) == (0, num_segments)
        assert server._host_pool.num_allocated == 2 * num_segments
    finally:
        server.close()


class AliasingModel(DictModel):
    """Keeps what the reload hands it without cloning (as vLLM buffers a layer's tensors), and
    records whether each tensor aliases the PS's shared memory (no copy was made)."""

    def __init__(self):
        super().__init__()
        self.kept: dict[str, torch.Tensor] = {}

    def reload(self, pairs) -> None:
        for name, t in pairs:
            self.kept[name] = t
            self.weights[name] = t.clone()


@pytest.mark.parametrize("mode", ["local", "collective"])
def test_without_weight_cache_stable_tensors_reach_the_reload_uncopied(mode):
    """weight_cache off: tensors in the PS's registered chunks (stable until Done) are handed over
    as views; outputs stay exact, no host copy is kept, and the checksum says why it is absent."""
    cfg = ParameterServerConfig(
        transport="cpu",
        update=UpdateConfig(bucket_size_bytes=16 * 1024, engine_timeout_s=20, engine_connect_timeout_s=20, mode=mode),
    )
    server = ParameterServer(rank=0, world_size=1, config=cfg)
    model = AliasingModel()
    r = make_receiver(model, weight_cache=False)
    try:
        for v, seed in enumerate((1, 2), start=1):
            ckpt = make_ckpt(seed)
            push(server, r, f"v{v}", ckpt)
            assert_same(model.weights, ckpt)
            last = r.report()["last_update"]
            # world size 1: every tensor is in the owner's own chunks, which its engine maps
            assert last["num_zero_copy"] == len(ckpt)
            assert len(r.cache) == 0 and r.report()["cache_bytes"] == 0
            mapped = [(m.data_ptr(), m.data_ptr() + m.numel()) for _, m, _ in r.mappings._maps.values()]
            for name, t in model.kept.items():  # each one aliases a mapped PS segment
                start = t.data_ptr()
                assert any(lo <= start < hi for lo, hi in mapped), name
            assert r.checksum_report()["checksum"] is None
            assert "weight_cache off" in r.checksum_report()["definition"]
    finally:
        server.close()


def test_without_weight_cache_an_abort_is_reported_and_the_next_update_restores(ps):
    model = DictModel()
    r = make_receiver(model, weight_cache=False)
    _, b = push_a_then_fail_b(ps, r)
    rep = r.report()
    assert (rep["status"], rep["weights_complete"]) == ("incomplete", False)
    assert "weight_cache is off" in rep["reload_error"]
    push(ps, r, "B", b)
    assert_same(model.weights, b)
    assert (r.report()["status"], r.report()["reload_error"]) == ("ready", None)


def test_weight_cache_must_be_a_bool():
    with pytest.raises(ValueError, match="weight_cache must be true or false"):
        ReceiverConfig(weight_cache="no")


class OrderedModel(AliasingModel):
    """Also records, per reload call, how many buckets the PS had sent when the call began."""

    def __init__(self):
        super().__init__()
        self.calls: list[list[str]] = []

    def reload(self, pairs) -> None:
        pairs = list(pairs)
        self.calls.append([name for name, _ in pairs])
        super().reload(pairs)


def test_load_per_bucket_hands_double_buffer_tensors_over_uncopied():
    """The load step's mode: every bucket, including those in the PS's double buffer (overwritten two
    buckets later), goes to the reload as views and is loaded before its Ack; the weights are exact."""
    cfg = ParameterServerConfig(
        transport="cpu",
        update=UpdateConfig(
            bucket_size_bytes=16 * 1024, engine_timeout_s=20, engine_connect_timeout_s=20, mode="collective"
        ),
    )
    server = ParameterServer(rank=0, world_size=1, config=cfg)
    server._transport.engines_map_host_chunks = False  # as for an owner on another rank: the double buffer
    model = OrderedModel()
    r = WeightReceiver(
        model.reload,
        config=ReceiverConfig(timeout_s=20, reload_timeout_s=20, weight_cache=False),
        load_per_bucket=True,
    )
    try:
        ckpt = make_ckpt(3)
        push(server, r, "v1", ckpt)
        assert_same(model.weights, ckpt)
        last = r.report()["last_update"]
        assert last["mode"] == "bucket" and last["num_buckets"] >= 4, last
        assert len(model.calls) == last["num_buckets"]  # one reload call per bucket
        assert last["num_zero_copy"] == len(ckpt) and len(r.cache) == 0
        (double_buffer,) = [m for _, m, _ in r.mappings._maps.values()]
        lo, hi = double_buffer.data_ptr(), double_buffer.data_ptr() + double_buffer.numel()
        assert all(lo <= t.data_ptr() < hi for t in model.kept.values())  # views, not copies
    finally:
        server.close()


def test_load_per_bucket_failure_aborts_with_the_reason(ps):
    model = DictModel()
    model.fail_after = 0
    r = WeightReceiver(
        model.reload, config=ReceiverConfig(timeout_s=20, reload_timeout_s=20, weight_cache=False), load_per_bucket=True
    )
    with pytest.raises(UpdateFailed, match="reload path failed: KeyError"):
        push(ps, r, "A", make_ckpt(1))
    assert r.report()["status"] == "incomplete"


class SlotModel:
    """A fake engine model with real parameters: its loader copies each tensor into its own slot
    (what `SlotProbe` recognises). Records each load call's names."""

    def __init__(self, ckpt: dict[str, torch.Tensor]):
        self.params = {n: torch.empty_like(t) for n, t in ckpt.items()}
        self.calls: list[list[str]] = []

    def reload(self, pairs) -> None:
        pairs = list(pairs)
        self.calls.append([n for n, _ in pairs])
        for name, t in pairs:
            self.params[name].copy_(t)


def hint_of(ckpt: dict[str, torch.Tensor]) -> list[tuple[str, str, list[int]]]:
    return [(n, dtype_name(t.dtype), list(t.shape)) for n, t in ckpt.items()]


def load_step_receiver(model: SlotModel) -> WeightReceiver:
    config = ReceiverConfig(timeout_s=20, reload_timeout_s=20, weight_cache=False)
    return WeightReceiver(model.reload, config=config, load_per_bucket=True)


def test_a_probe_ahead_finds_every_slot_before_the_update_which_then_probes_nothing(ps):
    ckpt = make_ckpt(4)
    model = SlotModel(ckpt)
    r = load_step_receiver(model)
    r.probe_ahead(hint_of(ckpt))
    assert model.calls == [list(ckpt)]  # the probe: one run of the loaders, its copies left out
    assert all(r._slot_probe.holds(n, p) for n, p in model.params.items())
    push(ps, r, "v1", ckpt)
    assert_same(model.params, ckpt)
    last = r.report()["last_update"]
    assert (last["probed_ahead"], last["probed_in_update"]) == (len(ckpt), 0), last


def test_an_update_that_leaves_out_a_tensor_probed_ahead_is_refused_naming_it(ps):
    """The probe ran that tensor's loaders: loading on would count a parameter whose bytes never came."""
    ckpt = make_ckpt(5)
    extra = {"layers.99.w": torch.zeros(3, 4)}
    model = SlotModel({**ckpt, **extra})
    r = load_step_receiver(model)
    r.probe_ahead(hint_of({**ckpt, **extra}))
    with pytest.raises(UpdateFailed, match=r"left out 1 tensor\(s\) of the version.*'layers\.99\.w'"):
        push(ps, r, "v1", ckpt)
    assert r.report()["status"] == "incomplete"


def test_a_hint_with_an_unknown_dtype_is_ignored_with_a_warning(caplog):
    model = SlotModel({"w": torch.zeros(2)})
    r = load_step_receiver(model)
    with caplog.at_level(logging.WARNING, logger="vllm_ext.receiver"):
        r.probe_ahead([("w", "float33", [2])])
    assert "ignoring the pull hint's tensors" in caplog.text and "float33" in caplog.text
    assert model.calls == [] and r._owed == set()
    with pytest.raises(RuntimeError, match="only an engine's load step probes ahead"):
        WeightReceiver(model.reload).probe_ahead(hint_of({"w": torch.zeros(2)}))


# -- delta updates (checkpoint_engine.sharding.delta_sync) into the receiver ----------------------------


def bf16_versions(num: int, lr: float = 1e-5) -> list[dict[str, torch.Tensor]]:
    """bf16 casts of float32 weights after AdamW steps on random gradients: what an engine serves
    after each RL step."""
    from testing.weight_versions import adamw_bf16_versions

    g = torch.Generator().manual_seed(3)
    master = {f"layers.{i}.w": torch.randn(96, 64, generator=g).requires_grad_(True) for i in range(6)}
    master["norm"] = torch.ones(64).requires_grad_(True)
    return adamw_bf16_versions(master, num, lr, g)


def delta_sync(ps, receiver: WeightReceiver):
    from checkpoint_engine.sharding.delta_sync import DeltaSync

    def req_func(paths):
        try:
            receiver.receive(paths[0][1], None)
        finally:
            assert receiver.wait_idle(30)

    return DeltaSync(ps, req_func, lambda: receiver.state.report()["checkpoint"])


@pytest.mark.parametrize("mode", ["streaming", "end"])
def test_deltas_land_exactly_and_the_whole_model_is_reloaded(ps, mode):
    model = DictModel()
    r = make_receiver(model, mode)
    sync = delta_sync(ps, r)
    versions = bf16_versions(3)
    first = sync.push("v1", versions[0])
    assert first.kind == "full" and r.last_update["delta"] is None
    for i, version in enumerate(("v2", "v3"), start=1):
        pushed = sync.push(version, versions[i])
        assert pushed.kind == "delta", pushed.reason
        assert_same(model.weights, versions[i])  # every tensor reloaded, the changed ones exact
        assert r.state.report()["checkpoint"] == version and r.state.report()["status"] == "ready"
        delta = r.last_update["delta"]
        assert delta["base"] == ("v1" if i == 1 else "v2") and delta["nbytes"] == pushed.nbytes
        assert pushed.nbytes < 0.5 * first.nbytes
        assert r.last_update["num_tensors"] == len(versions[i])
    # the cache now is the version held: its checksum equals the checkpoint's
    assert r.checksum_report()["checksum"] == checkpoint_checksum(versions[2])


def test_a_delta_onto_a_cache_that_is_not_the_base_is_refused_and_the_full_version_follows(ps):
    model = DictModel()
    r = make_receiver(model)
    sync = delta_sync(ps, r)
    versions = bf16_versions(2)
    sync.push("v1", versions[0])
    r.cache.get("layers.2.w").view(-1)[0] += 1  # the engine's copy of v1 no longer is v1
    pushed = sync.push("v2", versions[1])
    assert (pushed.kind, pushed.tried_delta) == ("full", True)
    assert "refused the delta" in pushed.reason and "layers.2.w" in pushed.reason
    assert_same(model.weights, versions[1])
    assert r.checksum_report()["checksum"] == checkpoint_checksum(versions[1])


def test_without_a_weight_cache_a_delta_is_refused_saying_why(ps):
    model = DictModel()
    r = make_receiver(model, weight_cache=False)
    sync = delta_sync(ps, r)
    versions = bf16_versions(2)
    sync.push("v1", versions[0])
    pushed = sync.push("v2", versions[1])
    assert (pushed.kind, pushed.tried_delta) == ("full", True)
    assert "weight_cache off" in pushed.reason
    assert_same(model.weights, versions[1])


def test_a_tensor_parallel_worker_refuses_a_delta_only_without_a_slice_plan():
    r = make_receiver(DictModel())
    r.cache.store("w", torch.zeros(2))
    r.cache.matches_model = True
    assert r.delta_refusal() is None
    r.cache_sliced = True  # its last full update read only its slices
    assert "knows no slice plan" in r.delta_refusal()
    r.read_slices(lambda items: {n: (SourceSlice(n),) for n, _, _ in items})
    assert r.delta_refusal() is None  # it applies a delta cut along its slices
    assert "sharded pull" in r.checksum_report()["definition"]
    r.cache_sliced = False
    assert "does not hold the weights it serves" in r.delta_refusal(cache_matches_model=False)
