"""Fixtures for the sandbox tests: a bubblewrap probe (skip with the reason where it cannot run) and
the real service started as a subprocess on a free port (testing.sandbox_service)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testing.sandbox_service import start_service

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def bwrap_ok() -> None:
    from sandbox.bwrap import probe_bwrap

    reason = probe_bwrap()
    if reason is not None:
        pytest.skip(f"bubblewrap cannot run here: {reason}")
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("no /usr/bin/python3 to run inside the sandbox (apt install python3)")


@pytest.fixture(scope="module")
def service(bwrap_ok):
    svc = start_service(["--workers", "2", "--max-queue", "32", "--pool-size", "4", "--max-timeout-s", "10"])
    yield svc
    rc = svc.stop()
    assert rc == 0, f"sandbox service exited with {rc}: {svc.log_text()}"
