"""testing.sft_warm: what a warm-up spec may name, and each kind trained into the cache it is given."""

from __future__ import annotations

import pathlib

import pytest

from testing import sft_warm
from trainer.sft import SFTConfig

CONFIG = SFTConfig(levels=(1,), num_steps=1)
HERE = "tests.unit.testing.test_sft_warm"


def config_fn() -> SFTConfig:
    return CONFIG


def trains_itself(cache_dir) -> pathlib.Path:
    return pathlib.Path(cache_dir) / "own"


def not_a_config() -> int:
    return 3


@pytest.fixture
def trained(monkeypatch):
    calls = []
    monkeypatch.setattr("trainer.sft.run_sft", lambda config, cache_dir: calls.append((config, cache_dir)) or "dir")
    return calls


@pytest.mark.parametrize("attr", ["CONFIG", "config_fn"])
def test_a_config_or_a_function_returning_one_goes_through_run_sft(trained, attr):
    train = sft_warm.resolve(f"{HERE}:{attr}")
    assert trained == []  # resolving trains nothing: every spec is checked first
    assert train("/cache") == "dir" and trained == [(CONFIG, "/cache")]


def test_a_function_of_the_cache_dir_trains_itself(trained):
    train = sft_warm.resolve(f"{HERE}:trains_itself")
    assert train("/cache") == pathlib.Path("/cache/own") and trained == []


def test_anything_else_is_refused_by_name():
    with pytest.raises(TypeError, match="not_a_config gave int, not an SFTConfig"):
        sft_warm.resolve(f"{HERE}:not_a_config")
