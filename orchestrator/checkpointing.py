"""Resume state, saved after every iteration; a run killed at any moment resumes from the last one.

::

    DIR/state/.tmp-ckpt-000012-xxxx/   model/ (HF dir: weights, config, tokenizer)
                                       sampler.json  (RNG + per-problem success counts)
                                       replay.json   (every trajectory not yet trained on)
                                       progress.json (iteration, policy version, before-accuracy, timers)
            ──rename──▶ DIR/state/ckpt-000012/
    DIR/state/LATEST ◀── "ckpt-000012" (temp file + os.replace: the pointer flips atomically)
    older ckpt-* are removed after the flip (``keep_last`` stay)

A kill before the flip leaves LATEST on the previous complete checkpoint, whose replay buffer
holds the trajectories stored until then. The optimizer is reset every iteration (k1.5), so no
optimizer state is saved.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from ckpt_common.fsutil import atomic_write_text, fsync_dir
from orchestrator.replay import PartialRolloutConfig, ReplayBuffer

logger = logging.getLogger(__name__)

LATEST = "LATEST"
_PREFIX = "ckpt-"


@dataclasses.dataclass(frozen=True)
class SavedState:
    path: pathlib.Path
    iteration: int  # iterations completed
    model_dir: pathlib.Path
    sampler_state: dict[str, Any]
    progress: dict[str, Any]

    def replay_buffer(self, config: PartialRolloutConfig) -> ReplayBuffer:
        return ReplayBuffer.load(self.path / "replay.json", config)


def _write_json(path: pathlib.Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def save_state(
    state_dir: str | os.PathLike[str],
    iteration: int,
    save_model: Callable[[pathlib.Path], Any],
    sampler_state: Mapping[str, Any],
    buffer: ReplayBuffer,
    progress: Mapping[str, Any],
    keep_last: int = 2,
) -> pathlib.Path:
    """Write checkpoint ``iteration`` (``save_model(dir)`` writes the weights) and point LATEST at it."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r} must be >= 1")
    root = pathlib.Path(state_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"{_PREFIX}{iteration:06d}"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        save_model(tmp / "model")
        _write_json(tmp / "sampler.json", dict(sampler_state))
        buffer.save(tmp / "replay.json")
        _write_json(tmp / "progress.json", {**progress, "iteration": iteration})
        final = root / name
        if final.exists():  # a previous attempt at this iteration got this far but not to LATEST
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(root)
    atomic_write_text(root / LATEST, name + "\n")
    _prune(root, keep_last, current=name)
    return final


def _prune(root: pathlib.Path, keep_last: int, current: str) -> None:
    checkpoints = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))
    keep = {p.name for p in checkpoints[-keep_last:]} | {current}
    for path in checkpoints:
        if path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)
    for path in root.iterdir():  # temp dirs of attempts that were killed
        if path.is_dir() and path.name.startswith(".tmp-"):
            shutil.rmtree(path, ignore_errors=True)


def load_latest(state_dir: str | os.PathLike[str]) -> SavedState | None:
    """The checkpoint LATEST points at, or None when there is none yet."""
    root = pathlib.Path(state_dir)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not name.startswith(_PREFIX) or not path.is_dir():
        raise RuntimeError(f"{pointer} names {name!r}, which is not a checkpoint directory in {root}")
    progress = json.loads((path / "progress.json").read_text())
    return SavedState(
        path=path,
        iteration=int(progress["iteration"]),
        model_dir=path / "model",
        sampler_state=json.loads((path / "sampler.json").read_text()),
        progress=progress,
    )
