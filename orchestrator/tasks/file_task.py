"""Problems from JSONL files as a Task: RL on your own prompts (``data.train_path``, ``data.heldout_path``).

::

    train.jsonl, heldout.jsonl ──read_problems (every line checked)──▶ Problem (orchestrator.tasks.problems)
        ──check_disjoint──▶ no held-out problem is a training problem
    or train.jsonl alone ──read_problems──split_heldout(data.heldout_fraction, data.split_seed)──▶
        the same two lists, drawn from the one file by a hash of (seed, id)
        ──the config's checks──▶ "messages" need data.chat_template; "tests" need reward.sandbox_url
    prompt:  data.chat_template=false: data.prompt_template with {prompt} filled in ("messages" refused)
             data.chat_template=true:  the model's chat template (tokenizer.apply_chat_template, the
                                       generation prompt added); a "prompt" is one user message
    reward:  "answer" (math): math-verify on the text after the last of data.answer_markers
             (none: the whole response); "tests" (code): the sandbox at reward.sandbox_url
             (+ reward.reward_model, weighted, when set)
    difficulty: the record's, in [0, 1]; a problem without one counts as hard (1.0), so a
             curriculum never holds it back; heldout_accuracy_by_level buckets: round(100 x difficulty),
             -1 for problems without one

Every error names the file and line (``train.jsonl:7: field "messages": ...``) and is raised when
the task is built, which the job does before anything starts (``orchestrator.config.load_config``
and ``RLJob``); prompts too long for the model's context are refused (``Task.check_prompt_lengths``)
once the tokenizer is loaded, before the engine starts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ckpt_common.prompt_style import DEFAULT_ANSWER_MARKERS, DEFAULT_TEMPLATE, PromptStyle, template_error
from ckpt_common.records import Issue, ProblemFileError
from ckpt_common.tables import table_name
from orchestrator.tasks.base import Task
from orchestrator.tasks.fields import FieldsConfig
from orchestrator.tasks.problems import CodeTest, Problem, check_disjoint, read_problems, split_heldout

if TYPE_CHECKING:
    from orchestrator.config import DataConfig, RewardConfig
    from orchestrator.rewards import RewardFn

logger = logging.getLogger(__name__)

UNKNOWN_LEVEL = -1  # heldout_accuracy_by_level's bucket for problems without a difficulty


def _read(path: str, field: str, fields: FieldsConfig, split: str | None) -> list[Problem]:
    if not os.path.exists(path):
        try:
            read_problems(path, fields, split)  # its message: no such file (or how to fetch a Hub name)
        except ProblemFileError as e:
            raise ProblemFileError([Issue(e.path, None, None, f"{e.issues[0].message}: check {field}")]) from None
    return read_problems(path, fields, split)


class FileReward:
    """RewardFn over a file task's problems: math-verify for an ``answer``, the sandbox for ``tests``."""

    def __init__(self, math: RewardFn, code: RewardFn | None) -> None:
        self.math = math
        self.code = code

    def __call__(self, problem: Problem, response_text: str) -> float:
        if problem.tests is None:
            return self.math(problem, response_text)
        if self.code is None:  # FileTask.from_config refuses this before the run
            raise ValueError(f"problem {problem.id!r} has tests but no sandbox is configured (reward.sandbox_url)")
        cases = [{"input": t.input, "output": t.output} for t in problem.tests]
        return self.code({"test_cases": cases}, response_text)


class FileTask(Task):
    """Training and held-out problems read from two JSONL problem files, or from one file split by a
    seeded held-out fraction (validated when built)."""

    name = "file"

    def __init__(
        self,
        train_path: str | os.PathLike[str],
        heldout_path: str | os.PathLike[str] | None = None,
        *,
        heldout_fraction: float | None = None,
        split_seed: int = 0,
        prompt_template: str = DEFAULT_TEMPLATE,
        chat_template: bool = False,
        answer_markers: Sequence[str] = DEFAULT_ANSWER_MARKERS,
        hold_out: bool = True,
        fields: FieldsConfig | None = None,
        train_split: str | None = None,
        heldout_split: str | None = None,
    ) -> None:
        error = template_error(prompt_template)
        if error is not None:
            raise ValueError(f"data.prompt_template: {error}")
        if not hold_out:  # one file whole (``of_file``): every problem a training problem, none held out
            if heldout_path is not None or heldout_fraction is not None:
                raise ValueError("hold_out=False reads one file whole: give no heldout_path and no heldout_fraction")
        elif (heldout_path is None) == (heldout_fraction is None):
            raise ValueError(
                "give exactly one of data.heldout_path (a held-out file) and data.heldout_fraction (a share of "
                f"data.train_path held out), got heldout_path={heldout_path!r}, heldout_fraction={heldout_fraction!r}"
            )
        self.fields = fields or FieldsConfig()
        if self.fields.system_prompt is not None and not chat_template:
            raise ValueError(
                "data.fields.system_prompt is a system turn, which the model's chat template renders: set "
                "data.chat_template=true (or put the text into data.prompt_template)"
            )
        # the sources' names in errors and logs: the path, [split] added for a folder's split
        self.train_path = table_name(train_path, train_split)
        heldout_source = train_path if heldout_path is None else heldout_path
        self.heldout_path = self.train_path if heldout_path is None else table_name(heldout_path, heldout_split)
        self.style = PromptStyle(prompt_template, chat_template, self.fields.system_prompt)
        self.answer_markers = tuple(answer_markers)
        train = _read(os.fspath(train_path), "data.train_path", self.fields, train_split)
        if not hold_out:
            heldout: list[Problem] = []
        elif heldout_fraction is None:
            heldout = _read(os.fspath(heldout_source), "data.heldout_path", self.fields, heldout_split)
            check_disjoint(train, heldout, self.train_path, self.heldout_path)
        else:
            train, heldout = split_heldout(train, heldout_fraction, split_seed, self.train_path)
        if not chat_template:
            self._refuse(
                self._located(train, heldout),
                lambda p: p.messages is not None,
                "messages",
                "a conversation is rendered by the model's chat template: set data.chat_template=true "
                '(or give a "prompt" string)',
            )
        self._train, self._heldout = train, heldout
        self._path_of = {p.id: self.train_path for p in train} | {p.id: self.heldout_path for p in heldout}
        split = "" if heldout_fraction is None else f" (data.heldout_fraction={heldout_fraction}, seed {split_seed})"
        logger.info(
            "problem files: %d training problems from %s, %d held-out problems from %s%s",
            len(train),
            self.train_path,
            len(heldout),
            self.heldout_path,
            split,
        )

    @classmethod
    def from_config(cls, data: DataConfig, reward: RewardConfig) -> FileTask:
        """The task of the ``data`` section's files, checked against the ``reward`` section."""
        task = cls(
            data.train_path,
            data.heldout_path,
            heldout_fraction=data.heldout_fraction,
            split_seed=data.split_seed,
            prompt_template=data.prompt_template,
            chat_template=data.chat_template,
            answer_markers=data.answer_markers,
            fields=data.fields,
            train_split=data.train_split,
            heldout_split=data.heldout_split,
        )
        task.check_reward(reward)
        return task

    @classmethod
    def of_file(cls, path: str | os.PathLike[str], data: DataConfig, reward: RewardConfig) -> FileTask:
        """Every problem of the one file ``path`` (none held out; curation's input), rendered and scored
        as the ``data`` section says (its template, chat template and answer markers; its file paths are
        unused), checked against the ``reward`` section."""
        task = cls(
            path,
            prompt_template=data.prompt_template,
            chat_template=data.chat_template,
            answer_markers=data.answer_markers,
            hold_out=False,
            fields=data.fields,
            train_split=data.train_split,
        )
        task.check_reward(reward)
        return task

    def check_reward(self, reward: RewardConfig) -> None:
        """Code problems need the sandbox: ProblemFileError naming their lines when ``reward.sandbox_url`` is unset."""
        if reward.sandbox_url:
            return
        self._refuse(
            self._located(self._train, self._heldout),
            lambda p: p.tests is not None,
            "tests",
            "a code problem is scored in the sandbox: set reward.type=code_sandbox and reward.sandbox_url "
            "(docs/sandbox.md)",
        )

    def _located(self, train: Sequence[Problem], heldout: Sequence[Problem]) -> list[tuple[Problem, str]]:
        """Each problem with its file; one split file's problems in line order."""
        pairs = [(p, self.train_path) for p in train] + [(p, self.heldout_path) for p in heldout]
        if self.heldout_path == self.train_path:
            pairs.sort(key=lambda pair: pair[0].line or 0)
        return pairs

    @staticmethod
    def _refuse(
        problems: Sequence[tuple[Problem, str]], bad: Callable[[Problem], bool], field: str, message: str
    ) -> None:
        """ProblemFileError with one issue (path:line, ``field``: ``message``) per problem that is ``bad``."""
        issues = [Issue(path, p.line, field, message) for p, path in problems if bad(p)]
        if issues:
            raise ProblemFileError(issues, len(issues))

    # -- Task -------------------------------------------------------------------------------------
    def train_problems(self) -> Sequence[Problem]:
        return self._train

    def heldout_problems(self) -> Sequence[Problem]:
        return self._heldout

    @property
    def prompt_template(self) -> str:
        return self.style.template

    @property
    def chat_template(self) -> bool:
        return self.style.chat_template

    def where(self, problem: Problem) -> str:
        path = self._path_of.get(problem.id, "<problems>")
        return f"{path}:{problem.line}" if problem.line is not None else f"{path} (id {problem.id!r})"

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """The conversation handed to the chat template (a prompt: one user message, the template applied)."""
        if problem.messages is not None:
            return self.style.with_system([dict(m) for m in problem.messages])
        return self.style.messages(problem.prompt)

    def prompt_text(self, problem: Problem, tokenizer: Any = None) -> str:
        if not self.chat_template:
            if problem.prompt is None:  # refused when the task was built
                raise ValueError(f"{self.where(problem)}: messages need data.chat_template=true")
            return self.style.text(problem.prompt)
        if tokenizer is None:
            raise ValueError("data.chat_template=true: rendering a prompt needs the model's tokenizer")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"data.chat_template=true but the model's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) "
                "has no chat template: set data.chat_template=false, or add one to tokenizer_config.json"
            )
        return tokenizer.apply_chat_template(self.messages(problem), tokenize=False, add_generation_prompt=True)

    def encode_text(self, text: str, tokenizer: Any) -> list[int]:
        if self.chat_template:  # the template writes the special tokens itself (a BOS among them)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(tokenizer(text)["input_ids"])

    def reference(self, problem: Problem) -> str | tuple[CodeTest, ...]:
        return problem.answer if problem.answer is not None else problem.tests

    def difficulty(self, problem: Problem) -> float:
        return 1.0 if problem.difficulty is None else problem.difficulty

    def pass_rate(self, problem: Problem) -> float | None:
        return problem.pass_rate

    def level_of(self, problem: Problem) -> int:
        return UNKNOWN_LEVEL if problem.difficulty is None else round(100 * problem.difficulty)

    @property
    def direct_answer_prefix(self) -> str:
        return f"{self.answer_markers[0]} " if self.answer_markers else ""

    def make_reward_fn(self, reward: RewardConfig) -> RewardFn:
        from orchestrator.rewards import CombinedReward, MathVerifyReward, RewardModelHook
        from orchestrator.rewards.math_verify_reward import extract_after_marker, whole_response

        extract = extract_after_marker(*self.answer_markers) if self.answer_markers else whole_response
        code = None
        if reward.sandbox_url:
            from orchestrator.rewards.code_sandbox import CodeSandboxReward

            code = CodeSandboxReward(reward.sandbox_url, reward.code)
        base = FileReward(MathVerifyReward(extract), code)
        if reward.reward_model is None:
            return base
        from ckpt_common.validate import import_qualname

        hook = RewardModelHook(import_qualname("reward.reward_model", reward.reward_model)(), name=reward.reward_model)
        return CombinedReward([(base, 1.0), (hook, reward.reward_model_weight)])
