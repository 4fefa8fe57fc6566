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
          (then the metrics sinks: tensorboard/ event files, W&B when metrics.wandb is on)
          ▼
      save_state(i+1): model, sampler state, replay buffer, progress (atomic LATEST flip)

``RLJob`` runs that order; the parts live beside it: ``loop_setup`` (resume check, sampler, trainers,
engine and weight sync), ``loop_stages`` (rewards, training, the rollout's metrics) and ``loop_eval``
(held-out evaluation, the SFT match check, summary.json). Problems, prompts, rewards and curriculum
labels come from the task (``orchestrator.tasks.make_task``: the demo, or problem files with
``data.train_path``).
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
from collections.abc import Callable
from typing import Any

from ckpt_common.dictconfig import to_dict
from orchestrator import checkpointing, phases
from orchestrator.config import JobConfig
from orchestrator.loop_eval import heldout_eval, job_summary, last_eval, sft_match
from orchestrator.loop_setup import (
    check_resumable,
    load_weights,
    make_rollout_engine,
    make_sampler,
    make_trainers,
    make_weight_sync,
    record_resume,
)
from orchestrator.loop_stages import iteration_rewards, rollout_record, train_on_groups
from orchestrator.metric_sinks.sinks import MetricsSinks, make_sinks
from orchestrator.metrics_log import MetricsLog, plot_metrics, summary_line
from orchestrator.replay import ReplayBuffer
from orchestrator.scoring import score_response
from orchestrator.tasks.factory import make_task

logger = logging.getLogger(__name__)


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
        self.sinks = MetricsSinks()  # TensorBoard, W&B (config.metrics): made by run()
        self.engine = None
        self.trainer = None
        self.initial_policy = None
        self.sync = None
        self.rollout = None
        self.task = None
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

        from orchestrator.engine_pool.base import SamplingSettings
        from orchestrator.rollout import Rollout
        from trainer import sft

        c = self.config
        if self.task is None:
            self.task = make_task(c)
        if c.init_model_dir is not None:
            self.sft_model_dir = pathlib.Path(c.init_model_dir)
            if c.sft.data_path is not None:  # your model fine-tuned on your SFT file first (cached)
                from ckpt_common.prompt_style import PromptStyle
                from trainer.sft_file import run_file_sft

                phases.enter("SFT warm-up")
                style = PromptStyle(c.data.prompt_template, c.data.chat_template, c.data.fields.system_prompt)
                self.sft_model_dir = run_file_sft(c.sft, self.sft_model_dir, c.sft_cache_dir, style=style)
                phases.enter("start-up")
            done = self.sft_model_dir.parent / sft.DONE_FILE
            self.sft_summary = sft.sft_summary(self.sft_model_dir) if done.exists() else {}
        else:
            if c.data.uses_files:
                logger.warning(
                    "problem files without init_model_dir: RL starts from the demo's SFT model (trained on the "
                    "demo's arithmetic); set init_model_dir to start from your own model"
                )
            phases.enter("SFT warm-up")
            self.sft_model_dir = sft.run_sft(c.sft, c.sft_cache_dir)
            phases.enter("start-up")
            self.sft_summary = sft.sft_summary(self.sft_model_dir)
        saved = checkpointing.load_latest(self.out / "state")
        self.start_iteration = 0 if saved is None else saved.iteration
        self.trainer, self.initial_policy = make_trainers(c, self.sft_model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.sft_model_dir)
        self.task.check_prompt_lengths(self.tokenizer, c.engine.max_model_len - c.rollout.max_response_tokens)
        self.pool = list(self.task.train_problems())
        self.problems = {p.id: p for p in self.pool}
        self.heldout = list(self.task.heldout_problems())
        self.sampler = make_sampler(c, self.pool, self.task.difficulty, self.task.pass_rate)
        buffer = ReplayBuffer(c.partial_rollout())
        if saved is not None:
            load_weights(self.trainer, saved.model_dir)
            self.sampler.load_state_dict(saved.sampler_state)
            buffer = saved.replay_buffer(c.partial_rollout())
            self.progress = dict(saved.progress)
            record_resume(self.out, saved, buffer)
        dropped = self.metrics.truncate_after(self.start_iteration)
        if dropped:
            logger.info("dropped %d metrics lines written after the last checkpoint", dropped)
        self.sinks.resume(self.start_iteration, self.metrics.records())  # same cut; catch up on what they lack
        self.reward_fn = self.task.make_reward_fn(c.reward)
        phases.enter("engine start")
        self.engine = make_rollout_engine(c, self.sft_model_dir, self.out, self.engine_factory)
        self.sync = make_weight_sync(c, self.engine, self.engine_factory)
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

    def encode(self, problem) -> list[int]:
        return self.task.encode(problem, self.tokenizer)

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def is_correct(self, problem, text: str) -> bool:
        return score_response(self.reward_fn, problem, text, self.config.reward.correct_threshold).correct

    # -- evaluation -------------------------------------------------------------------------------
    def _evaluate(self, sampled: bool) -> dict[str, Any]:
        out, self._last_greedy = heldout_eval(
            self.engine,
            self.heldout,
            self.encode,
            self.decode,
            self.is_correct,
            self.config,
            sampled,
            self.task.level_of,
        )
        return out

    def _initial_eval(self) -> None:
        before = self._evaluate(sampled=True)
        self.progress.update(
            before=before,
            **sft_match(
                self.heldout,
                self._last_greedy,
                self.sft_summary,
                self.config,
                before,
                self.task.level_of,
                comparable=self.task.compares_with_sft,
            ),
            rl_elapsed_s=0.0,
            sync_total_s=0.0,
            iteration_total_s=0.0,
        )

    # -- one iteration ----------------------------------------------------------------------------
    def _iteration(self, i: int) -> dict[str, Any]:
        """Iteration ``i`` (0-based) under policy version i; returns its metrics record."""
        c = self.config
        start = time.monotonic()
        pool = self._engine_pool()
        requests_before = pool.metrics()["engine_requests"] if pool is not None else {}
        phases.enter("rollout", i + 1)
        groups, stats = self.rollout.run(i, policy_version=i, sample_problems=lambda n: self.sampler.sample(n, i))
        rollout_requests = (  # this iteration's rollout requests per engine of a pool
            {k: v - requests_before.get(k, 0) for k, v in pool.metrics()["engine_requests"].items()}
            if pool is not None
            else None
        )
        if self.sampler.prioritized is not None:
            for g in groups:
                self.sampler.prioritized.stats.record(g.problem_id, sum(s.correct for s in g.scores), len(g.scores))
        rewards = iteration_rewards(groups, i, c)
        # colocated engines stop here (inference -> train); the push below starts them with version i+1
        before_train = getattr(self.sync, "before_train", None)
        switched = before_train() if before_train is not None else {}
        colocated = getattr(self.sync, "colocated", False)
        if colocated:  # a GPU trainer takes back the device memory it lent the engines
            switched.update(self.trainer.reclaim_device_memory())
        t_train = time.monotonic()
        phases.enter("training", i + 1)
        train_stats = train_on_groups(self.trainer, self.initial_policy, groups, rewards, i, c)
        t_sync = time.monotonic()
        if colocated:  # ... and lends it to them again: the engines start next (CPU: nothing)
            switched.update(self.trainer.release_device_memory())
        named = self.trainer.named_tensors()  # Megatron: TP ranks write HF slices to shared memory
        t_push = time.monotonic()
        phases.enter("weight sync", i + 1)
        synced = self.sync.push(named, version=i + 1)
        evaluated = (i + 1) % c.eval.every_iterations == 0 or i + 1 == c.rl.num_iterations
        if evaluated:
            phases.enter("evaluation", i + 1)
        evaluation = (
            self._evaluate(sampled=True) if evaluated else last_eval(self.metrics.records(), self.progress["before"])
        )
        record = {
            "iteration": i + 1,
            "policy_version": i + 1,
            "evaluated": evaluated,
            **evaluation,
            **rollout_record(groups, rewards, stats, i, c),
            "train_s": t_sync - t_train,
            "weight_sync_s": synced.total_s,
            "weight_sync_convert_s": t_push - t_sync,
            "weight_sync_update_s": synced.update_s,
            "weight_sync_bytes": synced.total_bytes,
            **({"weight_sync_kind": synced.kind, "weight_sync_version_bytes": _nbytes(named)} if c.sync.delta else {}),
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
        from orchestrator.engine_pool.pool import EnginePool

        return self.engine if isinstance(self.engine, EnginePool) else None

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
        self.task = make_task(self.config)  # problem files: every line checked before anything is written
        self._prepare_output_dir()
        self.sinks = make_sinks(self.config.metrics, self.out, to_dict(self.config))  # wandb imported here
        try:
            self._setup()
            phases.enter("initial weight sync")
            first = self.sync.push(self.trainer.named_tensors(), version=self.start_iteration)
            logger.info("initial weights (v%d) pushed into vLLM in %.2f s", self.start_iteration, first.total_s)
            if "before" not in self.progress:
                phases.enter("initial evaluation")
                self._initial_eval()
            self._train_loop()
            phases.enter("summary")
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
                phases.enter("checkpoint write", i + 1)
                self.metrics.append(record)  # then the state: a resume drops lines past its checkpoint
                self.sinks.write(record)
                self._save(i + 1)
                phases.enter("plot", i + 1)
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
        pool = self._engine_pool()
        summary = job_summary(
            self.progress,
            records,
            self.config,
            self.sft_model_dir,
            self.sft_summary,
            self.trainer,
            pool.metrics() if pool is not None else None,
        )
        if records:
            self._plot(records)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        summary["summary_line"] = summary_line(
            summary["heldout_accuracy_before"],
            summary["heldout_accuracy_after"],
            summary["rl_minutes"],
            summary["weight_sync_share"],
        )
        return summary

    def _plot(self, records: list[dict[str, Any]]) -> None:
        before = self.progress["before"]
        plot_metrics(records, self.out / "metrics.png", before["heldout_accuracy"], before.get("heldout_pass_at_1"))

    def close(self) -> None:
        self.sinks.close()
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


def _nbytes(named) -> int:
    """The bytes of one full version (`named`: the tensors handed to the sync)."""
    return sum(t.numel() * t.element_size() for t in named.values())


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
