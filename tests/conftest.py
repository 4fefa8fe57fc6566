"""Suite-wide scheduling: the e2e tests' SFT models train in the background while the rest runs.

An e2e module names the SFT models it needs as ``SFT_WARMUP = ("module:ATTR", ...)`` (an SFTConfig, a
function returning one, or a function of the cache directory that trains into it: ``testing.sft_warm``).
When such modules are selected, one background process (``python -m testing.sft_warm``) trains those
models into ``.cache/sft``, one thread each, and the e2e modules run last, in the order their models
are ready, so the SFT's minutes overlap the tests that need no model. A fixture that asks for a model
still in training waits on the cache entry's lock (``trainer.sft.cached_training``) rather than
training a copy, and if the background process failed it trains the model itself.
``--no-sft-warmup`` turns this off.

Every run ends with its time per layer (unit, each integration area, e2e) against the layer's budget
(``testing.suite_layers``), after pytest's 30 slowest tests; ``tests/README.md`` has the rules.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SFT_CACHE = REPO / ".cache" / "sft"
WARMUP_LOG = SFT_CACHE / "warmup.log"
STOP_TIMEOUT_S = 30.0

_warmer: subprocess.Popen | None = None
_clock = None  # testing.suite_layers.LayerClock, made at the session's start


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-sft-warmup",
        action="store_true",
        help="do not train the e2e tests' SFT models in the background (they train when first needed)",
    )


def _warmups(item: pytest.Item) -> tuple[str, ...]:
    return tuple(getattr(getattr(item, "module", None), "SFT_WARMUP", ()))


def pytest_sessionstart(session: pytest.Session) -> None:
    global _clock
    from testing.suite_layers import LayerClock

    _clock = LayerClock()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _clock is not None:
        _clock.add(report.nodeid, report.duration)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Minutes per layer, against each layer's budget (the slowest CPU's; see tests/README.md)."""
    if _clock is None or not _clock.seconds:
        return
    terminalreporter.write_sep("=", "time per layer")
    for line in _clock.lines():
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules that need an SFT model go last, in the order their models finish training (the
    warm-up trains them in the order first named); a stable sort: every module keeps its own order."""
    if config.getoption("--no-sft-warmup"):
        return
    order: list[str] = []
    for item in items:
        order += [s for s in _warmups(item) if s not in order]
    items.sort(key=lambda item: max((1 + order.index(s) for s in _warmups(item)), default=0))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the background training for what the selected tests (after -k/-m) need."""
    global _warmer
    config = session.config
    if config.getoption("--no-sft-warmup") or config.getoption("collectonly"):
        return
    specs: list[str] = []
    for item in session.items:
        specs += [s for s in _warmups(item) if s not in specs]
    if not specs:
        return
    from ckpt_common.procs import die_with_parent
    from testing.vllm_servers import child_env

    SFT_CACHE.mkdir(parents=True, exist_ok=True)
    with open(WARMUP_LOG, "a") as log:
        _warmer = subprocess.Popen(
            [sys.executable, "-m", "testing.sft_warm", "--cache-dir", str(SFT_CACHE), *specs],
            cwd=REPO,
            env=child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    print(f"\nSFT warm-up in the background (pid {_warmer.pid}, log {WARMUP_LOG}): {', '.join(specs)}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop a warm-up still running (a partial run that needed no model); report one that failed."""
    if _warmer is None:
        return
    if _warmer.poll() is None:
        _warmer.terminate()
        try:
            _warmer.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _warmer.kill()
            _warmer.wait(STOP_TIMEOUT_S)
    elif _warmer.returncode != 0:
        print(f"\nSFT warm-up exited with {_warmer.returncode} (the tests trained what they needed); see {WARMUP_LOG}")
