"""Problem sampling of the Kimi k1.5 report (section 2.3.4): curriculum and prioritized sampling.

::

    problem ids ──▶ CurriculumSampler.weights(ids, iteration)      difficulty labels: everything
                  │                                                during warm-up, then weight toward
                  │ x                                              (or restrict to) the harder ones
                  ▼
                  PrioritizedSampler.weights(ids)                  max(1 - success_rate, epsilon)
                  │                                                from ProblemStats
                  ▼
                  ProblemSampler.sample(n, iteration) ──▶ n ids   seeded weighted draw
                                                                   (no replacement by default)
    rollout results ──▶ ProblemStats.record(id, num_correct, num_attempts)

The weights of the two components multiply, so the curriculum filters (weight 0) and the
priority re-weights what is left. Everything is deterministic for a given seed and call
sequence, and the state (stats counts plus the RNG) round-trips through JSON for resume.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CurriculumConfig",
    "CurriculumSampler",
    "PrioritizedSampler",
    "ProblemSampler",
    "ProblemStats",
    "weighted_sample",
]

logger = logging.getLogger(__name__)

_STATE_VERSION = 1


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class ProblemStats:
    """Per-problem success rate with a Beta-style prior so unseen problems still get sampled.

    ``success_rate = (successes + prior_success_rate * prior_weight) / (attempts + prior_weight)``.
    ``decay`` in (0, 1] forgets old results: before a problem's new results are added, its
    counts are multiplied by ``decay`` (1.0 keeps everything). ``priors`` gives some problems a
    prior of their own (a problem file's ``pass_rate``: what curation measured), the others take
    ``prior_success_rate``; they come from the problems each run, so they are not part of the saved state.
    """

    def __init__(
        self,
        prior_success_rate: float = 0.5,
        prior_weight: float = 1.0,
        decay: float = 1.0,
        priors: Mapping[str, float] | None = None,
    ) -> None:
        if not (_is_number(prior_success_rate) and 0.0 <= prior_success_rate <= 1.0):
            raise ValueError(f"prior_success_rate must be in [0, 1], got {prior_success_rate!r}")
        if not (_is_number(prior_weight) and prior_weight > 0):
            raise ValueError(f"prior_weight must be > 0, got {prior_weight!r}")
        if not (_is_number(decay) and 0.0 < decay <= 1.0):
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.prior_success_rate = float(prior_success_rate)
        self.prior_weight = float(prior_weight)
        self.decay = float(decay)
        self._counts: dict[str, list[float]] = {}  # id -> [successes, attempts]
        self.priors: dict[str, float] = {}
        for pid, rate in (priors or {}).items():
            if not (_is_number(rate) and 0.0 <= rate <= 1.0):
                raise ValueError(f"priors[{pid!r}] must be in [0, 1], got {rate!r}")
            self.priors[str(pid)] = float(rate)

    def record(self, problem_id: str, num_correct: float, num_attempts: int) -> None:
        """Add ``num_correct`` successes out of ``num_attempts`` rollouts of one problem."""
        if not isinstance(problem_id, str):
            raise ValueError(f"problem_id must be a str, got {problem_id!r}")
        if isinstance(num_attempts, bool) or not isinstance(num_attempts, int) or num_attempts < 1:
            raise ValueError(f"num_attempts must be an int >= 1, got {num_attempts!r}")
        if not (_is_number(num_correct) and 0 <= num_correct <= num_attempts):
            raise ValueError(f"num_correct must be in [0, num_attempts={num_attempts}], got {num_correct!r}")
        counts = self._counts.setdefault(problem_id, [0.0, 0.0])
        counts[0] = counts[0] * self.decay + float(num_correct)
        counts[1] = counts[1] * self.decay + float(num_attempts)

    def success_rate(self, problem_id: str) -> float:
        successes, attempts = self._counts.get(problem_id, (0.0, 0.0))
        prior = self.priors.get(problem_id, self.prior_success_rate)
        return (successes + prior * self.prior_weight) / (attempts + self.prior_weight)

    def num_attempts(self, problem_id: str) -> float:
        return self._counts.get(problem_id, (0.0, 0.0))[1]

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "prior_success_rate": self.prior_success_rate,
            "prior_weight": self.prior_weight,
            "decay": self.decay,
            "counts": {pid: list(c) for pid, c in sorted(self._counts.items())},
        }

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> ProblemStats:
        stats = cls(data["prior_success_rate"], data["prior_weight"], data["decay"])
        stats.load_json_dict(data)
        return stats

    def load_json_dict(self, data: Mapping[str, Any]) -> None:
        """Replace this object's state in place (holders of a reference see the restored counts)."""
        restored = ProblemStats(data["prior_success_rate"], data["prior_weight"], data["decay"])  # validates
        self.prior_success_rate, self.prior_weight, self.decay = (
            restored.prior_success_rate,
            restored.prior_weight,
            restored.decay,
        )
        self._counts = {str(pid): [float(s), float(n)] for pid, (s, n) in data["counts"].items()}


@dataclass(frozen=True)
class CurriculumConfig:
    """warmup_iterations: 0-based iterations sampling every problem with equal weight.
    min_difficulty: after warm-up, problems with difficulty >= this count as hard.
    easy_weight: weight of the other (easy) problems after warm-up, in [0, 1]:
        0 restricts sampling to the hard ones, 1 turns the curriculum off."""

    warmup_iterations: int = 0
    min_difficulty: float = 0.0
    easy_weight: float = 0.0

    def __post_init__(self) -> None:
        w = self.warmup_iterations
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"CurriculumConfig.warmup_iterations must be an int >= 0, got {w!r}")
        if not _is_number(self.min_difficulty):
            raise ValueError(f"CurriculumConfig.min_difficulty must be a finite number, got {self.min_difficulty!r}")
        if not (_is_number(self.easy_weight) and 0.0 <= self.easy_weight <= 1.0):
            raise ValueError(f"CurriculumConfig.easy_weight must be in [0, 1], got {self.easy_weight!r}")


class CurriculumSampler:
    """Weights from difficulty labels (numbers, larger = harder; map string labels upstream)."""

    def __init__(self, difficulties: Mapping[str, float], config: CurriculumConfig) -> None:
        for pid, d in difficulties.items():
            if not _is_number(d):
                raise ValueError(f"difficulty of problem {pid!r} must be a finite number, got {d!r}")
        self.difficulties = dict(difficulties)
        self.config = config

    def weights(self, problem_ids: Sequence[str], iteration: int) -> list[float]:
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration!r}")
        missing = [pid for pid in problem_ids if pid not in self.difficulties]
        if missing:
            raise ValueError(f"no difficulty label for problems {missing[:5]!r} ({len(missing)} in all)")
        if iteration < self.config.warmup_iterations:
            return [1.0] * len(problem_ids)
        hard = self.config.min_difficulty
        return [1.0 if self.difficulties[pid] >= hard else self.config.easy_weight for pid in problem_ids]


class PrioritizedSampler:
    """Weights ``max(1 - success_rate, epsilon)``: the floor keeps solved problems revisited."""

    def __init__(self, stats: ProblemStats, epsilon: float = 0.05) -> None:
        if not (_is_number(epsilon) and 0.0 < epsilon <= 1.0):
            raise ValueError(f"epsilon must be in (0, 1], got {epsilon!r}")
        self.stats = stats
        self.epsilon = float(epsilon)

    def weights(self, problem_ids: Sequence[str]) -> list[float]:
        return [max(1.0 - self.stats.success_rate(pid), self.epsilon) for pid in problem_ids]


def weighted_sample(weights: Sequence[float], num: int, rng: random.Random, *, replacement: bool) -> list[int]:
    """Indices drawn with probability proportional to ``weights`` (zero weight: never drawn).

    Without replacement this is the Efraimidis-Spirakis draw: key ``log(u) / w``, the ``num``
    largest keys win, so the result is in draw order (most likely first).
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num!r}")
    for i, w in enumerate(weights):
        if not (_is_number(w) and w >= 0):
            raise ValueError(f"weights[{i}] must be a finite number >= 0, got {w!r}")
    candidates = [i for i, w in enumerate(weights) if w > 0]
    if num == 0:
        return []
    if not candidates:
        raise ValueError("every weight is 0: nothing to sample")
    if replacement:
        return rng.choices(candidates, weights=[weights[i] for i in candidates], k=num)
    if num > len(candidates):
        raise ValueError(f"cannot draw {num} distinct problems: only {len(candidates)} have weight > 0")
    keys = []
    for i in candidates:
        u = rng.random()
        keys.append((math.log(u) / weights[i] if u > 0 else -math.inf, i))
    keys.sort(key=lambda kv: kv[0], reverse=True)
    return [i for _, i in keys[:num]]


class ProblemSampler:
    """Seeded sampler combining an optional curriculum and an optional priority weighting."""

    def __init__(
        self,
        problem_ids: Sequence[str],
        *,
        curriculum: CurriculumSampler | None = None,
        prioritized: PrioritizedSampler | None = None,
        seed: int = 0,
    ) -> None:
        if len(set(problem_ids)) != len(problem_ids):
            raise ValueError("problem_ids must be unique")
        if not problem_ids:
            raise ValueError("problem_ids must not be empty")
        self.problem_ids = list(problem_ids)
        self.curriculum = curriculum
        self.prioritized = prioritized
        self.seed = seed
        self._rng = random.Random(seed)
        self._warned_short = False  # sample() said once that fewer problems than asked could be drawn

    def weights(self, iteration: int) -> list[float]:
        """Unnormalised sampling weight of every problem (in ``problem_ids`` order)."""
        weights = [1.0] * len(self.problem_ids)
        if self.curriculum is not None:
            weights = [w * c for w, c in zip(weights, self.curriculum.weights(self.problem_ids, iteration))]
        if self.prioritized is not None:
            weights = [w * p for w, p in zip(weights, self.prioritized.weights(self.problem_ids))]
        return weights

    def sample(self, num_problems: int, iteration: int, *, replacement: bool = False) -> list[str]:
        """``num_problems`` ids (distinct unless ``replacement``); fewer when fewer can be drawn now (a
        set smaller than an iteration's new groups, or a curriculum that has opened few problems yet):
        an iteration then starts fewer groups rather than failing."""
        weights = self.weights(iteration)
        if not replacement:
            available = sum(1 for w in weights if w > 0)
            if 0 < available < num_problems:
                if not self._warned_short:
                    logger.warning(
                        "iteration %d asks for %d new problems but only %d can be drawn (the training set or the "
                        "curriculum's open levels): it starts %d groups (said once)",
                        iteration,
                        num_problems,
                        available,
                        available,
                    )
                    self._warned_short = True
                num_problems = available
        picks = weighted_sample(weights, num_problems, self._rng, replacement=replacement)
        return [self.problem_ids[i] for i in picks]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: the RNG and, when prioritized, the problem stats."""
        version, internal, gauss_next = self._rng.getstate()
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "rng_state": [version, list(internal), gauss_next],
            "stats": None if self.prioritized is None else self.prioritized.stats.to_json_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported sampler state version {state.get('version')!r}")
        version, internal, gauss_next = state["rng_state"]
        self._rng.setstate((version, tuple(internal), gauss_next))
        self.seed = state["seed"]
        if state["stats"] is not None:
            if self.prioritized is None:
                raise ValueError("state holds problem stats but this sampler has no PrioritizedSampler")
            self.prioritized.stats.load_json_dict(state["stats"])
