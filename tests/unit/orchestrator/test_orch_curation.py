"""Prompt-set curation on a scripted engine: format filters, the easy-to-hack filter (N direct-answer
tries), pass rates over the samples, the output records; the CLI's --help stays light."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from orchestrator import curation
from orchestrator.curation import CurationConfig, curate, summarize
from orchestrator.engines.base import GenResult

REPO = pathlib.Path(__file__).resolve().parents[3]
EOS = 2


def encode(text):
    return [1] + [ord(c) for c in text]


def decode(ids):
    return "".join(chr(t) for t in ids if t != EOS)


class ScriptedEngine:
    """Per prompt: how many of the sampled (chain-of-thought) copies answer right, and which direct-answer
    try (if any) guesses the answer; copy c of a problem is request "<s|d><index>.<c>"."""

    def __init__(self, script):
        self.script = script  # expression -> (answer, num_correct_samples, first_guessing_try or None)
        self.calls = []

    def generate(self, requests, sampling, *, repeat=None, on_result=None, timeout_s=900.0):
        self.calls.append((sampling.temperature, [r.request_id for r in requests]))
        results = []
        for r in requests:
            prompt = decode(r.prompt_token_ids[1:])
            copy = int(r.request_id.rsplit(".", 1)[1])
            if prompt.endswith("#### "):  # asked to answer directly
                answer, _, guess_at = self.script[prompt[: -len("#### ")]]
                text = answer if guess_at is not None and copy >= guess_at else "12345"
                assert r.max_tokens == 8
            else:
                answer, num_correct, _ = self.script[prompt]
                text = f"1+1+0=2\n#### {answer if copy < num_correct else 99999}"
            results.append(GenResult(r.request_id, tuple(encode(text)[1:]) + (EOS,), "stop"))
        return results


def line(prompt, answer, **extra):
    return json.dumps({"prompt": prompt, "answer": answer, **extra})


SCRIPT = {"3+4\n": ("7", 10, None), "25+38\n": ("63", 3, 7), "41+22\n": ("63", 6, 8), "90-45\n": ("45", 0, None)}
LINES = [
    line("3+4\n", "7", id="a", level=1),  # solved 10/10, never guessed: kept (pass rate 1)
    line("25+38\n", 63, id="b"),  # guessed on the 8th direct try (index 7 < N = 8): easy to hack
    line("41+22\n", "63", id="c"),  # would be guessed on the 9th try only: not within N = 8, kept
    line("90-45\n", "45", id="d"),  # never solved: kept, difficulty 1
    line("   \n", "1", id="e"),  # empty prompt
    line("1+" * 20 + "1\n", "21", id="f"),  # 42 characters + bos > 16 tokens: overlong
    line("7/2\n", "3.5", id="g"),  # the verifier reads integers only: uncheckable
    line("5+2\n", "007", id="h"),  # "#### 007" reads as 7: never equal to "007"
    line("5+3\n", "", id="i"),  # empty answer
    "not json",
    json.dumps({"prompt": 3, "answer": "1"}),
    json.dumps({"prompt": "1+1\n", "answer": True}),
]
EXPECTED = [
    ("a", "kept", 1.0),
    ("b", "easy_to_hack", 0.3),
    ("c", "kept", 0.6),
    ("d", "kept", 0.0),
    ("e", "empty_prompt", None),
    ("f", "overlong_prompt", None),
    ("g", "uncheckable_answer", None),
    ("h", "uncheckable_answer", None),
    ("i", "uncheckable_answer", None),
    (None, "bad_record", None),
    (None, "bad_record", None),
    (None, "bad_record", None),
]


def test_curation_filters_and_pass_rates():
    engine = ScriptedEngine(SCRIPT)
    config = CurationConfig(max_prompt_tokens=16, temperature=1.2, hack_temperature=0.9)
    results = curate(LINES, engine, encode, decode, config)
    assert [(r.get("id"), r["reason"], r.get("pass_rate")) for r in results] == EXPECTED
    assert [r["kept"] for r in results] == [reason == "kept" for _, reason, _ in EXPECTED]
    by_id = {r.get("id"): r for r in results}
    assert by_id["a"]["level"] == 1 and by_id["a"]["difficulty"] == 0.0 and by_id["d"]["difficulty"] == 1.0
    assert by_id["b"]["num_direct_correct"] == 1 and by_id["c"]["num_direct_correct"] == 0
    assert by_id["b"]["num_correct"] == 3 and by_id["b"]["num_samples"] == 10
    assert [r["line"] for r in results if r["reason"] == "bad_record"] == [10, 11, 12]
    # only the 4 well-formed problems reach the engine: 10 samples each at the sampling temperature,
    # then N = 8 direct tries each at the hack temperature
    (t_samples, samples), (t_direct, direct) = engine.calls
    assert t_samples == 1.2 and len(samples) == 40 and all(i.startswith("s") for i in samples)
    assert t_direct == 0.9 and len(direct) == 32 and all(i.startswith("d") for i in direct)
    assert summarize(results) == {
        "num_problems": 12,
        "num_kept": 3,
        "mean_pass_rate": pytest.approx(1.9 / 4),
        "reasons": {
            "kept": 3,
            "easy_to_hack": 1,
            "empty_prompt": 1,
            "overlong_prompt": 1,
            "uncheckable_answer": 3,
            "bad_record": 3,
        },
    }


def test_too_easy_threshold_and_chunks():
    engine = ScriptedEngine(SCRIPT)
    config = CurationConfig(max_prompt_tokens=16, max_pass_rate=0.5, request_chunk_problems=3)
    results = curate(LINES[:4], engine, encode, decode, config)
    assert [r["reason"] for r in results] == ["too_easy", "easy_to_hack", "too_easy", "kept"]
    assert len(engine.calls) == 4  # two chunks (3 + 1 problems), two generate calls each


def test_no_hack_tries_means_no_direct_requests():
    engine = ScriptedEngine(SCRIPT)
    results = curate(LINES[:2], engine, encode, decode, CurationConfig(num_hack_tries=0))
    assert [r["reason"] for r in results] == ["kept", "kept"] and len(engine.calls) == 1


@pytest.mark.parametrize(
    "kwargs", [{"num_samples": 0}, {"num_hack_tries": -1}, {"temperature": 0}, {"max_pass_rate": 1.5}]
)
def test_config_rejects(kwargs):
    with pytest.raises(ValueError):
        CurationConfig(**kwargs)


def test_cli_help_is_light_and_missing_input_is_an_error(tmp_path):
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import sys, orchestrator.curation; "
                "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
            ),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0 and check.stdout.strip() == "[]", check.stderr
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.curation", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--num-hack-tries" in out.stdout
    assert (
        curation.main(
            [
                "--problems",
                str(tmp_path / "missing.jsonl"),
                "--out",
                str(tmp_path / "o.jsonl"),
                "--model",
                str(tmp_path),
            ]
        )
        == 2
    )


def test_cli_flags_come_from_the_configs(tmp_path, capsys):
    from orchestrator.config import EngineConfig

    parser, config_args, engine_args = curation._parser()
    args = parser.parse_args(["--problems", "p", "--out", "o", "--model", "m"])
    assert config_args.build(args, parser) == CurationConfig()
    assert engine_args.build(args, parser) == EngineConfig()
    args = parser.parse_args(["--problems", "p", "--out", "o", "--model", "m", "--num-hack-tries", "0"])
    assert config_args.build(args, parser) == CurationConfig(num_hack_tries=0)
    with pytest.raises(SystemExit) as e:
        curation.main(["--problems", "p", "--out", "o", "--model", "m", "--max-pass-rate", "2"])
    assert (
        e.value.code == 2 and "max_pass_rate=2.0 must be in [0, 1] (flag: --max-pass-rate)" in capsys.readouterr().err
    )
