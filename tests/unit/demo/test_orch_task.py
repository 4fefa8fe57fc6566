"""Unit tests for the arithmetic task (pure Python)."""

import random

import pytest

from demo import task
from demo.tiny_model import CHARACTERS


@pytest.mark.parametrize(
    "operation, operands, answer, lines",
    [
        ("add", (347, 586), "933", ["7+6+0=13", "4+8+1=13", "3+5+1=9"]),
        ("add", (95, 7), "102", ["5+7+0=12", "9+0+1=10"]),
        ("add", (0, 0), "0", ["0+0+0=0"]),
        ("sub", (722, 59), "663", ["12-9-0=3", "12-5-1=6", "7-0-1=6"]),
        ("sub", (1000, 1), "999", ["10-1-0=9", "10-0-1=9", "10-0-1=9", "1-0-1=0"]),
        ("sub", (45, 45), "0", ["5-5-0=0", "4-4-0=0"]),
        ("add3", (93, 58, 64), "215", ["3+8+4+0=15", "9+5+6+1=21"]),
        ("add3", (99, 99, 99), "297", ["9+9+9+0=27", "9+9+9+2=29"]),
    ],
)
def test_column_lines(operation, operands, answer, lines):
    level = {"add": 1, "sub": 4, "add3": 7}[operation]
    problem = task.make_problem(operation, operands, level)
    assert problem.answer == answer
    assert task.column_lines(problem) == lines
    assert task.solution_text(problem) == "\n".join(lines + ["#### " + answer])
    assert task.is_correct(problem, task.solution_text(problem))


@pytest.mark.parametrize(
    "response, expected",
    [
        ("1+2+0=3\n#### 3", "3"),
        ("#### 12\n#### 13", "13"),
        ("####0042", "42"),
        ("#### -5", "-5"),
        ("no answer here", None),
        ("#### ", None),
        ("answer 12", None),
        ("#### 7 trailing text", "7"),
    ],
)
def test_extract_answer(response, expected):
    assert task.extract_answer(response) == expected


def test_is_correct_is_exact():
    problem = task.make_problem("add", (12, 30), 1)
    assert task.is_correct(problem, "#### 42")
    assert not task.is_correct(problem, "#### 43")
    assert not task.is_correct(problem, "42")
    assert not task.is_correct(problem, "#### 42\n#### 41")


@pytest.mark.parametrize("operation, operands", [("sub", (3, 5)), ("add", (-1, 2))])
def test_make_problem_rejects_bad_operands(operation, operands):
    with pytest.raises(ValueError, match="operands"):
        task.make_problem(operation, operands, 1)


def test_problem_rejects_unknown_level():
    with pytest.raises(ValueError, match="level"):
        task.Problem(id="1+1", prompt="1+1\n", answer="2", level=99, operation="add", operands=(1, 1))


@pytest.mark.parametrize("level", sorted(task.LEVELS))
def test_levels_produce_valid_problems(level):
    spec = task.LEVELS[level]
    rng = random.Random(level)
    for _ in range(200):
        problem = task.sample_problem(rng, level)
        assert problem.level == level and problem.operation == spec.operation
        assert all(len(str(x)) <= spec.max_digits for x in problem.operands)
        assert max(len(str(x)) for x in problem.operands) >= spec.min_digits
        assert int(problem.answer) == eval(problem.id)  # the id is the expression itself
        assert problem.prompt == problem.id + "\n"
        text = problem.prompt + task.solution_text(problem)
        assert set(text) <= set(CHARACTERS)
        assert task.is_correct(problem, task.solution_text(problem))
        assert len(task.solution_text(problem)) < task.max_solution_chars(problem)


def test_generators_are_deterministic():
    assert task.training_problems(3, 50) == task.training_problems(3, 50)
    assert task.training_problems(3, 50) != task.training_problems(4, 50)
    assert task.heldout_problems(1, 40) == task.heldout_problems(1, 40)
    first, second = (task.iter_training_problems(5, chunk_size=7) for _ in range(2))
    taken = [next(first) for _ in range(20)]  # spans three chunks
    assert taken == [next(second) for _ in range(20)]
    assert len({p.id for p in taken}) > 15


def test_heldout_is_disjoint_from_training_and_balanced():
    levels = sorted(task.LEVELS)[1:]  # level 1 (one-digit sums) has too few held-out problems
    heldout = task.heldout_problems(0, 70 * len(levels), levels)
    training = task.training_problems(0, 5000, levels)
    assert {p.id for p in heldout}.isdisjoint({p.id for p in training})
    assert all(task.is_heldout(p) for p in heldout) and not any(task.is_heldout(p) for p in training)
    assert len({p.id for p in heldout}) == len(heldout)
    counts = {level: sum(p.level == level for p in heldout) for level in levels}
    assert set(counts.values()) == {70}


def test_heldout_split_is_about_a_tenth():
    rng = random.Random(0)
    share = sum(task.is_heldout(task.sample_problem(rng, 3)) for _ in range(4000)) / 4000
    assert 0.07 < share < 0.13


def test_training_weights_select_levels():
    problems = task.training_problems(0, 300, [1, 2], weights=[0.0, 1.0])
    assert {p.level for p in problems} == {2}
    with pytest.raises(ValueError, match="weights"):
        task.training_problems(0, 3, [1, 2], weights=[1.0])


def test_small_level_raises_or_gives_all_it_has():
    with pytest.raises(RuntimeError, match="distinct"):
        task.heldout_problems(0, 20, [1])  # 100 one-digit sums, about a tenth held out
    everything = task.heldout_problems(0, 20, [1], allow_fewer=True)
    assert 3 <= len(everything) < 20 and len({p.id for p in everything}) == len(everything)
    all_sums = {f"{a}+{b}" for a in range(10) for b in range(10)}
    assert {p.id for p in everything} == {
        i for i in all_sums if task.is_heldout(task.make_problem("add", [int(x) for x in i.split("+")], 1))
    }
