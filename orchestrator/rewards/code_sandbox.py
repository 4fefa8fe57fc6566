"""Code reward for the RL orchestrator, computed by the sandbox service (`sandbox/`, over HTTP).

    policy sample ──extract_code_block──▶ code ──SandboxClient.judge (POST /judge)──▶ passed/total
                                                                            └──▶ reward in [0, 1]

`mode="fraction"` gives passed/total; `mode="all_or_nothing"` gives 1.0 only when every case passes
(and asks the service to stop at the first failing case). `CodeSandboxReward` is the RewardFn that
`reward.type = "code_sandbox"` builds (orchestrator.scoring imports this module only when chosen).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sandbox.client import SandboxClient
from sandbox.models import COMPARE_MODES, LANGUAGES, TestCase

RewardMode = Literal["fraction", "all_or_nothing"]
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+#-]*)[^\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CodeRewardConfig:
    """How the orchestrator scores code: `code_reward(client, code, cases, **asdict(cfg))`."""

    mode: RewardMode = "fraction"
    language: str = "python"
    timeout_s: float = 2.0
    memory_mb: int = 256
    compare: str = "lines"

    def __post_init__(self) -> None:
        if self.mode not in ("fraction", "all_or_nothing"):
            raise ValueError(f"mode must be 'fraction' or 'all_or_nothing', got {self.mode!r}")
        if self.language not in LANGUAGES:
            raise ValueError(f"language must be one of {LANGUAGES}, got {self.language!r}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}")
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) or self.memory_mb <= 0:
            raise ValueError(f"memory_mb must be a positive integer, got {self.memory_mb!r}")
        if self.compare not in COMPARE_MODES:
            raise ValueError(f"compare must be one of {COMPARE_MODES}, got {self.compare!r}")


def _as_case(case: TestCase | Mapping[str, Any] | Sequence[str]) -> TestCase:
    if isinstance(case, TestCase):
        return case
    if isinstance(case, Mapping):
        return TestCase(input=case["input"], output=case["output"])
    stdin, expected = case
    return TestCase(input=stdin, output=expected)


def extract_code_block(text: str, language: str | None = None) -> str:
    """The last fenced code block of a model answer (preferring one tagged `language`), or the
    whole text when it has none."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return text
    if language is not None:
        aliases = {"python": {"python", "py", "python3"}, "c": {"c"}, "cpp": {"cpp", "c++", "cc", "cxx"}}.get(
            language, {language}
        )
        tagged = [body for tag, body in blocks if tag.lower() in aliases]
        if tagged:
            return tagged[-1]
    return blocks[-1][1]


def code_reward(
    client: SandboxClient,
    code: str,
    test_cases: Sequence[TestCase | Mapping[str, Any] | Sequence[str]],
    *,
    mode: RewardMode,
    language: str = "python",
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    compare: str = "lines",
) -> float:
    """Reward of one submission: fraction of cases passed, or 1.0/0.0 for all-or-nothing.

    Empty code scores 0.0 without a call. ValueError for bad arguments or a request the sandbox
    refuses (for example code over its size limit); RuntimeError when the sandbox fails."""
    if mode not in ("fraction", "all_or_nothing"):
        raise ValueError(f"mode must be 'fraction' or 'all_or_nothing', got {mode!r}")
    cases = [_as_case(c) for c in test_cases]
    if not cases:
        raise ValueError("test_cases must hold at least one case")
    if not code.strip():
        return 0.0
    result = client.judge(
        language,
        code,
        cases,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        compare=compare,
        stop_on_first_failure=mode == "all_or_nothing",
    )
    if mode == "all_or_nothing":
        return 1.0 if result.all_passed else 0.0
    return result.passed / result.total


class CodeSandboxReward:
    """RewardFn over the sandbox service: problems carry ``test_cases`` (a key or an attribute);
    ``code`` holds CodeRewardConfig's fields (``reward.code`` of the job config)."""

    def __init__(self, sandbox_url: str, code: Mapping[str, Any] | None = None) -> None:
        self.code_config = CodeRewardConfig(**dict(code or {}))
        self.client = SandboxClient(sandbox_url)

    def __call__(self, problem: Any, response_text: str) -> float:
        cases = problem["test_cases"] if isinstance(problem, dict) else problem.test_cases
        code = extract_code_block(response_text, self.code_config.language)
        return code_reward(self.client, code, cases, **dataclasses.asdict(self.code_config))
