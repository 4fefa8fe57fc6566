"""Metrics where RL users look: hand-written TensorBoard event files (format, checks, resume without
duplicate steps) and the optional W&B sink (against a stand-in ``wandb`` module), and their config."""

import json
import re
import struct
import sys
import types

import pytest

from orchestrator.config import load_config
from orchestrator.loop_setup import check_resumable
from orchestrator.metric_sinks.sinks import (
    WANDB_STATE_FILE,
    MetricsSink,
    MetricsSinks,
    TensorBoardSink,
    WandbSink,
    make_sinks,
    scalars,
)
from orchestrator.metric_sinks.tb_events import (
    FILE_VERSION,
    CorruptEventFile,
    EventFileWriter,
    crc32c,
    decode_event,
    encode_event,
    event_files,
    frame,
    masked_crc32c,
    read_events,
    read_records,
    truncate_events,
)


def _record(iteration, **extra):
    """A metrics record like the loop's: numbers, None, a bool, a nested mapping, a list, a string."""
    return {
        "iteration": iteration,
        "heldout_accuracy": 0.25 + iteration / 100,
        "mean_reward": None if iteration == 1 else 0.1 * iteration,
        "evaluated": iteration % 2 == 0,
        "heldout_accuracy_by_level": {"2": 0.5, "4": 0.125},
        "recovery_s": [1.0, 2.0],
        "engine_states": {"e0": "serving"},
        "weight_sync_s": 0.01,
        **extra,
    }


def _steps(logdir):
    """(step, heldout_accuracy) of every scalar event in every file of ``logdir``, files oldest first."""
    return [
        (e.step, round(e.scalars["heldout_accuracy"], 5))
        for path in event_files(logdir)
        for e in read_events(path)
        if e.scalars
    ]


# -- the format -------------------------------------------------------------------------------------
def test_crc32c_known_vectors():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert crc32c(b"\xff" * 32) == 0x62A8AB43  # ... and of ones
    # TFRecord's mask: rotate right by 15, add 0xa282ead8 (mod 2^32)
    assert masked_crc32c(b"123456789") == 0xC78AB0E5


def test_a_record_is_length_crc_data_crc():
    data = b"hello"
    record = frame(data)
    assert record[:8] == struct.pack("<Q", 5)
    assert struct.unpack("<I", record[8:12])[0] == masked_crc32c(record[:8])
    assert record[12:17] == data
    assert struct.unpack("<I", record[17:])[0] == masked_crc32c(data)


def test_events_round_trip_through_a_file(tmp_path):
    writer = EventFileWriter(tmp_path / "tb")
    assert event_files(tmp_path / "tb") == []  # no file before the first event
    writer.add_scalars(1, {"loss": 0.5, "acc": 0.25}, wall_time=1000.5)
    writer.add_scalars(2, {"loss": 1 / 3, "big": 1e300, "neg": -2.0})
    writer.close()
    (path,) = event_files(tmp_path / "tb")
    assert path == writer.path
    assert re.fullmatch(r"events\.out\.tfevents\.\d+\..+\.\d+\.\d+", path.name)
    header, first, second = read_events(path)
    assert header.file_version == FILE_VERSION and not header.scalars
    assert (first.step, first.wall_time, first.scalars) == (1, 1000.5, {"loss": 0.5, "acc": 0.25})
    assert second.step == 2 and second.scalars["loss"] == pytest.approx(1 / 3, rel=1e-6)  # float32
    assert second.scalars["big"] == float("inf") and second.scalars["neg"] == -2.0
    # a second writer in the same folder and second never writes onto the first's file
    other = EventFileWriter(tmp_path / "tb")
    other.add_scalars(3, {"loss": 0.0})
    other.close()
    assert len(event_files(tmp_path / "tb")) == 2


def test_the_encoding_matches_protobuf():
    """An independent reading: protobuf's own parser, on a message type built from the Event fields."""
    pytest.importorskip("google.protobuf")
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="tb_event_test.proto", package="tbtest")
    value = proto.message_type.add(name="Value")
    value.field.add(name="tag", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL)
    summary = proto.message_type.add(name="Summary")
    summary.field.add(name="value", number=1, type=F.TYPE_MESSAGE, type_name=".tbtest.Value", label=F.LABEL_REPEATED)
    event = proto.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    event.field.add(name="summary", number=5, type=F.TYPE_MESSAGE, type_name=".tbtest.Summary", label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    Event = message_factory.GetMessageClass(pool.FindMessageTypeByName("tbtest.Event"))

    parsed = Event.FromString(encode_event(12.25, step=300, scalars={"a": 0.5, "b/c": -4.0}))
    assert (parsed.wall_time, parsed.step) == (12.25, 300)
    assert [(v.tag, v.simple_value) for v in parsed.summary.value] == [("a", 0.5), ("b/c", -4.0)]
    assert Event.FromString(encode_event(1.0, file_version=FILE_VERSION)).file_version == FILE_VERSION
    for step in (0, 2**40, -3):  # int64: large, and negative as ten varint bytes
        assert Event.FromString(encode_event(1.0, step=step)).step == step
        assert decode_event(encode_event(1.0, step=step)).step == step
    # and the other way: protobuf's bytes (also a negative int64) decoded here
    message = Event(wall_time=3.5, step=-7)
    message.summary.value.add(tag="x", simple_value=1.5)
    decoded = decode_event(message.SerializeToString())
    assert (decoded.wall_time, decoded.step, decoded.scalars) == (3.5, -7, {"x": 1.5})


def _file_with_steps(logdir, steps, offset=0.0):
    writer = EventFileWriter(logdir)
    for step in steps:
        writer.add_scalars(step, scalars(_record(step, heldout_accuracy=step / 10 + offset)))
    writer.close()
    return writer.path


def test_a_flipped_byte_fails_a_crc(tmp_path):
    path = _file_with_steps(tmp_path, [1, 2, 3])
    good = path.read_bytes()
    sizes = [12 + len(r) + 4 for r in read_records(path)]
    second = sizes[0]  # where the second record (step 1) starts
    for where, message in [(second + 2, "length that fails its CRC"), (second + 12 + 5, "data that fails its CRC")]:
        bad = bytearray(good)
        bad[where] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptEventFile, match=f"record at byte {second} has (a )?{message}"):
            read_records(path)
        # a resumed run keeps what comes before the damage: the header only
        assert len(read_records(path, tolerate_damaged_tail=True)) == 1


def test_a_torn_last_record_is_an_error_or_dropped(tmp_path):
    path = _file_with_steps(tmp_path, [1, 2])
    path.write_bytes(path.read_bytes()[:-7])  # the writer killed inside the last record
    with pytest.raises(CorruptEventFile, match="torn"):
        read_records(path)
    assert [e.step for e in read_events(path, tolerate_damaged_tail=True)] == [0, 1]


def test_truncate_drops_later_steps_and_empty_files(tmp_path):
    path = _file_with_steps(tmp_path, [1, 2, 3, 4, 5])
    before = path.read_bytes()
    kept, dropped = truncate_events(path, 5)
    assert dropped == 0 and path.read_bytes() == before  # nothing to drop: not rewritten
    kept, dropped = truncate_events(path, 3)
    assert dropped == 2 and [e.step for e in kept if e.scalars] == [1, 2, 3]
    assert [s for s, _ in _steps(tmp_path)] == [1, 2, 3]
    assert before.startswith(path.read_bytes())  # the kept records byte for byte
    kept, dropped = truncate_events(path, 0)
    assert (kept, dropped) == ([], 3) and not path.exists()


# -- the TensorBoard sink ---------------------------------------------------------------------------
def test_scalars_keep_finite_numbers_by_jsonl_key():
    record = {
        "iteration": 3,
        "a": 1,
        "b": 0.5,
        "flag": True,
        "none": None,
        "nan": float("nan"),
        "inf": float("inf"),
        "text": "x",
        "list": [1, 2],
        "by_level": {"2": 0.5, "7": None, "deep": {"x": 2}},
    }
    assert scalars(record) == {
        "iteration": 3.0,
        "a": 1.0,
        "b": 0.5,
        "flag": 1.0,
        "by_level/2": 0.5,
        "by_level/deep/x": 2.0,
    }


def test_tensorboard_resume_after_a_crash_writes_no_step_twice(tmp_path):
    """The run wrote steps 1-5 and died with its checkpoint at 3 (the last record torn): the rerun's
    steps 4-6 replace the old 4-5; every step is in exactly one file, with the rerun's values."""
    logdir = tmp_path / "tensorboard"
    history = [_record(i, heldout_accuracy=i / 10) for i in range(1, 6)]
    sink = TensorBoardSink(logdir)
    sink.resume(0, [])
    for record in history:
        sink.write(record)
    sink.close()
    (old,) = event_files(logdir)
    old.write_bytes(old.read_bytes()[:-3])
    assert [s for s, _ in _steps_tolerant(logdir)] == [1, 2, 3, 4]

    sink = TensorBoardSink(logdir)
    sink.resume(3, history[:3])  # metrics.jsonl already cut to the checkpoint
    for i in (4, 5, 6):
        sink.write(_record(i, heldout_accuracy=i / 10 + 0.5))
    sink.close()
    assert _steps(logdir) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.9), (5, 1.0), (6, 1.1)]
    assert len(event_files(logdir)) == 2  # the old file (cut, rewritten) and the rerun's


def _steps_tolerant(logdir):
    return [(e.step, 0) for p in event_files(logdir) for e in read_events(p, tolerate_damaged_tail=True) if e.scalars]


def test_tensorboard_catches_up_on_steps_it_lacks(tmp_path):
    history = [_record(i, heldout_accuracy=i / 10) for i in range(1, 4)]
    # turned on at a resume: the history of metrics.jsonl is written first
    logdir = tmp_path / "late"
    sink = TensorBoardSink(logdir)
    sink.resume(3, history)
    sink.write(_record(4, heldout_accuracy=0.4))
    sink.close()
    assert _steps(logdir) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert len(event_files(logdir)) == 1
    # killed between metrics.jsonl and the event file: step 3 is appended in the new file
    logdir = tmp_path / "gap"
    _file_with_steps(logdir, [1, 2])
    sink = TensorBoardSink(logdir)
    sink.resume(3, history)
    sink.close()
    assert _steps(logdir) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    # a fresh start (no checkpoint) over event files of a run that never saved one: all dropped
    sink = TensorBoardSink(logdir)
    sink.resume(0, [])
    sink.close()
    assert event_files(logdir) == []


def test_tensorboard_rewrites_duplicated_or_holed_history_from_the_jsonl(tmp_path):
    history = [_record(i, heldout_accuracy=i / 10) for i in range(1, 5)]
    logdir = tmp_path / "dup"
    _file_with_steps(logdir, [1, 2], offset=0.01)
    _file_with_steps(logdir, [2, 3], offset=0.01)  # step 2 twice (e.g. files copied in by hand)
    sink = TensorBoardSink(logdir)
    sink.resume(4, history)
    sink.close()
    assert _steps(logdir) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    logdir = tmp_path / "hole"
    path = _file_with_steps(logdir, [1, 2, 3])
    data = bytearray(path.read_bytes())
    sizes = [12 + len(r) + 4 for r in read_records(path)]
    data[sizes[0] + sizes[1] + 20] ^= 0xFF  # step 2 damaged: steps 2-3 lost, a later step 4 file exists
    path.write_bytes(bytes(data))
    _file_with_steps(logdir, [4])
    sink = TensorBoardSink(logdir)
    sink.resume(4, history)
    sink.close()
    assert _steps(logdir) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]


def test_a_failing_sink_does_not_stop_the_others(caplog):
    written = []

    class Broken(MetricsSink):
        name = "broken"

        def write(self, record):
            raise OSError("disk full")

    class Kept(MetricsSink):
        def write(self, record):
            written.append(record["iteration"])

    sinks = MetricsSinks([Broken(), Kept()])
    sinks.write(_record(1))
    assert written == [1]
    assert "metrics sink broken could not write iteration 1: disk full" in caplog.text


# -- W&B --------------------------------------------------------------------------------------------
class FakeRun:
    def __init__(self, **init):
        self.init = init
        self.logged = []
        self.finished = False

    def log(self, data, step):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module in sys.modules: records every run it starts."""
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        module.runs.append(FakeRun(**kwargs))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_wandb_gets_the_same_keys_and_steps_and_resumes_its_run(fake_wandb, tmp_path):
    config = load_config(None, ["metrics.wandb=true", "metrics.wandb_project=my-rl", "metrics.tensorboard=false"])
    sinks = make_sinks(config.metrics, tmp_path, {"rl": {"lr": 0.1}})
    (sink,) = sinks.sinks
    assert isinstance(sink, WandbSink)
    history = [_record(i) for i in range(1, 6)]
    sinks.resume(0, [])
    for record in history:
        sinks.write(record)
    sinks.close()
    (run,) = fake_wandb.runs
    assert run.finished
    assert run.init == {
        "project": "my-rl",
        "id": sink.run_id,
        "resume": "allow",
        "mode": "offline",
        "dir": str(tmp_path),
        "config": {"rl": {"lr": 0.1}},
    }
    assert [step for step, _ in run.logged] == [1, 2, 3, 4, 5]
    assert all(data == scalars(r) for (_, data), r in zip(run.logged, history))
    assert "mean_reward" not in run.logged[0][1] and run.logged[1][1]["mean_reward"] == pytest.approx(0.2)
    state = json.loads((tmp_path / WANDB_STATE_FILE).read_text())
    assert state == {"id": sink.run_id, "project": "my-rl", "last_step": 5}

    # died with its checkpoint at 3: the same run continues; steps W&B already has are not sent again
    sinks = make_sinks(config.metrics, tmp_path, {"rl": {"lr": 0.1}})
    sinks.resume(3, history[:3])
    for i in (4, 5, 6):
        sinks.write(_record(i))
    sinks.close()
    rerun = fake_wandb.runs[1]
    assert rerun.init["id"] == sink.run_id and rerun.init["resume"] == "allow" and rerun.init["config"] is None
    assert [step for step, _ in rerun.logged] == [6]


def test_wandb_turned_on_at_a_resume_sends_the_history_first(fake_wandb, tmp_path):
    sink = WandbSink(tmp_path, "p", "online", wandb=fake_wandb)
    sink.resume(2, [_record(1), _record(2)])
    sink.write(_record(3))
    (run,) = fake_wandb.runs
    assert run.init["mode"] == "online"
    assert [step for step, _ in run.logged] == [1, 2, 3]
    # another project: a new run, from the start of the history
    sink = WandbSink(tmp_path, "q", "offline", wandb=fake_wandb)
    sink.resume(3, [_record(1), _record(2), _record(3)])
    assert fake_wandb.runs[1].init["id"] != run.init["id"]
    assert [step for step, _ in fake_wandb.runs[1].logged] == [1, 2, 3]


# -- config -----------------------------------------------------------------------------------------
def test_metrics_config_defaults_and_errors(monkeypatch):
    metrics = load_config(None, []).metrics
    assert (metrics.tensorboard, metrics.wandb, metrics.wandb_project, metrics.wandb_mode) == (
        True,
        False,
        "ckpt-rl",
        "offline",
    )
    with pytest.raises(ValueError, match="metrics.wandb_mode='x' must be 'offline' or 'online'"):
        load_config(None, ["metrics.wandb_mode=x"])
    with pytest.raises(ValueError, match="metrics.tensorboard='yes' must be true or false"):
        load_config(None, ["metrics.tensorboard=yes"])
    with pytest.raises(ValueError, match="metrics.wandb_project='a/b' must be a W&B project name"):
        load_config(None, ["metrics.wandb_project=a/b"])
    with pytest.raises(ValueError, match="unknown|metrics.colour"):
        load_config(None, ["metrics.colour=1"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable
    with pytest.raises(ValueError, match=r"metrics.wandb=true needs the wandb package.*pip install wandb"):
        load_config(None, ["metrics.wandb=true"])
    assert load_config(None, ["metrics.wandb=false"]).metrics.wandb is False
    with pytest.raises(ValueError, match="pip install wandb"):
        WandbSink(".", "p", "offline")  # the sink imports it itself: the same message


def test_a_resume_may_change_the_metrics_section_or_lack_it():
    from ckpt_common.dictconfig import to_dict

    current = to_dict(load_config(None, []))
    saved = {k: v for k, v in current.items() if k != "metrics"}  # a run saved before the section existed
    check_resumable(saved, current)
    check_resumable(current, to_dict(load_config(None, ["metrics.tensorboard=false", "metrics.wandb_mode=online"])))
    with pytest.raises(ValueError, match=r"different config \(rl.lr\).*and metrics\.\* may change"):
        check_resumable(saved, to_dict(load_config(None, ["rl.lr=0.5"])))
