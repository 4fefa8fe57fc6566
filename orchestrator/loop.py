"""The RL job: SFT warm-up (cached), then the k1.5 loop over a trainer and a vLLM engine.

::

    run_sft (cache) ──▶ SFT model dir ──▶ trainer (trainer.type: "hf" HFTrainer  vLLM AsyncLLM (dummy weights)
                                              | "megatron" MegatronTrainer, weights converted to HF layout)
                                              │ named_tensors                      ▲
                                              └──▶ WeightSync: ParameterServer ────┘ v0 (before any rollout)
    initial greedy eval on held-out (vLLM) = "before"; checked against transformers' SFT accuracy

    for iteration i (policy version i):
      ProblemSampler.sample (curriculum x prioritized 1 - success rate)
          │ new prompt ids                      ReplayBuffer (unfinished trajectories, oldest first)
          ▼                                             │ continue: prompt + earlier segments
      Rollout.run ── all requests in flight on vLLM, streamed; repeat ──▶ stop + penalty
          │          finished responses scored at once (scoring pool overlaps generation)
          ▼
      finished groups of k ──▶ group_rewards: task reward - repeat penalty + length penalty (after warm-up)
          │                ──▶ ProblemStats.record (success rate per problem)
          ▼
      train_iteration: reset optimizer; logp_ref from the iteration-start weights; minibatch steps (eq. 3,
          or the rl.algorithm baseline: grpo | reinforce)
          ▼
      WeightSync.push(version i+1): register -> gather_metas -> update(engine) -> unregister v i
          (engine.colocated: the daemon's engines stop before train and start with version i+1 here)
          (engine.num_engines >= 2: EnginePool of vLLM servers, PoolWeightSync: one update per engine)
          ▼
      evaluate on schedule (greedy accuracy, sampled pass@1) ──▶ metrics.jsonl, metrics.png
          ▼
      save_state(i+1): model, sampler state, replay buffer, progress (atomic LATEST flip)
"""

from __future__ import annotations

import json
import logging
import pathlib
import random
import time
from collections.abc import Callable
from typing import Any

from orchestrator import checkpointing, data
from orchestrator.config import RESUMABLE_CHANGES, JobConfig
from orchestrator.dictconfig import config_differences, to_dict
from orchestrator.metrics import MetricsLog, plot_metrics, summary_line
from orchestrator.replay import ReplayBuffer
from orchestrator.sampling import CurriculumSampler, PrioritizedSampler, ProblemSampler, ProblemStats
from orchestrator.scoring import group_rewards, make_reward_fn, score_response

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
    bad = [p for p in config_differences(saved, current) if p not in RESUMABLE_CHANGES]
    if bad:
        raise ValueError(
            f"the output dir holds a run with a different config ({', '.join(bad)}); use another "
            f"--output-dir or the saved config (only {', '.join(RESUMABLE_CHANGES)} may change)"
        )


def make_sampler(config: JobConfig, problems: list) -> ProblemSampler:
    s = config.sampling
    prioritized = None
    if s.prioritized:
        stats = ProblemStats(s.prior_success_rate, s.prior_weight, s.stats_decay)
        prioritized = PrioritizedSampler(stats, s.priority_epsilon)
    return ProblemSampler(
        [p.id for p in problems],
        curriculum=CurriculumSampler(data.difficulties(problems), s.curriculum),
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


class RLJob:
    """Holds every component of one run; ``run()`` trains to ``rl.num_iterations`` and returns the summary."""

    def __init__(
        self,
        config: JobConfig,
        output_dir: str | pathlib.Path,
        *,
        progress_bar: bool = True,
        engine_factory: Callable[[Any, str], Any] | None = None,
    ) -> None:
        """``engine_factory(engine_config, model_dir)`` builds the rollout engine (default: ``make_engine``)."""
        self.config = config
        self.out = pathlib.Path(output_dir)
        self.progress_bar = progress_bar
        self.engine_factory = engine_factory
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        self.engine = None
        self.trainer = None
        self.initial_policy = None
        self.sync = None
        self.rollout = None
        self.progress: dict[str, Any] = {}

    # -- setup ------------------------------------------------------------------------------------
    def _prepare_output_dir(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        current = to_dict(self.config)
        saved_path = self.out / "config.json"
        if saved_path.exists():
            check_resumable(json.loads(saved_path.read_text()), current)
        saved_path.write_text(json.dumps(current, indent=2) + "\n")

    def _setup(self) -> None:
        from transformers import AutoTokenizer

        from orchestrator.engine import SamplingSettings, make_engine
        from orchestrator.engine_pool import EnginePool
        from orchestrator.pool_sync import PoolWeightSync
        from orchestrator.rollout import Rollout
        from orchestrator.weight_sync import WeightSync
        from trainer import sft
        from trainer.torch_trainer import HFTrainer, TrainerConfig, make_trainer

        c = self.config
        if c.init_model_dir is not None:
            self.sft_model_dir = pathlib.Path(c.init_model_dir)
            done = self.sft_model_dir.parent / sft.DONE_FILE
            self.sft_summary = sft.sft_summary(self.sft_model_dir) if done.exists() else {}
        else:
            self.sft_model_dir = sft.run_sft(c.sft, c.sft_cache_dir)
            self.sft_summary = sft.sft_summary(self.sft_model_dir)
        saved = checkpointing.load_latest(self.out / "state")
        self.start_iteration = 0 if saved is None else saved.iteration
        self.trainer = make_trainer(
            c.trainer.type,
            self.sft_model_dir,
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
        self.initial_policy = (
            HFTrainer(self.sft_model_dir, self.trainer.config)
            if c.rl.algorithm == "grpo" and c.rl.kl_coef > 0
            else None
        )
        self.tokenizer = AutoTokenizer.from_pretrained(self.sft_model_dir)
        self.pool = data.train_pool(c.data)
        self.problems = {p.id: p for p in self.pool}
        self.heldout = data.heldout_set(c.data)
        self.sampler = make_sampler(c, self.pool)
        buffer = ReplayBuffer(c.partial_rollout())
        if saved is not None:
            load_weights(self.trainer, saved.model_dir)
            self.sampler.load_state_dict(saved.sampler_state)
            buffer = saved.replay_buffer(c.partial_rollout())
            self.progress = dict(saved.progress)
            self._record_resume(saved, buffer)
        dropped = self.metrics.truncate_after(self.start_iteration)
        if dropped:
            logger.info("dropped %d metrics lines written after the last checkpoint", dropped)
        self.reward_fn = make_reward_fn(c.reward)
        if self.engine_factory is not None:
            self.engine = self.engine_factory(c.engine, str(self.sft_model_dir))
        elif c.engine.type == "daemon":  # the checkpoint-engine daemon's engines; versions as files
            from orchestrator.daemon_engines import start_daemon_pool

            self.engine = start_daemon_pool(c.engine, str(self.sft_model_dir), c.sync.handoff_dir, c.sync.timeout_s)
        else:  # engine.num_engines >= 2: a pool of vLLM servers, their logs beside the run's
            self.engine = make_engine(c.engine, str(self.sft_model_dir), log_dir=str(self.out / "engines"))
        if c.engine.type == "daemon" and self.engine_factory is None:
            from orchestrator.daemon_engines import DaemonWeightSync

            self.sync = DaemonWeightSync(
                c.sync, self.engine, colocated=c.engine.colocated, start_timeout_s=c.engine.start_timeout_s
            )
        elif isinstance(self.engine, EnginePool):  # one registration, one update per engine; heals engines
            self.sync = PoolWeightSync(c.sync, self.engine)
        else:
            self.sync = WeightSync(c.sync, self.engine.weight_req_func(c.sync.timeout_s))
        self.rollout = Rollout(
            self.engine,
            buffer,
            self.problems,
            self.encode,
            self.decode,
            self.reward_fn,
            c.reward.correct_threshold,
            c.repeat,
            SamplingSettings(temperature=c.rl.temperature, top_p=c.rl.top_p),
            num_scoring_workers=c.rollout.num_scoring_workers,
            timeout_s=c.rollout.request_timeout_s,
        )

    def _record_resume(self, saved: checkpointing.SavedState, buffer: ReplayBuffer) -> None:
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
        with open(self.out / "resume.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def encode(self, problem) -> list[int]:
        return list(self.tokenizer(problem.prompt)["input_ids"])

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def is_correct(self, problem, text: str) -> bool:
        return score_response(self.reward_fn, problem, text, self.config.reward.correct_threshold).correct

    # -- evaluation -------------------------------------------------------------------------------
    def _evaluate(self, sampled: bool) -> dict[str, Any]:
        from orchestrator.engine import SamplingSettings
        from orchestrator.evaluate import Evaluator

        c = self.config
        start = time.monotonic()
        evaluator = Evaluator(
            self.engine,
            self.encode,
            self.decode,
            self.is_correct,
            c.rollout.max_response_tokens,
            timeout_s=c.rollout.request_timeout_s,
        )
        greedy = evaluator.greedy(self.heldout)
        self._last_greedy = greedy
        out: dict[str, Any] = {
            "heldout_accuracy": greedy.accuracy,
            "heldout_accuracy_by_level": greedy.accuracy_by_level,
            "heldout_response_tokens": greedy.mean_response_tokens,
            "heldout_pass_at_1": None,
            "heldout_pass_at_k": None,
        }
        if sampled and c.eval.num_sampled_problems:
            subset = self.heldout[:: max(1, len(self.heldout) // c.eval.num_sampled_problems)]
            subset = subset[: c.eval.num_sampled_problems]
            sampling = SamplingSettings(temperature=c.rl.temperature, top_p=c.rl.top_p)
            result = evaluator.sampled(subset, c.eval.num_samples_per_problem, sampling)
            out.update(heldout_pass_at_1=result.pass_at_1, heldout_pass_at_k=result.pass_at_k)
        out["eval_s"] = time.monotonic() - start
        return out

    def _initial_eval(self) -> None:
        from orchestrator.evaluate import accuracy_by_level, compare_with_reference

        before = self._evaluate(sampled=True)
        reference = self.sft_summary.get("heldout_accuracy_by_level", {})
        sft_config = self.sft_summary.get("config", {})
        # The SFT evaluation used the first n problems per level of the same held-out draw.
        n = sft_config.get("num_eval_problems_per_level")
        same_set = (
            self.config.data.heldout_seed == sft_config.get("heldout_seed")
            and n is not None
            and self.config.data.num_heldout_per_level >= n
        )
        measured = accuracy_by_level(self.heldout, self._last_greedy.correct, lambda p: p.level, n)
        ok, gap = (
            compare_with_reference(measured, reference, self.config.eval.sft_match_tolerance)
            if same_set
            else (True, 0.0)
        )
        logger.info(
            "before RL: held-out greedy accuracy %.1f%% by level %s (vLLM); on the SFT evaluation's "
            "problems %s (vLLM) vs %s (transformers)",
            100 * before["heldout_accuracy"],
            before["heldout_accuracy_by_level"],
            measured,
            reference,
        )
        if not ok:
            logger.warning(
                "vLLM's greedy accuracy differs from transformers' by %.1f points on a level: check the weight sync",
                100 * gap,
            )
        self.progress.update(
            before=before,
            sft_reference_by_level=reference,
            sft_vllm_by_level=measured,
            sft_match_gap=gap,
            sft_match_ok=ok,
            sft_match_checked=same_set,
            rl_elapsed_s=0.0,
            sync_total_s=0.0,
            iteration_total_s=0.0,
        )

    # -- one iteration ----------------------------------------------------------------------------
    def _rewards(self, groups, iteration: int) -> list[list[float]]:
        c = self.config
        return [
            group_rewards(
                g.scores,
                [t.num_response_tokens for t in g.trajectories],
                [t.finish_reason == "repeat" for t in g.trajectories],
                iteration,
                c.length_penalty,
                c.repeat,
            )
            for g in groups
        ]

    def _train(self, groups, rewards, iteration: int) -> dict[str, Any]:
        from trainer.policy import TrainConfig, batch_from_groups, train_iteration

        if not groups:
            return {"num_train_groups": 0, "num_skipped_groups": 0, "num_steps": 0}
        c = self.config
        batch = batch_from_groups(
            [g.trajectories for g in groups],
            rewards,
            current_policy_version=iteration,
            exclude_stale=c.rollout.exclude_stale_segments,
        )
        rng = random.Random(f"{c.rl.seed}/{iteration}")
        return train_iteration(
            self.trainer,
            batch,
            TrainConfig(
                tau=c.rl.tau,
                lr=c.rl.lr_at(iteration),
                num_minibatches=c.rl.num_minibatches,
                num_epochs=c.rl.num_epochs,
                algorithm=c.rl.algorithm,
                clip_eps=c.rl.clip_eps,
                kl_coef=c.rl.kl_coef,
            ),
            rng,
            initial_policy=self.initial_policy,
        )

    def _iteration(self, i: int) -> dict[str, Any]:
        """Iteration ``i`` (0-based) under policy version i; returns its metrics record."""
        c = self.config
        start = time.monotonic()
        pool = self._engine_pool()
        requests_before = pool.metrics()["engine_requests"] if pool is not None else {}
        groups, stats = self.rollout.run(i, policy_version=i, sample_problems=lambda n: self.sampler.sample(n, i))
        rollout_requests = (  # this iteration's rollout requests per engine of a pool
            {k: v - requests_before.get(k, 0) for k, v in pool.metrics()["engine_requests"].items()}
            if pool is not None
            else None
        )
        if self.sampler.prioritized is not None:
            for g in groups:
                self.sampler.prioritized.stats.record(g.problem_id, sum(s.correct for s in g.scores), len(g.scores))
        rewards = self._rewards(groups, i)
        # colocated engines stop here (inference -> train); the push below starts them with version i+1
        before_train = getattr(self.sync, "before_train", None)
        switched = before_train() if before_train is not None else {}
        t_train = time.monotonic()
        train_stats = self._train(groups, rewards, i)
        t_sync = time.monotonic()
        named = self.trainer.named_tensors()  # the Megatron trainer converts (and gathers TP shards) here
        t_push = time.monotonic()
        synced = self.sync.push(named, version=i + 1)
        evaluated = (i + 1) % c.eval.every_iterations == 0 or i + 1 == c.rl.num_iterations
        evaluation = self._evaluate(sampled=True) if evaluated else self._last_eval()
        scores = [s for g in groups for s in g.scores]
        lengths = [t.num_response_tokens for g in groups for t in g.trajectories]
        flat = [r for rs in rewards for r in rs]
        record = {
            "iteration": i + 1,
            "policy_version": i + 1,
            "evaluated": evaluated,
            **evaluation,
            "mean_reward": sum(flat) / len(flat) if flat else None,
            "mean_task_reward": sum(s.task_reward for s in scores) / len(scores) if scores else None,
            "train_pass_at_1": sum(s.correct for s in scores) / len(scores) if scores else None,
            "mean_response_tokens": sum(lengths) / len(lengths) if lengths else None,
            "length_penalty_active": c.length_penalty.is_active(i),
            "num_groups": len(groups),
            "num_requests": stats.num_requests,
            "num_new_groups": stats.num_new_groups,
            "num_continued": stats.num_continued,
            "num_unfinished": stats.num_unfinished_trajectories,
            "num_repeat_stops": stats.num_repeat_stops,
            "num_output_tokens": stats.num_output_tokens,
            "tokens_per_s": stats.tokens_per_s,
            "rollout_s": stats.generate_s,
            "score_wait_s": stats.score_wait_s,
            "train_s": t_sync - t_train,
            "weight_sync_s": synced.total_s,
            "weight_sync_convert_s": t_push - t_sync,
            "weight_sync_update_s": synced.update_s,
            "weight_sync_bytes": synced.total_bytes,
            **train_stats,
            **switched,
            **getattr(synced, "switch", {}),  # colocated: switch_to_inference_s (inside weight_sync_s)
        }
        if getattr(synced, "engine_update_s", None) is not None:  # a pool: the update time of each engine
            record["weight_sync_engine_s"] = synced.engine_update_s
        if pool is not None:  # requests per engine, failures, requeues, recoveries (totals since the job started)
            record.update(pool.metrics(), rollout_engine_requests=rollout_requests)
        if not evaluated:
            record["eval_s"] = 0.0
        record["iteration_s"] = time.monotonic() - start
        return record

    def _engine_pool(self):
        """The engine when it is a pool of servers (``engine.num_engines`` >= 2), else None."""
        from orchestrator.engine_pool import EnginePool

        return self.engine if isinstance(self.engine, EnginePool) else None

    def _last_eval(self) -> dict[str, Any]:
        records = self.metrics.records()
        last = next((r for r in reversed(records) if r.get("evaluated")), None)
        source = last if last is not None else self.progress["before"]
        keys = (
            "heldout_accuracy",
            "heldout_accuracy_by_level",
            "heldout_response_tokens",
            "heldout_pass_at_1",
            "heldout_pass_at_k",
        )
        return {k: source.get(k) for k in keys}

    def _save(self, iteration: int) -> float:
        start = time.monotonic()
        checkpointing.save_state(
            self.out / "state",
            iteration,
            self.trainer.save,
            self.sampler.state_dict(),
            self.rollout.buffer,
            self.progress,
        )
        return time.monotonic() - start

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self._prepare_output_dir()
        try:
            self._setup()
            first = self.sync.push(self.trainer.named_tensors(), version=self.start_iteration)
            logger.info("initial weights (v%d) pushed into vLLM in %.2f s", self.start_iteration, first.total_s)
            if "before" not in self.progress:
                self._initial_eval()
            self._train_loop()
            return self._finish()
        finally:
            self.close()

    def _train_loop(self) -> None:
        from tqdm import tqdm

        c = self.config
        bar = tqdm(
            total=c.rl.num_iterations,
            initial=self.start_iteration,
            desc="rl",
            unit="it",
            disable=not self.progress_bar,
            dynamic_ncols=True,
        )
        with bar:
            for i in range(self.start_iteration, c.rl.num_iterations):
                record = self._iteration(i)
                self.progress["rl_elapsed_s"] += record["iteration_s"]
                self.progress["sync_total_s"] += record["weight_sync_s"]
                self.progress["iteration_total_s"] += record["iteration_s"]
                record["rl_elapsed_s"] = self.progress["rl_elapsed_s"]
                self.metrics.append(record)  # then the state: a resume drops lines past its checkpoint
                self._save(i + 1)
                self._plot(self.metrics.records())
                if record["evaluated"]:
                    logger.info(
                        "iteration %d: held-out accuracy %.1f%% %s, pass@1 %s, mean reward %s, "
                        "%.1f s/iteration, weight sync %.3f s",
                        i + 1,
                        100 * record["heldout_accuracy"],
                        record["heldout_accuracy_by_level"],
                        _fmt(record["heldout_pass_at_1"]),
                        _fmt(record["mean_reward"]),
                        record["iteration_s"],
                        record["weight_sync_s"],
                    )
                bar.update(1)
                bar.set_postfix(
                    acc=f"{100 * record['heldout_accuracy']:.1f}%",
                    reward=_fmt(record["mean_reward"]),
                    len=_fmt(record["mean_response_tokens"], 1),
                )

    def _finish(self) -> dict[str, Any]:
        records = self.metrics.records()
        before = self.progress["before"]["heldout_accuracy"]
        after = records[-1]["heldout_accuracy"] if records else before
        total = self.progress.get("iteration_total_s", 0.0)
        share = self.progress.get("sync_total_s", 0.0) / total if total > 0 else 0.0
        summary = {
            "heldout_accuracy_before": before,
            "heldout_accuracy_after": after,
            "heldout_gain_points": 100 * (after - before),
            "heldout_accuracy_by_level_before": self.progress["before"]["heldout_accuracy_by_level"],
            "heldout_accuracy_by_level_after": records[-1]["heldout_accuracy_by_level"] if records else None,
            "num_iterations": len(records),
            "rl_minutes": self.progress.get("rl_elapsed_s", 0.0) / 60,
            "weight_sync_share": share,
            "mean_weight_sync_s": sum(r["weight_sync_s"] for r in records) / len(records) if records else None,
            "sft_match_ok": self.progress.get("sft_match_ok"),
            "sft_match_gap": self.progress.get("sft_match_gap"),
            "sft_match_checked": self.progress.get("sft_match_checked"),
            "sft_vllm_by_level": self.progress.get("sft_vllm_by_level"),
            "sft_transformers_by_level": self.progress.get("sft_reference_by_level"),
            "sft_model_dir": str(self.sft_model_dir),
            "autocast": self.trainer.dtype_choice.to_dict(),
            "sft_autocast": self.sft_summary.get("autocast"),
            "trainer_num_threads": self.trainer.num_threads,
            "trainer": self.config.trainer.type,
            "trainer_tp_size": self.config.trainer.tp_size,
        }
        if self._engine_pool() is not None:
            summary["engines"] = self._engine_pool().metrics()
        for key in ("switch_to_train_s", "switch_to_inference_s"):  # colocated mode's switches
            values = [r[key] for r in records if key in r]
            if values:
                summary[f"mean_{key}"] = sum(values) / len(values)
        if records:
            self._plot(records)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        summary["summary_line"] = summary_line(before, after, summary["rl_minutes"], share)
        return summary

    def _plot(self, records: list[dict[str, Any]]) -> None:
        before = self.progress["before"]
        plot_metrics(records, self.out / "metrics.png", before["heldout_accuracy"], before.get("heldout_pass_at_1"))

    def close(self) -> None:
        for name in ("rollout", "sync", "engine", "trainer"):
            component = getattr(self, name)
            if component is not None and hasattr(component, "close"):
                start = time.monotonic()
                try:
                    component.close()
                except Exception as e:  # noqa: BLE001 - close the others too
                    logger.warning("closing %s: %s", name, e)
                logger.info("closed %s in %.2f s", name, time.monotonic() - start)
                setattr(self, name, None)


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run_job(
    config: JobConfig,
    output_dir: str | pathlib.Path,
    *,
    progress_bar: bool = True,
    engine_factory: Callable[[Any, str], Any] | None = None,
) -> dict[str, Any]:
    """Run (or resume) the job in ``output_dir``; returns the summary (also in DIR/summary.json)."""
    return RLJob(config, output_dir, progress_bar=progress_bar, engine_factory=engine_factory).run()
