"""The RL job's parts, built once per run: the resume check, sampler, trainers, engine and weight sync.

::

    config.json in the output dir ──check_resumable──▶ only RESUMABLE_CHANGES may differ
    make_trainers: the policy trainer (trainer.type) + GRPO's frozen initial policy (transformers)
    make_rollout_engine: engine_factory | the daemon's engines | make_engine (one engine or a pool)
    make_weight_sync: DaemonWeightSync | PoolWeightSync (a pool) | WeightSync (one engine's req_func)
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from ckpt_common.dictconfig import config_differences, to_dict
from orchestrator import checkpointing
from orchestrator.config import FILE_ONLY_FIELDS, RESUMABLE_CHANGES, DataConfig, JobConfig
from orchestrator.replay import ReplayBuffer
from orchestrator.sampling import CurriculumSampler, PrioritizedSampler, ProblemSampler, ProblemStats

logger = logging.getLogger(__name__)


def check_resumable(saved: dict, current: dict) -> None:
    """A resumed run may change only RESUMABLE_CHANGES; anything else needs a new output dir."""
    if "trainer" not in saved:  # a run saved before the trainer section existed trained with the hf backend
        saved = {**saved, "trainer": {"type": "hf", "tp_size": 1}}
    engine = saved.get("engine")
    if isinstance(engine, dict) and "num_engines" not in engine:  # saved before engine pools: one engine
        saved = {**saved, "engine": {"num_engines": 1, "self_heal": True, **engine}}
    engine = saved.get("engine")
    if isinstance(engine, dict) and "colocated" not in engine:  # saved before colocated mode: disaggregated
        saved = {**saved, "engine": {**engine, "colocated": False}}
    engine = saved.get("engine")
    if isinstance(engine, dict) and "sleep_level" not in engine:  # saved before sleep mode: stop and start
        saved = {**saved, "engine": {**engine, "sleep_level": 0}}
    data = saved.get("data")
    if isinstance(data, dict) and "prompt_template" not in data:  # saved before problem files: the demo's data
        defaults = to_dict(DataConfig())
        saved = {**saved, "data": {**{k: defaults[k] for k in FILE_ONLY_FIELDS}, **data}}
    data = saved.get("data")
    if isinstance(data, dict) and "split_seed" not in data:  # saved before held-out fractions: none
        saved = {**saved, "data": {"heldout_fraction": None, "split_seed": 0, **data}}
    # metrics.* only says where the metrics go besides metrics.jsonl (and configs saved before it lack it)
    bad = [
        p
        for p in config_differences(saved, current)
        if p not in RESUMABLE_CHANGES and p != "metrics" and not p.startswith("metrics.")
    ]
    if bad:
        raise ValueError(
            f"the output dir holds a run with a different config ({', '.join(bad)}); use another "
            f"--output-dir or the saved config (only {', '.join(RESUMABLE_CHANGES)} and metrics.* may change)"
        )


def make_sampler(
    config: JobConfig,
    problems: Sequence[Any],
    difficulty: Callable[[Any], float],
    pass_rate: Callable[[Any], float | None] | None = None,
) -> ProblemSampler:
    """The curriculum (``difficulty``: the task's label of a problem) times prioritized sampling, whose
    success rates start from ``pass_rate`` where the task knows one (curation's, in a problem file)."""
    s = config.sampling
    prioritized = None
    if s.prioritized:
        rates = {p.id: pass_rate(p) for p in problems} if pass_rate is not None else {}
        priors = {pid: rate for pid, rate in rates.items() if rate is not None}
        if priors:
            logger.info(
                "prioritized sampling: %d of %d training problems start from their pass rate in the problem file "
                "(curation's), the others from %g",
                len(priors),
                len(problems),
                s.prior_success_rate,
            )
        stats = ProblemStats(s.prior_success_rate, s.prior_weight, s.stats_decay, priors=priors)
        prioritized = PrioritizedSampler(stats, s.priority_epsilon)
    return ProblemSampler(
        [p.id for p in problems],
        curriculum=CurriculumSampler({p.id: difficulty(p) for p in problems}, s.curriculum),
        prioritized=prioritized,
        seed=s.seed,
    )


def load_weights(trainer, model_dir: pathlib.Path) -> None:
    """Copy a checkpoint's weights into the trainer's model (names as HF saved them)."""
    from demo.tiny_model import load_state_dict_from_dir

    try:
        trainer.load_hf_weights(load_state_dict_from_dir(model_dir))
    except RuntimeError as e:
        raise RuntimeError(f"checkpoint {model_dir}: {e}") from None


def make_trainers(c: JobConfig, sft_model_dir: pathlib.Path) -> tuple[Any, Any]:
    """The policy's trainer, and GRPO's KL reference (None for the other algorithms or kl_coef 0)."""
    from trainer.base import TrainerConfig
    from trainer.factory import make_trainer
    from trainer.hf import HFTrainer

    trainer = make_trainer(
        c.trainer.type,
        sft_model_dir,
        TrainerConfig(
            lr=c.rl.lr,
            optimizer=c.rl.optimizer,
            eps=c.rl.adam_eps,
            weight_decay=c.rl.weight_decay,
            grad_clip=c.rl.grad_clip,
            num_threads=c.rl.num_threads,
            seed=c.rl.seed,
            autocast_dtype=c.rl.autocast_dtype,
        ),
        tp_size=c.trainer.tp_size,
    )
    # GRPO's KL reference: the policy RL started from, frozen (a resumed run starts it from the same dir).
    # Always a transformers model: it is never trained, and its log-probs equal Megatron's (1e-5).
    initial_policy = HFTrainer(sft_model_dir, trainer.config) if c.rl.algorithm == "grpo" and c.rl.kl_coef > 0 else None
    return trainer, initial_policy


def make_rollout_engine(
    c: JobConfig, sft_model_dir: pathlib.Path, out: pathlib.Path, engine_factory: Callable[[Any, str], Any] | None
) -> Any:
    if engine_factory is not None:
        return engine_factory(c.engine, str(sft_model_dir))
    if c.engine.type == "daemon":  # the checkpoint-engine daemon's engines; versions as files or from memory
        from orchestrator.engine_pool.daemon import start_daemon_pool
        from orchestrator.engine_pool.memory_source import memory_source

        return start_daemon_pool(
            c.engine, str(sft_model_dir), c.sync.handoff_dir, c.sync.timeout_s, source=memory_source(c.sync)
        )
    from orchestrator.engine_pool.factory import make_engine

    # engine.num_engines >= 2: a pool of vLLM servers, their logs beside the run's
    return make_engine(c.engine, str(sft_model_dir), log_dir=str(out / "engines"))


def make_weight_sync(c: JobConfig, engine: Any, engine_factory: Callable[[Any, str], Any] | None) -> Any:
    from orchestrator.engine_pool.pool import EnginePool

    if c.engine.type == "daemon" and engine_factory is None:
        import torch

        from orchestrator.engine_pool.daemon import DaemonWeightSync

        if c.engine.sleep_level and not torch.cuda.is_available():
            # colocated engines share this machine's devices; vLLM-CPU answers /sleep but ignores it
            logger.warning(
                "engine.sleep_level=%d without CUDA: vLLM on CPU accepts a sleep and frees nothing "
                "(set engine.sleep_level=0 to stop and start the engines around training)",
                c.engine.sleep_level,
            )
        return DaemonWeightSync(
            c.sync,
            engine,
            colocated=c.engine.colocated,
            start_timeout_s=c.engine.start_timeout_s,
            sleep_level=c.engine.sleep_level,
        )
    if isinstance(engine, EnginePool):  # one registration, one update per engine; heals engines
        from orchestrator.engine_pool.pool_sync import PoolWeightSync

        return PoolWeightSync(c.sync, engine)
    from orchestrator.engine_pool.weight_sync import WeightSync

    return WeightSync.for_engine(c.sync, engine)


def record_resume(out: pathlib.Path, saved: checkpointing.SavedState, buffer: ReplayBuffer) -> None:
    """A line in resume.jsonl (and the log): which checkpoint the run resumed from, with what trajectories."""
    ids = [t.trajectory_id for t in buffer.unfinished()]
    logger.info(
        "resuming after iteration %d from %s: %d stored trajectories (%d unfinished)",
        saved.iteration,
        saved.path,
        len(buffer),
        len(ids),
    )
    record = {
        "iteration": saved.iteration,
        "checkpoint": saved.path.name,
        "num_trajectories": len(buffer),
        "unfinished_trajectory_ids": ids,
        "time": time.time(),
    }
    with open(out / "resume.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
