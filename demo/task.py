"""The verifiable arithmetic task: problems, chain-of-thought solutions, answer checking.

::

    level spec (operation, digits, operands) ──▶ sample_problem(rng, level) ──▶ Problem
                                                        │                        │
        held-out split: stable hash of the expression ──┘    prompt_text ◀──────┤
        (training never sees a held-out problem)             solution_text ◀────┤ (SFT target)
                                                             is_correct(problem, response) ◀ rollouts

Text format (one char = one token with the tiny tokenizer)::

    prompt:    "347+586\\n"
    solution:  "7+6+0=13\\n4+8+1=13\\n3+5+1=9\\n#### 933"

Each line handles one column, right to left: the two digits (0 where a number has run
out), the carry (or borrow) coming in, and the column result; for subtraction a borrowed
column is written with its 10 ("13-8-1=4"). The final "#### " line holds the answer.

Levels fix the operand width (a fixed width is much easier for the tiny model than mixed
widths) and grow with digit count, then subtraction, then three-operand sums. The default
SFT (``trainer.sft``) covers levels 1-4 and stops at partial competence (measured,
greedy on the held-out split: 86 % / 91 % / 11 % / 28 % on levels 1-4; sampled at T=1,
pass@8 is 34 % on level 3 and 56 % on level 4), so RL on ``RL_LEVELS`` has signal and room
to show a gain. Levels 5-7 stay at 0 % after SFT (no RL signal); they are for curricula.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from typing import Literal

Operation = Literal["add", "sub", "add3"]
ANSWER_PREFIX = "#### "
HELDOUT_BUCKETS = 10  # one expression in this many belongs to the held-out split
_MAX_MISSES = 10_000
_ANSWER_RE = re.compile(r"####[ \t]*(-?\d+)")


@dataclasses.dataclass(frozen=True)
class LevelSpec:
    """One difficulty level: operands have between ``min_digits`` and ``max_digits`` digits."""

    operation: Operation
    min_digits: int
    max_digits: int

    @property
    def num_operands(self) -> int:
        return 3 if self.operation == "add3" else 2


LEVELS: dict[int, LevelSpec] = {
    1: LevelSpec("add", 1, 1),
    2: LevelSpec("add", 2, 2),
    3: LevelSpec("add", 3, 3),
    4: LevelSpec("sub", 2, 2),
    5: LevelSpec("sub", 3, 3),
    6: LevelSpec("add", 4, 4),
    7: LevelSpec("add3", 2, 2),
}
SFT_LEVELS: tuple[int, ...] = (1, 2, 3, 4)
RL_LEVELS: tuple[int, ...] = (2, 3, 4)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One arithmetic problem. ``id`` is the expression itself ("347+586"), unique per problem."""

    id: str
    prompt: str
    answer: str
    level: int
    operation: Operation
    operands: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level={self.level!r} must be one of {sorted(LEVELS)}")
        if len(self.operands) != LEVELS[self.level].num_operands:
            raise ValueError(f"operands={self.operands!r} do not fit level {self.level}")


def _symbol(operation: Operation) -> str:
    return "-" if operation == "sub" else "+"


def make_problem(operation: Operation, operands: Sequence[int], level: int) -> Problem:
    """Build a problem from its operands (subtraction needs the first >= the second)."""
    operands = tuple(int(x) for x in operands)
    if any(x < 0 for x in operands):
        raise ValueError(f"operands={operands!r} must be non-negative")
    if operation == "sub":
        if operands[0] < operands[1]:
            raise ValueError(f"operands={operands!r}: subtraction needs first >= second")
        answer = operands[0] - operands[1]
    else:
        answer = sum(operands)
    expression = _symbol(operation).join(str(x) for x in operands)
    return Problem(
        id=expression, prompt=expression + "\n", answer=str(answer), level=level, operation=operation, operands=operands
    )


def _random_operand(rng: random.Random, spec: LevelSpec) -> int:
    digits = rng.randint(spec.min_digits, spec.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)  # exactly `digits` digits (0-9 for one digit)


def sample_problem(rng: random.Random, level: int) -> Problem:
    """One random problem of ``level`` (either split)."""
    if level not in LEVELS:
        raise ValueError(f"level={level!r} must be one of {sorted(LEVELS)}")
    spec = LEVELS[level]
    operands = [_random_operand(rng, spec) for _ in range(spec.num_operands)]
    if spec.operation == "sub":
        operands.sort(reverse=True)
    return make_problem(spec.operation, operands, level)


def is_heldout(problem: Problem) -> bool:
    """Stable (process-independent) membership of the held-out split."""
    digest = hashlib.sha256(problem.id.encode()).digest()
    return int.from_bytes(digest[:8], "little") % HELDOUT_BUCKETS == 0


def _draw(
    seed: int,
    num_problems: int,
    levels: Sequence[int],
    weights: Sequence[float] | None,
    want_heldout: bool,
    allow_fewer: bool = False,
) -> list[Problem]:
    if num_problems < 0:
        raise ValueError(f"num_problems={num_problems!r} must be >= 0")
    if not levels:
        raise ValueError("levels must not be empty")
    if weights is not None and (len(weights) != len(levels) or min(weights) < 0 or sum(weights) <= 0):
        raise ValueError(f"weights={weights!r} must be {len(levels)} non-negative numbers, not all 0")
    rng = random.Random(f"{seed}/{want_heldout}")
    out: list[Problem] = []
    seen: set[str] = set()
    misses = 0  # draws in a row that added nothing: the split of these levels is exhausted
    while len(out) < num_problems:
        level = rng.choices(list(levels), weights=weights)[0]
        problem = sample_problem(rng, level)
        if is_heldout(problem) == want_heldout and not (want_heldout and problem.id in seen):
            seen.add(problem.id)
            out.append(problem)
            misses = 0
        else:
            misses += 1
            if misses > _MAX_MISSES:
                if allow_fewer:
                    return out
                raise RuntimeError(
                    f"could not draw {num_problems} distinct problems from levels {list(levels)} (got {len(out)})"
                )
    return out


def training_problems(
    seed: int, num_problems: int, levels: Sequence[int] = SFT_LEVELS, weights: Sequence[float] | None = None
) -> list[Problem]:
    """Problems outside the held-out split (repeats possible), levels drawn by ``weights``."""
    return _draw(seed, num_problems, levels, weights, want_heldout=False)


def iter_training_problems(
    seed: int, levels: Sequence[int] = SFT_LEVELS, weights: Sequence[float] | None = None, chunk_size: int = 1024
) -> Iterator[Problem]:
    """An endless deterministic stream of training problems."""
    for chunk in range(1 << 62):
        yield from training_problems(seed * 1_000_003 + chunk, chunk_size, levels, weights)


def heldout_problems(
    seed: int = 0, num_problems: int = 200, levels: Sequence[int] = RL_LEVELS, *, allow_fewer: bool = False
) -> list[Problem]:
    """Distinct held-out problems, the same number from each level (the remainder from the first).

    A level whose held-out split is smaller than its share (level 1 holds about 10 problems)
    raises RuntimeError, or with ``allow_fewer`` gives all it has.
    """
    per_level = [num_problems // len(levels)] * len(levels)
    per_level[0] += num_problems - sum(per_level)
    out: list[Problem] = []
    for level, count in zip(levels, per_level):
        out += _draw(seed * 1_000_003 + level, count, [level], None, want_heldout=True, allow_fewer=allow_fewer)
    return out


def column_lines(problem: Problem) -> list[str]:
    """The chain-of-thought lines, one per column, least significant first."""
    digits = [str(x)[::-1] for x in problem.operands]
    width = max(len(d) for d in digits)
    lines, carry = [], 0
    for col in range(width):
        column = [int(d[col]) if col < len(d) else 0 for d in digits]
        if problem.operation == "sub":
            value = column[0] - column[1] - carry
            borrow = 1 if value < 0 else 0
            lines.append(f"{column[0] + 10 * borrow}-{column[1]}-{carry}={value + 10 * borrow}")
            carry = borrow
        else:
            value = sum(column) + carry
            lines.append("+".join(str(c) for c in column) + f"+{carry}={value}")
            carry = value // 10
    return lines


def solution_text(problem: Problem) -> str:
    """The SFT target: column lines then the answer line (no trailing newline, no eos)."""
    return "\n".join(column_lines(problem) + [ANSWER_PREFIX + problem.answer])


def extract_answer(response_text: str) -> str | None:
    """The number after the last "####" (leading zeros dropped), or None if there is none."""
    matches = _ANSWER_RE.findall(response_text)
    if not matches:
        return None
    return str(int(matches[-1]))


def is_correct(problem: Problem, response_text: str) -> bool:
    """Exact check of the final answer (the chain of thought is not graded)."""
    return extract_answer(response_text) == problem.answer


def max_solution_chars(problem: Problem) -> int:
    """A generation budget: the reference solution's length plus slack for one extra line."""
    return len(solution_text(problem)) + 16


# -- the verbose "long CoT" format (k1.5 long2short: a long-CoT model next to the short one) --------

SolutionStyle = Literal["short", "long"]
SOLUTION_STYLES: tuple[str, ...] = ("short", "long")
RECHECK_PREFIX = "recheck "


def check_line(problem: Problem, line: str) -> str:
    """A redundant re-check of one column line: the inverse operation gives back the first digit.

    "7+6+0=13" -> "check 13-6-0=7"; "13-8-1=4" -> "check 4+8+1=13".
    """
    left, value = line.split("=")
    if problem.operation == "sub":
        top, *rest = left.split("-")
        return "check " + "+".join([value, *rest]) + f"={top}"
    first, *rest = left.split("+")
    return "check " + "-".join([value, *rest]) + f"={first}"


def recheck_line(problem: Problem) -> str:
    """The final re-add of the whole problem ("recheck 347+586=933"; subtraction adds back:
    "recheck 45+45=90")."""
    if problem.operation == "sub":
        return f"{RECHECK_PREFIX}{problem.answer}+{problem.operands[1]}={problem.operands[0]}"
    return f"{RECHECK_PREFIX}{'+'.join(str(x) for x in problem.operands)}={problem.answer}"


def long_solution_text(problem: Problem) -> str:
    """The verbose chain of thought: every column line followed by its re-check, a final re-add of the
    whole problem, then the same answer line (rewards read only the "#### " line)::

        7+6+0=13
        check 13-6-0=7
        4+8+1=13
        check 13-8-1=4
        3+5+1=9
        check 9-5-1=3
        recheck 347+586=933
        #### 933
    """
    lines = []
    for line in column_lines(problem):
        lines += [line, check_line(problem, line)]
    return "\n".join(lines + [recheck_line(problem), ANSWER_PREFIX + problem.answer])


def solution_text_for(problem: Problem, style: str = "short") -> str:
    """The SFT target in ``style`` ("short": ``solution_text``; "long": ``long_solution_text``)."""
    if style == "short":
        return solution_text(problem)
    if style == "long":
        return long_solution_text(problem)
    raise ValueError(f"solution style {style!r} must be one of {SOLUTION_STYLES}")


def max_solution_chars_for(problem: Problem, style: str = "short") -> int:
    """``max_solution_chars`` for a solution style (the style's reference length plus one line of slack)."""
    return len(solution_text_for(problem, style)) + 16
