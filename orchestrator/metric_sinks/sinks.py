"""The per-iteration metrics where RL users look: TensorBoard and Weights & Biases, beside metrics.jsonl.

::

    loop ──record──▶ MetricsLog.append (DIR/metrics.jsonl, the source of truth) ──▶ MetricsSinks.write
                                                                                      │ scalars(record)
        TensorBoardSink ──tensorboardX.SummaryWriter──▶ DIR/tensorboard/events.out.tfevents.*
                                                          (tag = JSONL key, step = iteration)
        WandbSink       ──▶ wandb.init(id from DIR/wandb_run.json, resume="allow") ──▶ run.log(step=)

    start / resume at checkpoint iteration N, with metrics.jsonl already cut to N:
        TensorBoardSink.resume: reads what TensorBoard shows of the old files (its EventAccumulator);
            P = the first step that differs from metrics.jsonl (missing, partly there, twice), else N + 1;
            the new file starts with purge_step=P (TensorBoard drops the older files' steps >= P)
            and holds metrics.jsonl's steps P..N: each step is shown once, with metrics.jsonl's values
        WandbSink.resume: the same W&B run continues; only steps > the last one it logged are sent

Every number of a record (int, float, bool; finite) is a scalar named by its JSONL key; a nested mapping
(e.g. heldout_accuracy_by_level) gives ``key/subkey``; None, strings and lists are skipped. tensorboardX
(and tensorboard's reader) are imported when the TensorBoard sink first needs them; ``wandb`` only when
``metrics.wandb`` is on (tests pass a stand-in module).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import pathlib
import secrets
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_common.fsutil import atomic_write_text

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_FLUSH_S = 5  # the writer's thread flushes the file this often (a kill loses at most these)
TENSORBOARD_PACKAGES = ("tensorboardX", "tensorboard")  # the event files' writer, and the reader resume uses
TENSORBOARD_MISSING = (
    "metrics.tensorboard=true needs the tensorboardX and tensorboard packages (the event files' writer and "
    "reader), and {} cannot be imported here: pip install tensorboardX tensorboard "
    "(or set metrics.tensorboard=false)"
)
WANDB_STATE_FILE = "wandb_run.json"  # {"id", "project", "last_step"}: the W&B run a resumed job continues
WANDB_MISSING = (
    "metrics.wandb=true needs the wandb package, which cannot be imported here: pip install wandb "
    "(or set metrics.wandb=false)"
)


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The record's finite numbers by name: ``key`` or, inside a nested mapping, ``key/subkey``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, (bool, int, float)) and math.isfinite(value):
            out[name] = float(value)
    return out


class MetricsSink:
    """Where iteration records go besides metrics.jsonl (written after it, so it is never behind)."""

    name = "sink"

    def resume(self, iteration: int, history: Sequence[Mapping[str, Any]]) -> None:
        """Called once before the first ``write``: ``iteration`` is the checkpoint the run starts from
        (0: a fresh run), ``history`` the records of metrics.jsonl up to it. The sink forgets what it
        holds past ``iteration`` and catches up on what it lacks of ``history``."""

    def write(self, record: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def shown_scalars(logdir: str | os.PathLike[str]) -> dict[int, tuple[float, list[str]]]:
    """What TensorBoard shows of the scalars in ``logdir`` (its files in name order, each file's steps
    from a purge_step on dropped from the older ones; a damaged record ends its file): per step, the
    wall time of its first event and the tag of each of its events (a tag twice: the step is twice)."""
    shown: dict[int, tuple[float, list[str]]] = {}
    if not pathlib.Path(logdir).is_dir():
        return shown
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    for tag in accumulator.Tags()["scalars"]:
        for event in accumulator.Scalars(tag):
            wall_time, tags = shown.get(event.step, (event.wall_time, []))
            shown[event.step] = (min(wall_time, event.wall_time), tags + [tag])
    return shown


class TensorBoardSink(MetricsSink):
    """Scalars in TensorBoard event files in ``logdir``, written by a tensorboardX ``SummaryWriter``; each
    start of the job writes a new file, made on its first event (a start with nothing to write or to
    drop leaves no file)."""

    name = "tensorboard"

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        missing = [name for name in TENSORBOARD_PACKAGES if not importable(name)]
        if missing:
            raise ValueError(TENSORBOARD_MISSING.format(" and ".join(missing)))
        self.logdir = pathlib.Path(logdir)
        self.purge_step: int | None = None  # set by resume: the new file hides older files' steps >= it
        self.writer = None  # the SummaryWriter, once there is something to write

    def resume(self, iteration: int, history: Sequence[Mapping[str, Any]]) -> None:
        shown = shown_scalars(self.logdir)
        wanted = {r["iteration"]: r for r in history if r["iteration"] <= iteration}

        def differs(step: int) -> bool:  # missing, partly there, there twice, or not in metrics.jsonl
            tags = shown[step][1] if step in shown else []  # (tensorboardX may have cleaned their names)
            return step not in wanted or not len(tags) == len(set(tags)) == len(scalars(wanted[step]))

        steps = sorted(set(wanted) | {step for step in shown if step <= iteration})
        self.purge_step = next((step for step in steps if differs(step)), iteration + 1)
        dropped = [step for step in shown if step > iteration]
        if dropped:
            logger.info("%s: %d steps written after checkpoint %d are dropped", self.logdir, len(dropped), iteration)
        rewrite = [step for step in sorted(wanted) if step >= self.purge_step]
        if rewrite:
            replaced = any(self.purge_step <= step <= iteration for step in shown)
            logger.log(
                logging.WARNING if replaced else logging.INFO,
                "%s: the event files %s step %d: steps %d-%d written again from metrics.jsonl",
                self.logdir,
                "differ from metrics.jsonl at" if replaced else "lack",
                self.purge_step,
                self.purge_step,
                iteration,
            )
        if any(step >= self.purge_step for step in shown):
            self._open()  # the purge goes into the new file even if the run writes nothing more
        for step in rewrite:
            self._add(wanted[step], shown[step][0] if step in shown else None)

    def write(self, record: Mapping[str, Any]) -> None:
        self._add(record)

    def _open(self) -> None:
        if self.writer is not None:
            return
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(
            str(self.logdir),
            purge_step=self.purge_step,
            flush_secs=TENSORBOARD_FLUSH_S,
            # TensorBoard reads a folder's files in name order; tensorboardX names them by the second
            # and host only: the time in ns and the pid keep a later file later and never the same name
            filename_suffix=f".{time.time_ns()}.{os.getpid()}",
        )

    def _add(self, record: Mapping[str, Any], wall_time: float | None = None) -> None:
        self._open()
        wall_time = time.time() if wall_time is None else wall_time
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["iteration"], walltime=wall_time)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def importable(name: str) -> bool:
    """Whether ``import name`` can work, without importing it (slow; the config check runs it)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def wandb_importable() -> bool:
    return importable("wandb")


def import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:  # installed but broken, or blocked: the reason is part of the message
        raise ValueError(f"{WANDB_MISSING} [{type(e).__name__}: {e}]") from e
    return wandb


class WandbSink(MetricsSink):
    """Scalars logged to a Weights & Biases run, step = iteration. The run id lives in
    DIR/wandb_run.json, so a resumed job continues the same run (``resume="allow"``); W&B keeps a run's
    steps increasing, so steps it already has (logged before a crash, past the checkpoint) are not sent
    again: their values from the rerun are in metrics.jsonl and TensorBoard."""

    name = "wandb"

    def __init__(
        self,
        out: str | os.PathLike[str],
        project: str,
        mode: str,
        run_config: Mapping[str, Any] | None = None,
        wandb: Any = None,
    ) -> None:
        """``wandb``: the module (default: imported now, ValueError naming metrics.wandb if it cannot be)."""
        self.out = pathlib.Path(out)
        self.project = project
        self.mode = mode
        self.run_config = dict(run_config) if run_config is not None else None
        self.wandb = wandb if wandb is not None else import_wandb()
        self.state_path = self.out / WANDB_STATE_FILE
        self.run = None
        self.run_id: str | None = None
        self.last_step = 0

    def resume(self, iteration: int, history: Sequence[Mapping[str, Any]]) -> None:
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else None
        resumed = state is not None and state.get("project") == self.project
        if resumed:
            self.run_id, self.last_step = state["id"], int(state["last_step"])
        else:  # a new W&B run (first start, W&B turned on at a resume, or another project)
            self.run_id, self.last_step = secrets.token_hex(8), 0
        self.run = self.wandb.init(
            project=self.project,
            id=self.run_id,
            resume="allow",
            mode=self.mode,
            dir=str(self.out),
            config=None if resumed else self.run_config,
        )
        self._save_state()
        if self.last_step > iteration:
            logger.warning(
                "W&B run %s already holds steps %d-%d, logged before the restart from iteration %d: W&B keeps "
                "those values (the rerun's are in metrics.jsonl and TensorBoard)",
                self.run_id,
                iteration + 1,
                self.last_step,
                iteration,
            )
        for record in history:
            if self.last_step < record["iteration"] <= iteration:
                self._log(record)

    def write(self, record: Mapping[str, Any]) -> None:
        if record["iteration"] > self.last_step:
            self._log(record)
        else:
            logger.debug("W&B run %s already has step %d: not sent again", self.run_id, record["iteration"])

    def _log(self, record: Mapping[str, Any]) -> None:
        self.run.log(scalars(record), step=record["iteration"])
        self.last_step = record["iteration"]
        self._save_state()

    def _save_state(self) -> None:
        state = {"id": self.run_id, "project": self.project, "last_step": self.last_step}
        atomic_write_text(self.state_path, json.dumps(state) + "\n")

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MetricsSinks:
    """The configured sinks as one: a sink that fails to write is logged and the run goes on (the
    record is in metrics.jsonl; the sink's next start catches up on it)."""

    def __init__(self, sinks: Sequence[MetricsSink] = ()) -> None:
        self.sinks = list(sinks)

    def resume(self, iteration: int, history: Sequence[Mapping[str, Any]]) -> None:
        for sink in self.sinks:
            sink.resume(iteration, history)

    def write(self, record: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            try:
                sink.write(record)
            except Exception as e:  # noqa: BLE001 - the metrics are in metrics.jsonl; training goes on
                logger.warning("metrics sink %s could not write iteration %s: %s", sink.name, record["iteration"], e)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - close the others too
                logger.warning("closing metrics sink %s: %s", sink.name, e)
        self.sinks = []


def make_sinks(
    metrics: Any, out: str | os.PathLike[str], run_config: Mapping[str, Any] | None = None, wandb: Any = None
) -> MetricsSinks:
    """The sinks ``metrics`` (a ``MetricsConfig``) turns on for the output dir ``out``; ``run_config``:
    the job's config, stored with a new W&B run."""
    out = pathlib.Path(out)
    sinks: list[MetricsSink] = []
    if metrics.tensorboard:
        sinks.append(TensorBoardSink(out / TENSORBOARD_DIR))
    if metrics.wandb:
        sinks.append(WandbSink(out, metrics.wandb_project, metrics.wandb_mode, run_config, wandb))
    return MetricsSinks(sinks)
