"""Fixtures shared by the multi-process tests."""

from __future__ import annotations

import shutil

import pytest

from tests.integration.dist.harness import etcd_server


@pytest.fixture
def etcd_port(tmp_path):
    """A real one-member etcd for this test (the apt etcd-server binary); skips where it is missing."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd binary not installed")
    with etcd_server(tmp_path / "etcd") as port:
        yield port
