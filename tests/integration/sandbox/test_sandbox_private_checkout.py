"""Issue 41: the sandbox works from a checkout in a private (0700) folder.

As root the service starts every sandbox as a foreign host uid, and bubblewrap resolves its bind
sources with that uid's permissions: anything bound in place from under a 0700 folder (the venv's
site-packages, a temp folder under a private TMPDIR) failed at the first program with
`bwrap: Can't find source path ...: Permission denied`. Run as another user the sandbox shares the
service's user and these tests pass either way (the situation cannot be built without root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sandbox.bwrap import DEFAULT_PYTHON_PACKAGES, python_package_binds
from sandbox.config import SandboxConfig
from sandbox.executor import Sandbox
from sandbox.models import RunRequest
from testing.sandbox_service import request, start_service

pytestmark = pytest.mark.sandbox
IS_ROOT = os.geteuid() == 0
PROGRAM = (
    "import os, cyaron, colorful, xeger\n"
    "print(cyaron.__name__, cyaron.__file__.startswith('/sandbox/lib/'))\n"
    "print('host path visible', os.path.exists({host!r}))\n"
)


@pytest.fixture
def private_dir():
    """A folder closed to everyone but its owner, like a home or a `mktemp -d` folder."""
    path = Path(tempfile.mkdtemp(prefix="sandbox-private-"))
    os.chmod(path, 0o700)
    yield path
    for dirpath, _, _ in os.walk(path):  # undo the non-root test's closed folder
        os.chmod(dirpath, 0o700)
    shutil.rmtree(path)


def private_site_packages(private_dir: Path) -> Path:
    """Copies of the packages cyaron generators need, as a venv under the private folder holds them."""
    site = private_dir / "repo" / ".venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    for src, name in python_package_binds(DEFAULT_PYTHON_PACKAGES, required=True):
        (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, site / name)
    return site


def test_packages_and_temp_folder_inside_a_private_folder(bwrap_ok, private_dir, monkeypatch):
    site = private_site_packages(private_dir)
    private_tmp = private_dir / "tmp"
    private_tmp.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))  # TMPDIR in the private folder too
    binds = tuple((str(site / name), name) for name in DEFAULT_PYTHON_PACKAGES)
    sb = Sandbox(SandboxConfig(python_lib_binds=binds, pool_size=0))
    try:
        out = sb.run(RunRequest(language="python", code=PROGRAM.format(host=str(site))))
        assert (out.status, out.stdout) == ("ok", "cyaron True\nhost path visible False\n"), out
        staged = sb._staged.root
        if IS_ROOT:  # the sandbox's uid cannot reach the private TMPDIR: staged in a shared one
            assert not staged.startswith(str(private_dir))
    finally:
        sb.close()
    assert not os.path.exists(staged)


def test_service_starts_from_a_private_checkout(bwrap_ok, private_dir, monkeypatch):
    """The report end to end: the service's interpreter finds the packages under the private folder."""
    site = private_site_packages(private_dir)
    private_tmp = private_dir / "tmp"
    private_tmp.mkdir(mode=0o700)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    probe = subprocess.run(
        [sys.executable, "-c", "import cyaron; print(cyaron.__file__)"], capture_output=True, text=True, check=True
    )
    assert probe.stdout.startswith(str(site)), probe.stdout
    service = start_service(["--workers", "1", "--pool-size", "1"])
    try:
        resp = request(
            "POST", service.url + "/run", {"language": "python", "code": PROGRAM.format(host=str(site))}, timeout_s=30
        )
        assert resp.status_code == 200, resp.text
        assert (resp.json()["status"], resp.json()["stdout"]) == ("ok", "cyaron True\nhost path visible False\n")
    finally:
        assert service.stop() == 0, service.log_text()


def test_an_unreachable_bind_source_is_named_at_start(bwrap_ok, private_dir):
    """No cryptic bwrap error at the first program: Sandbox() says which path and why."""
    data = private_dir / "data"
    data.mkdir()
    if IS_ROOT:
        cfg = SandboxConfig(extra_ro_binds=((str(data), "/data"),), switch_uid="on", pool_size=0)
        closed_mode = "0700"
    else:  # the sandbox shares our user: only a folder closed to its owner too is out of reach
        os.chmod(private_dir, 0o600)
        cfg = SandboxConfig(extra_ro_binds=((str(data), "/data"),), pool_size=0)
        closed_mode = "0600"
    with pytest.raises(ValueError) as info:
        Sandbox(cfg)
    message = str(info.value)
    assert message.startswith(f"the sandbox cannot read {data}: a folder above it ({private_dir}, mode {closed_mode}")
    assert "is closed to the sandbox's user" in message


@pytest.mark.skipif(not IS_ROOT, reason="the sandbox shares a non-root service's user, who owns the folder")
def test_a_staged_folder_closed_after_start_is_named_at_the_run(bwrap_ok):
    sb = Sandbox(SandboxConfig(pool_size=0, switch_uid="on"))
    try:
        os.chmod(sb._staged.root, 0o700)
        with pytest.raises(RuntimeError) as info:
            sb.run(RunRequest(language="python", code="print(1)"))
    finally:
        sb.close()
    message = str(info.value)
    assert "Permission denied" in message
    assert f"a folder above it ({sb._staged.root}, mode 0700, owner root) is closed" in message
