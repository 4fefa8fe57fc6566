"""The task interface: what the RL loop needs from a task, whatever its problems are.

::

    Task ──train_problems()────▶ the pool the sampler draws from (each problem has a stable ``id``)
         ──heldout_problems()──▶ the evaluation set (disjoint from the pool)
         ──encode(p, tokenizer)▶ prompt token ids (the rendered prompt: a plain template, or the
         │                       model's chat template through its tokenizer)
         ──encode_direct_answer▶ the prompt + ``direct_answer_prefix`` (curation's easy-to-hack probe)
         ──reference(p)────────▶ the reference: an answer string (math) or the code tests
         ──make_reward_fn(cfg)─▶ RewardFn(problem, response text) -> float (math-verify, the sandbox)
         ──make_is_correct(cfg)▶ (problem, response text) -> bool: the reward >= reward.correct_threshold
         ──difficulty(p)───────▶ the curriculum's label (larger is harder)
         ──level_of(p)─────────▶ the bucket of ``heldout_accuracy_by_level``

Two implementations: ``DemoTask`` (``orchestrator.tasks.demo_task``: the arithmetic the project makes
itself) and ``FileTask`` (``orchestrator.tasks.file_task``: JSONL problem files); ``make_task``
(``orchestrator.tasks.factory``) picks one from the job config and imports only that one.

Problems are the task's own objects; the loop only reads their ``id`` and hands them back to the task
(and to the reward). Everything a task checks about its problems it checks when it is built, so a
bad file stops the job before anything starts; ``check_prompt_lengths`` runs once the tokenizer is
known, before the engine starts.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.config import RewardConfig
    from orchestrator.rewards import RewardFn
    from orchestrator.tasks.problems import CodeTest

logger = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    """Prompts that leave no room for the response in the model's context (the job refuses them)."""


class Task(abc.ABC):
    """A source of problems, their prompts, their references and the reward that scores responses."""

    #: the task's name in logs and errors
    name: str = "task"
    #: whether the held-out set is the one the SFT warm-up evaluated (the job then checks vLLM's
    #: greedy accuracy of the SFT model against transformers', level by level)
    compares_with_sft: bool = False

    @abc.abstractmethod
    def train_problems(self) -> Sequence[Any]:
        """The training pool: distinct problems, each with a stable ``id``."""

    @abc.abstractmethod
    def heldout_problems(self) -> Sequence[Any]:
        """The held-out evaluation set (no problem of it is a training problem)."""

    @abc.abstractmethod
    def prompt_text(self, problem: Any, tokenizer: Any = None) -> str:
        """The text the model is given for ``problem`` (its template applied)."""

    def encode_text(self, text: str, tokenizer: Any) -> list[int]:
        """The token ids of a rendered prompt (by default: ``tokenizer(text)``, special tokens added)."""
        return list(tokenizer(text)["input_ids"])

    def encode(self, problem: Any, tokenizer: Any) -> list[int]:
        """The prompt's token ids: ``encode_text(prompt_text)``."""
        return self.encode_text(self.prompt_text(problem, tokenizer), tokenizer)

    def encode_direct_answer(self, problem: Any, tokenizer: Any) -> list[int]:
        """The prompt followed by ``direct_answer_prefix``, encoded as one text: asks for the final answer
        at once, without a chain of thought (curation's easy-to-hack probe)."""
        return self.encode_text(self.prompt_text(problem, tokenizer) + self.direct_answer_prefix, tokenizer)

    @abc.abstractmethod
    def reference(self, problem: Any) -> str | tuple[CodeTest, ...]:
        """What a response is checked against: the answer (math) or the tests (code)."""

    @abc.abstractmethod
    def difficulty(self, problem: Any) -> float:
        """The curriculum's label (``sampling.curriculum.min_difficulty`` is on the same scale)."""

    def pass_rate(self, problem: Any) -> float | None:
        """A measured share of samples that solved it (the prioritized sampler's starting success
        rate), or None: the sampler's prior."""
        return None

    @abc.abstractmethod
    def level_of(self, problem: Any) -> int:
        """The bucket of ``heldout_accuracy_by_level`` this problem counts in."""

    @abc.abstractmethod
    def make_reward_fn(self, reward: RewardConfig) -> RewardFn:
        """The RewardFn scoring (problem, response text) for this task under the ``reward`` section."""

    def make_is_correct(self, reward: RewardConfig) -> Callable[[Any, str], bool]:
        """(problem, response text) -> correct: the task's reward (``make_reward_fn(reward)``, built once)
        reaches ``reward.correct_threshold``, as the RL job counts a response correct."""
        reward_fn = self.make_reward_fn(reward)
        threshold = reward.correct_threshold

        def is_correct(problem: Any, response_text: str) -> bool:
            return float(reward_fn(problem, response_text)) >= threshold

        return is_correct

    @property
    @abc.abstractmethod
    def direct_answer_prefix(self) -> str:
        """How a response in this task's format starts its final answer (``"#### "``): curation's
        easy-to-hack probe appends it to the prompt to ask for the answer without a chain of thought."""

    def where(self, problem: Any) -> str:
        """Where ``problem`` comes from, for errors (a file task: ``path:line``)."""
        return f"{self.name} problem {problem.id!r}"

    def check_prompt_lengths(self, tokenizer: Any, max_prompt_tokens: int) -> None:
        """Refuse (PromptTooLongError) prompts longer than ``max_prompt_tokens`` after rendering: the job's
        policy is to refuse, never to cut, since a cut prompt asks another question."""
        too_long = []
        for problem in [*self.train_problems(), *self.heldout_problems()]:
            n = len(self.encode(problem, tokenizer))
            if n > max_prompt_tokens:
                too_long.append(f"{self.where(problem)}: {n} prompt tokens")
        if too_long:
            shown = "\n  ".join(too_long[:20]) + (
                f"\n  ... and {len(too_long) - 20} more" if len(too_long) > 20 else ""
            )
            raise PromptTooLongError(
                f"{len(too_long)} prompt(s) longer than {max_prompt_tokens} tokens (engine.max_model_len minus "
                f"rollout.max_response_tokens), after the prompt template:\n  {shown}\n"
                "raise engine.max_model_len, lower rollout.max_response_tokens, or drop these problems"
            )
