"""Metrics where RL users look: the TensorBoard sink (tensorboardX's event files, read back with
TensorBoard's own reader; resume without duplicate steps) and the optional W&B sink (against a stand-in
``wandb`` module), and their config."""

import json
import pathlib
import re
import sys
import time
import types

import pytest
from tensorboard.backend.event_processing import event_accumulator, event_file_loader
from tensorboardX import SummaryWriter

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


def _accumulator(logdir):
    """TensorBoard's reader over every event file of ``logdir``, as its UI reads a run (all scalars kept)."""
    accumulator = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    return accumulator


def _shown(logdir, tag="heldout_accuracy"):
    """(step, value) of ``tag`` as TensorBoard shows it, in the order it draws them."""
    accumulator = _accumulator(logdir)
    if tag not in accumulator.Tags()["scalars"]:
        return []
    return [(e.step, round(e.value, 5)) for e in accumulator.Scalars(tag)]


def _files(logdir):
    """The event files of ``logdir`` in the order TensorBoard reads them (by name)."""
    logdir = pathlib.Path(logdir)
    return sorted(p for p in logdir.iterdir() if "tfevents" in p.name) if logdir.is_dir() else []


def _raw_steps(logdir, tag="heldout_accuracy"):
    """The steps of every ``tag`` event in the files, nothing dropped (what a purge hides is still there)."""
    return [
        event.step
        for path in _files(logdir)
        for event in event_file_loader.LegacyEventFileLoader(str(path)).Load()
        if any(v.tag == tag for v in event.summary.value)
    ]


def _file_with_steps(logdir, steps, offset=0.0):
    """An event file written as another run's SummaryWriter would have (no purge step)."""
    writer = SummaryWriter(str(logdir), filename_suffix=f".{time.time_ns()}")
    for step in steps:
        for tag, value in scalars(_record(step, heldout_accuracy=step / 10 + offset)).items():
            writer.add_scalar(tag, value, step)
    writer.close()
    return _files(logdir)[-1]


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


# -- the TensorBoard sink ---------------------------------------------------------------------------
def test_the_sink_writes_what_tensorboard_reads(tmp_path):
    logdir = tmp_path / "tb"
    sink = TensorBoardSink(logdir)
    sink.resume(0, [])
    assert _files(logdir) == []  # no file before the first event
    first = _record(1)
    second = _record(2, heldout_accuracy=1 / 3, big=1e300, neg=-2.0)
    before = time.time()
    sink.write(first)
    sink.write(second)
    sink.close()
    (path,) = _files(logdir)
    assert re.fullmatch(r"events\.out\.tfevents\.\d{10}\..+\.\d+\.\d+", path.name)
    accumulator = _accumulator(logdir)
    assert set(accumulator.Tags()["scalars"]) == set(scalars(first)) | set(scalars(second))
    assert "heldout_accuracy_by_level/4" in scalars(first) and "mean_reward" not in scalars(first)
    for record in (first, second):
        for tag, value in scalars(record).items():
            (event,) = [e for e in accumulator.Scalars(tag) if e.step == record["iteration"]]
            assert event.value == pytest.approx(value, rel=1e-6) or value > 3.5e38  # float32
            assert before - 1 <= event.wall_time <= time.time() + 1
    assert [e.value for e in accumulator.Scalars("big")] == [float("inf")]
    assert _shown(logdir, "heldout_accuracy_by_level/4") == [(1, 0.125), (2, 0.125)]


def test_two_starts_in_one_second_write_two_files_in_their_order(tmp_path):
    for step in (1, 2, 3):  # within a second: tensorboardX's own names alone would be the same file
        sink = TensorBoardSink(tmp_path)
        sink.resume(step - 1, [_record(i, heldout_accuracy=i / 10) for i in range(1, step)])
        sink.write(_record(step, heldout_accuracy=step / 10))
        sink.close()
    assert len(_files(tmp_path)) == 3
    assert _raw_steps(tmp_path) == [1, 2, 3]  # one step per file, in the files' name order
    assert _shown(tmp_path) == [(1, 0.1), (2, 0.2), (3, 0.3)]


@pytest.mark.parametrize("package", ["tensorboardX", "tensorboard"])
def test_the_sink_needs_tensorboardx_and_tensorboard(tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # not importable
    with pytest.raises(
        ValueError, match=rf"metrics.tensorboard=true needs .*{package} cannot be imported.*pip install"
    ):
        make_sinks(load_config(None, []).metrics, tmp_path)
    assert make_sinks(load_config(None, ["metrics.tensorboard=false"]).metrics, tmp_path).sinks == []


def test_tensorboard_resume_after_a_crash_writes_no_step_twice(tmp_path):
    """The run wrote steps 1-5 and died with its checkpoint at 3 (the last record torn): the rerun's
    steps 4-6 replace the old 4-5; TensorBoard shows every step once, with the rerun's values."""
    logdir = tmp_path / "tensorboard"
    history = [_record(i, heldout_accuracy=i / 10) for i in range(1, 6)]
    sink = TensorBoardSink(logdir)
    sink.resume(0, [])
    for record in history:
        sink.write(record)
    sink.close()
    (old,) = _files(logdir)
    old.write_bytes(old.read_bytes()[:-3])  # killed inside the last record
    assert [s for s, _ in _shown(logdir)] == [1, 2, 3, 4, 5]
    assert _shown(logdir, "weight_sync_s")[-1][0] == 4  # step 5's last event is the torn one

    sink = TensorBoardSink(logdir)
    sink.resume(3, history[:3])  # metrics.jsonl already cut to the checkpoint
    for i in (4, 5, 6):
        sink.write(_record(i, heldout_accuracy=i / 10 + 0.5))
    sink.close()
    assert len(_files(logdir)) == 2  # the old file, untouched, and the rerun's
    assert _raw_steps(logdir) == [1, 2, 3, 4, 5, 4, 5, 6]  # both files hold 4 and 5 ...
    expected = [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.9), (5, 1.0), (6, 1.1)]
    assert _shown(logdir) == expected  # ... TensorBoard shows the rerun's once
    accumulator = _accumulator(logdir)
    for tag in accumulator.Tags()["scalars"]:
        steps = [e.step for e in accumulator.Scalars(tag)]
        assert steps == sorted(set(steps)), (tag, steps)  # no tag has a step twice, none out of order

    # and again: died after step 6 with the checkpoint at 5; the rerun's 6 replaces the 6 above
    history = [_record(i, heldout_accuracy=v) for i, v in expected[:5]]
    sink = TensorBoardSink(logdir)
    sink.resume(5, history)
    sink.write(_record(6, heldout_accuracy=2.0))
    sink.close()
    assert _shown(logdir) == expected[:5] + [(6, 2.0)]


def test_tensorboard_catches_up_on_steps_it_lacks(tmp_path):
    history = [_record(i, heldout_accuracy=i / 10) for i in range(1, 4)]
    # turned on at a resume: the history of metrics.jsonl is written first
    logdir = tmp_path / "late"
    sink = TensorBoardSink(logdir)
    sink.resume(3, history)
    sink.write(_record(4, heldout_accuracy=0.4))
    sink.close()
    assert _shown(logdir) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert len(_files(logdir)) == 1
    # killed between metrics.jsonl and the event file: step 3 goes into the new file
    logdir = tmp_path / "gap"
    old = _file_with_steps(logdir, [1, 2])
    sink = TensorBoardSink(logdir)
    sink.resume(3, history)
    sink.close()
    assert _shown(logdir) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert _raw_steps(logdir) == [1, 2, 3] and len(_files(logdir)) == 2
    # a start with nothing to catch up on or to drop leaves no file
    sink = TensorBoardSink(logdir)
    sink.resume(3, history)
    sink.close()
    assert len(_files(logdir)) == 2
    # a damaged record ends what TensorBoard reads of its file: the steps after it are rewritten
    logdir = tmp_path / "damaged"
    old = _file_with_steps(logdir, [1, 2, 3])
    data = bytearray(old.read_bytes())
    data[-1] ^= 0xFF  # the CRC of step 3's last event
    old.write_bytes(bytes(data))
    sink = TensorBoardSink(logdir)
    sink.resume(3, history)
    sink.close()
    assert _shown(logdir, "weight_sync_s") == [(1, 0.01), (2, 0.01), (3, 0.01)]
    assert _shown(logdir) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    # a fresh start (no checkpoint) over event files of a run that never saved one: all of them hidden
    sink = TensorBoardSink(logdir)
    sink.resume(0, [])
    sink.close()
    assert _shown(logdir) == [] and _raw_steps(logdir)  # still in the files, not shown


def test_tensorboard_rewrites_duplicated_or_holed_history_from_the_jsonl(tmp_path):
    history = [_record(i, heldout_accuracy=i / 10) for i in range(1, 5)]
    logdir = tmp_path / "dup"
    _file_with_steps(logdir, [1, 2], offset=0.01)
    _file_with_steps(logdir, [2, 3], offset=0.01)  # step 2 twice (e.g. files copied in by hand)
    assert [s for s, _ in _shown(logdir)] == [1, 2, 2, 3]
    sink = TensorBoardSink(logdir)
    sink.resume(4, history)
    sink.close()
    assert sink.purge_step == 2
    assert _shown(logdir) == [(1, 0.11), (2, 0.2), (3, 0.3), (4, 0.4)]  # from the first step held twice on
    logdir = tmp_path / "hole"
    _file_with_steps(logdir, [1])
    _file_with_steps(logdir, [4])  # steps 2-3 lost, a later step 4 there: appending them would draw back
    sink = TensorBoardSink(logdir)
    sink.resume(4, history)
    sink.close()
    assert sink.purge_step == 2
    assert _shown(logdir) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]


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
