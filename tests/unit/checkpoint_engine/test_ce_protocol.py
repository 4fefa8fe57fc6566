import msgpack
import pytest

from checkpoint_engine import protocol as P
from checkpoint_engine.config import ParameterServerConfig, UpdateConfig
from checkpoint_engine.state import EngineWeightState, StateError

MESSAGES = [
    P.Hello(
        update_id="u1",
        checkpoint="ck",
        num_buckets=3,
        buffers=(
            P.BufferHandle(kind="fd", size_bytes=1024, pid=12, fd=7),
            P.BufferHandle(kind="fd", size_bytes=4096, pid=13, fd=9),
        ),
        verify_checksums=True,
        stable_buffers=(1,),
    ),
    P.Hello(
        update_id="u2",
        checkpoint="ck",
        num_buckets=1,
        buffers=(P.BufferHandle(kind="cuda", size_bytes=64, cuda_args=(0, b"\x01\x02", 64, 0, b"rc", 0, b"ev", True)),),
    ),
    P.Hello(
        update_id="u3",
        checkpoint="ck",
        num_buckets=2,
        buffers=(
            P.BufferHandle(kind="fd", size_bytes=64, pid=12, fd=7),
            P.BufferHandle(kind="remote", size_bytes=4096, peer="10.0.0.1:15000", ptr=0x7F0000001000),
        ),
        stable_buffers=(0,),
        p2p_host="10.0.0.2",
    ),
    P.Bucket(
        index=2, tensors=(P.WireTensor("a.w", "bfloat16", (3, 4), 1, 256, 17), P.WireTensor("s", "float32", (), 0, 0))
    ),
    P.Done(update_id="u1"),
    P.Abort(reason="rank 1 died"),
    P.Ready(version=4, status="receiving"),
    P.Ack(index=-1),
    P.Error(index=3, reason="boom"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_roundtrip(msg):
    assert P.decode(P.encode(msg)) == msg


@pytest.mark.parametrize(
    "body,match",
    [
        ({"t": "nope"}, "unknown message tag"),
        ({"t": "ack", "index": "3"}, "Ack.index: expected"),
        ({"t": "ack", "index": True}, "Ack.index"),
        ({"t": "ack", "index": 1, "extra": 2}, "unexpected fields"),
        ({"t": "ack"}, "Ack"),
        ({"t": "bucket", "index": 0, "tensors": [["a", "float32", [-1], 0, 0, None]]}, "malformed tensor entry"),
        ({"t": "bucket", "index": 0, "tensors": [["a", "float32", [1], 0, None]]}, "malformed tensor entry"),
        (
            {
                "t": "hello",
                "update_id": "u",
                "checkpoint": "c",
                "num_buckets": 1,
                "buffers": [{"kind": "fd", "size_bytes": 8, "pid": 0, "fd": 3}],
            },
            "needs a pid and an fd",
        ),
        (
            {
                "t": "hello",
                "update_id": "u",
                "checkpoint": "c",
                "num_buckets": 1,
                "buffers": [{"kind": "remote", "size_bytes": 8, "peer": "", "ptr": 4096}],
            },
            "remote buffer needs a peer address",
        ),
        (
            {
                "t": "hello",
                "update_id": "u",
                "checkpoint": "c",
                "num_buckets": 1,
                "buffers": [{"kind": "x", "size_bytes": 8}],
            },
            "buffer kind",
        ),
        ({"t": "hello", "update_id": "u", "checkpoint": "c", "num_buckets": 1, "buffers": []}, "non-empty list"),
        (
            {
                "t": "hello",
                "update_id": "u",
                "checkpoint": "c",
                "num_buckets": 1,
                "buffers": [{"kind": "fd", "size_bytes": 8, "pid": 1, "fd": 3}],
                "stable_buffers": [-1],
            },
            "stable_buffers",
        ),
        (
            {
                "t": "hello",
                "update_id": "u",
                "checkpoint": "c",
                "num_buckets": 1,
                "buffers": [{"kind": "fd", "size_bytes": 8, "pid": 1, "fd": 3}],
                "stable_buffers": 1,
            },
            "stable_buffers",
        ),
        (
            {
                "t": "hello",
                "update_id": "u",
                "checkpoint": "c",
                "num_buckets": 1,
                "buffers": [{"kind": "fd", "size_bytes": "8", "pid": 1, "fd": 3}],
            },
            "positive int",
        ),
    ],
)
def test_decode_rejects_malformed(body, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode(msgpack.packb(body))


def test_decode_rejects_garbage_and_never_unpickles():
    import pickle

    with pytest.raises(P.ProtocolError):
        P.decode(pickle.dumps(P.Ack(index=1)))
    with pytest.raises(P.ProtocolError):
        P.decode(b"\xc1")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bucket_size_bytes=0), "bucket_size_bytes"),
        (dict(bucket_size_bytes=1.5), "bucket_size_bytes"),
        (dict(engine_timeout_s=0), "engine_timeout_s"),
        (dict(memory_budget_bytes=-1), "memory_budget_bytes"),
        (dict(mode="p2p"), "mode must be"),
        (dict(agree_every_buckets=0), "agree_every_buckets"),
    ],
)
def test_update_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        UpdateConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(transport="tpu"), "transport"),
        (dict(align_bytes=8), "align_bytes"),
        (dict(collective_timeout_s=0), "collective_timeout_s"),
        (dict(max_chunk_bytes=0), "max_chunk_bytes"),
    ],
)
def test_ps_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParameterServerConfig(**kwargs)


def test_state_machine_walk():
    s = EngineWeightState()
    assert s.report()["status"] == "initial" and s.report()["weights_complete"]
    s.begin("a")
    assert s.report()["status"] == "receiving" and not s.report()["weights_complete"]
    with pytest.raises(StateError):
        s.begin("b")
    assert s.complete() == 1
    s.begin("b")
    s.abort("engine raised")
    r = s.report()
    assert r["status"] == "incomplete" and r["version"] == 1 and "1->2 aborted: engine raised" in r["last_error"]
    assert not r["weights_complete"]
    with pytest.raises(StateError):
        s.complete()
    s.begin("b")
    assert s.complete() == 2 and s.report()["checkpoint"] == "b" and s.report()["last_error"] is None


def test_a_delta_sent_as_another_checkpoint_names_the_version_it_brings():
    s = EngineWeightState()
    with pytest.raises(StateError):
        s.name_pending("v1")  # no update in progress
    s.begin("v1.delta")
    s.name_pending("v1")
    assert s.report()["pending_checkpoint"] == "v1"
    assert s.complete() == 1 and s.report()["checkpoint"] == "v1"
