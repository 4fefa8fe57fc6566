"""Where the suite's minutes go: each test's time summed by layer, against the layer's budget.

    tests/unit/**                      -> "unit"
    tests/integration/e2e/**           -> "e2e"
    tests/integration/<area>/**        -> "integration/<area>"  (dist, vllm, sandbox, gpu)

A test's time is its setup + call + teardown, so a module-scoped fixture (an engine shared by the
module's tests) counts in the layer of the test that first asked for it. The tests run one after the
other, so the layers' sums add up to pytest's wall time (less collection and the session's start).

The budgets are minutes on the slowest CPU the suite runs on (a 2-core Xeon without bf16, under
`ONEDNN_MAX_CPU_ISA=AVX2`); `tests/README.md` says how a new test fits in them.
"""

from __future__ import annotations

import dataclasses

# Minutes per layer on the slowest CPU; the whole README test command (set-up included) gets 45.
BUDGET_MIN = {
    "unit": 2.5,
    "integration/dist": 10.0,
    "integration/sandbox": 1.5,
    "integration/vllm": 10.0,
    "integration/gpu": 1.0,
    "e2e": 17.0,
}
SETUP_BUDGET_MIN = 3.0  # venv reused: lint and the set-up check; a fresh venv adds its install time


def layer_of(nodeid: str) -> str:
    """The layer of a test by its node id (a path relative to the repository, then ::name)."""
    parts = nodeid.split("::", 1)[0].split("/")
    if len(parts) >= 2 and parts[0] == "tests" and parts[1] == "unit":
        return "unit"
    if len(parts) >= 4 and parts[0] == "tests" and parts[1] == "integration":
        return "e2e" if parts[2] == "e2e" else f"integration/{parts[2]}"
    return "other"


@dataclasses.dataclass
class LayerClock:
    """Seconds and test counts per layer, fed one test phase at a time."""

    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    tests: dict[str, set[str]] = dataclasses.field(default_factory=dict)

    def add(self, nodeid: str, duration_s: float) -> None:
        layer = layer_of(nodeid)
        self.seconds[layer] = self.seconds.get(layer, 0.0) + duration_s
        self.tests.setdefault(layer, set()).add(nodeid)

    def lines(self, budgets_min: dict[str, float] = BUDGET_MIN) -> list[str]:
        """One line per layer (largest first) and a total: minutes, tests, budget, and OVER when over it."""
        out = []
        for layer, secs in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            minutes = secs / 60
            budget = budgets_min.get(layer)
            tail = "" if budget is None else f"  budget {budget:4.1f} min" + ("  OVER" if minutes > budget else "")
            out.append(f"{layer:<22} {minutes:6.1f} min  {len(self.tests[layer]):5d} tests{tail}")
        total = sum(self.seconds.values()) / 60
        num_tests = sum(len(t) for t in self.tests.values())
        budget = sum(budgets_min.values())
        out.append(f"{'all layers':<22} {total:6.1f} min  {num_tests:5d} tests  budget {budget:4.1f} min")
        return out
