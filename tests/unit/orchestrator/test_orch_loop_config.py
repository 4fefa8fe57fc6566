"""The RL job's config: JSON + --set overrides into validated frozen dataclasses; the CLI is thin."""

import json
import pathlib
import subprocess
import sys

import pytest

from ckpt_common.dictconfig import apply_overrides, config_differences, from_dict, parse_override, to_dict
from orchestrator.config import JobConfig, load_config
from orchestrator.loop_setup import check_resumable

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_defaults_round_trip_through_json():
    config = JobConfig()
    data = json.loads(json.dumps(to_dict(config)))
    assert from_dict(JobConfig, data) == config


def test_demo_config_loads_and_differs_from_defaults_only_where_it_says():
    path = REPO / "configs" / "demo.json"
    config = load_config(path)
    written = json.loads(path.read_text())
    changed = config_differences(to_dict(JobConfig()), to_dict(config))
    assert changed, "the demo config should tune something"
    for dotted in changed:
        node = written
        for key in dotted.split("."):
            assert key in node, f"{dotted} changed but the file does not set it"
            node = node[key]


@pytest.mark.parametrize(
    "text, keys, value",
    [
        ("rl.lr=3e-4", ["rl", "lr"], 3e-4),
        ("rl.num_iterations=40", ["rl", "num_iterations"], 40),
        ("rollout.exclude_stale_segments=true", ["rollout", "exclude_stale_segments"], True),
        ("data.train_levels=[3,5]", ["data", "train_levels"], [3, 5]),
        ("engine.endpoint=http://127.0.0.1:8000", ["engine", "endpoint"], "http://127.0.0.1:8000"),
        ("sft_cache_dir=/tmp/x", ["sft_cache_dir"], "/tmp/x"),
    ],
)
def test_parse_override(text, keys, value):
    assert parse_override(text) == (keys, value)


def test_overrides_apply_to_nested_sections():
    config = load_config(None, ["rl.lr=0.002", "sampling.curriculum.warmup_iterations=7", "data.train_levels=[3,5]"])
    assert config.rl.lr == 0.002 and isinstance(config.rl.lr, float)
    assert config.sampling.curriculum.warmup_iterations == 7
    assert config.data.train_levels == (3, 5)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rl.lrr=1"], r"rl\.lrr"),
        (["nosuch.x=1"], "nosuch"),
        (["rl.lr=0"], r"rl\.lr=0"),
        (["rl.num_responses_per_prompt=1"], "num_responses_per_prompt"),
        (["rl.top_p=1.5"], "top_p"),
        (["rollout.segment_max_tokens=0"], "segment_max_tokens"),
        (["rollout.iteration_token_budget=16"], "iteration_token_budget"),
        (["engine.max_model_len=64"], "max_model_len"),
        (["engine.type=vllm_http"], "endpoint"),
        (["reward.type=code_sandbox"], "sandbox_url"),
        (["reward.reward_model=nomodule"], "reward_model"),
        (["data.train_levels=[9]"], "train_levels"),
        (["eval.every_iterations=0"], "every_iterations"),
        (["sampling.curriculum.easy_weight=2"], "easy_weight"),
        (["length_penalty.weight=-1"], "weight"),
        (["repeat.min_repeats=1"], "min_repeats"),
        (["sft.num_steps=0"], "num_steps"),
        (["rl=3"], "rl"),
    ],
)
def test_bad_values_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def test_override_into_a_leaf_is_rejected():
    with pytest.raises(ValueError, match="not a config section"):
        apply_overrides({"rl": {"lr": 1}}, ["rl.lr.x=2"])


def test_resume_allows_only_listed_changes():
    saved = to_dict(JobConfig())
    check_resumable(saved, to_dict(load_config(None, ["rl.num_iterations=99", "eval.every_iterations=2"])))
    with pytest.raises(ValueError, match=r"rl\.lr"):
        check_resumable(saved, to_dict(load_config(None, ["rl.lr=0.01"])))


def test_help_is_instant_and_print_config_works():
    def orchestrator(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *args], cwd=REPO, capture_output=True, text=True, timeout=60
        )

    # instant: --help imports none of the heavy libraries (a deterministic check; a timed one fails
    # on a loaded machine)
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "orchestrator", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "--output-dir" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "vllm", "transformers", "megatron"}, sorted(imported & {"torch", "vllm"})
    out = orchestrator("--output-dir", "unused", "--print-config", "--set", "rl.lr=0.005")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rl"]["lr"] == 0.005
    out = orchestrator("--output-dir", "unused", "--print-config", "--set", "rl.lr=-1")
    assert out.returncode == 2 and "rl.lr" in out.stderr


@pytest.mark.parametrize(
    "schedule, iteration, expected",
    [
        ("constant", 0, 1e-4),
        ("constant", 9, 1e-4),
        ("cosine", 0, 1e-4),
        ("cosine", 9, 2e-5),
        ("cosine", 20, 2e-5),
        ("cosine", 4.5, 6e-5),  # half way: the mean of start and floor
    ],
)
def test_lr_schedule(schedule, iteration, expected):
    rl = load_config(
        None, [f"rl.lr_schedule={schedule}", "rl.lr=1e-4", "rl.min_lr_ratio=0.2", "rl.num_iterations=10"]
    ).rl
    assert rl.lr_at(iteration) == pytest.approx(expected)


def test_a_reused_sections_error_names_its_key_path():
    with pytest.raises(ValueError, match=r"^sft: lr=-1\.0 must be > 0"):
        load_config(None, ["sft.lr=-1.0"])
    with pytest.raises(ValueError, match=r"^rl\.lr="):  # the section's own message already names it
        load_config(None, ["rl.lr=-1.0"])
    with pytest.raises(ValueError, match=r"^sampling\.curriculum: CurriculumConfig\.warmup_iterations"):
        load_config(None, ["sampling.curriculum.warmup_iterations=-1"])
