"""The suite's time per layer: which layer a test belongs to, and the summary's lines."""

from __future__ import annotations

import pytest

from testing.suite_layers import BUDGET_MIN, LayerClock, layer_of


@pytest.mark.parametrize(
    ("nodeid", "layer"),
    [
        ("tests/unit/checkpoint_engine/test_ce_plan.py::test_x[a-b]", "unit"),
        ("tests/unit/testing/test_suite_layers.py::test_layer_of", "unit"),
        ("tests/integration/dist/test_ce_daemon.py::test_x", "integration/dist"),
        ("tests/integration/vllm/test_vllm_front.py::test_gate", "integration/vllm"),
        ("tests/integration/sandbox/test_sandbox_service.py::test_x", "integration/sandbox"),
        ("tests/integration/e2e/test_rl_demo.py::test_x", "e2e"),
        ("tests/integration/gpu/test_ce_cuda.py", "integration/gpu"),
        ("examples/test_something.py::test_x", "other"),
        ("tests/integration/test_top.py::test_x", "other"),
    ],
)
def test_layer_of(nodeid, layer):
    assert layer_of(nodeid) == layer


def test_every_area_has_a_budget():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "integration"
    areas = {p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"}
    layers = {"e2e" if a == "e2e" else f"integration/{a}" for a in areas} | {"unit"}
    assert layers == set(BUDGET_MIN)


def test_clock_sums_phases_counts_tests_and_flags_a_layer_over_budget():
    clock = LayerClock()
    for phase_s in (1.0, 50.0, 0.5):  # setup, call, teardown of one test
        clock.add("tests/integration/e2e/test_a.py::test_x", phase_s)
    clock.add("tests/unit/x/test_b.py::test_y", 30.0)
    clock.add("tests/unit/x/test_b.py::test_z", 30.0)
    lines = clock.lines({"unit": 0.5, "e2e": 2.0})
    assert lines[0].split()[:2] == ["unit", "1.0"] and "2 tests" in lines[0] and lines[0].endswith("OVER")
    assert lines[1].split()[:2] == ["e2e", "0.9"] and "1 tests" in lines[1] and not lines[1].endswith("OVER")
    assert lines[-1].split()[:4] == ["all", "layers", "1.9", "min"] and "3 tests" in lines[-1]
    assert "budget  2.5 min" in lines[-1]
