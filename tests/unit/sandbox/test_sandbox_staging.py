"""Which host paths the sandbox's user can reach, and the staged copies of what it needs (issue 41:
a checkout in a private folder). Pure file-system checks: no bubblewrap needed."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from sandbox.staging import SandboxUser, access_problem, choose_staging_base, stage_files

FOREIGN = SandboxUser(uid=os.getuid() + 54_321, gid=os.getuid() + 54_321)  # owns nothing here
RUNNER = Path(__file__).resolve().parents[3] / "sandbox" / "runner.py"


@pytest.fixture
def tree():
    """open/ (0755, under /tmp) holding private/ (0700) holding pkg/ (0755) with a 0644 file."""
    open_dir = Path(tempfile.mkdtemp(prefix="sandbox-staging-test-", dir="/tmp"))
    os.chmod(open_dir, 0o755)
    private = open_dir / "private"
    pkg = private / "pkg"
    pkg.mkdir(parents=True)
    os.chmod(private, 0o700)
    (pkg / "__init__.py").write_text("VALUE = 7\n")
    os.chmod(pkg / "__init__.py", 0o644)
    yield open_dir
    shutil.rmtree(open_dir)


def test_a_private_folder_above_a_path_is_named(tree):
    target = tree / "private" / "pkg"
    problem = access_problem(str(target), FOREIGN)
    assert problem is not None
    assert problem.startswith(
        f"the sandbox cannot read {target}: a folder above it ({tree / 'private'}, mode 0700, owner "
    )
    assert "is closed to the sandbox's user (host uid" in problem
    assert access_problem(str(tree), FOREIGN) is None
    owner = SandboxUser(uid=os.getuid(), gid=os.getgid())
    assert access_problem(str(target), owner) is None  # the owner may traverse its own folder


def test_a_closed_file_a_missing_path_and_a_symlink_into_a_private_folder(tree):
    secret = tree / "secret.txt"
    secret.write_text("x")
    os.chmod(secret, 0o600)
    assert "the file itself (mode 0600" in access_problem(str(secret), FOREIGN)
    assert access_problem(str(tree / "nothing"), FOREIGN).endswith("it does not exist")
    link = tree / "link"
    link.symlink_to(tree / "private" / "pkg")  # bubblewrap resolves it: the target's folders count
    assert f"a folder above it ({tree / 'private'}, mode 0700" in access_problem(str(link), FOREIGN)
    assert "not an absolute path" in access_problem("relative/path", FOREIGN)


def test_staging_goes_where_the_sandbox_user_can_reach(tree):
    private = str(tree / "private")
    assert choose_staging_base(FOREIGN, [private, str(tree)]) == str(tree)
    with pytest.raises(ValueError, match=r"no folder .*\(mode 0700"):
        choose_staging_base(FOREIGN, [private, str(tree / "missing")])


def test_staged_copies_are_readable_compiled_and_removed(tree):
    pkg = tree / "private" / "pkg"
    os.chmod(pkg / "__init__.py", 0o600)  # as a umask-077 clone leaves it
    module = tree / "private" / "single.py"
    module.write_text("X = 1\n")
    tool = pkg / "tool.sh"
    tool.write_text("#!/bin/sh\n")
    os.chmod(tool, 0o700)
    staged = stage_files(sys.executable, [(str(pkg), "pkg"), (str(module), "single.py")], RUNNER, FOREIGN)
    try:
        root = Path(staged.root)
        assert root.parent == Path(choose_staging_base(FOREIGN))
        for path in (staged.runner_dir, f"{staged.lib_dir}/pkg/__init__.py", f"{staged.lib_dir}/single.py"):
            assert access_problem(path, FOREIGN) is None, path
        assert stat.S_IMODE(os.stat(f"{staged.lib_dir}/pkg/__init__.py").st_mode) == 0o644
        assert stat.S_IMODE(os.stat(f"{staged.lib_dir}/pkg/tool.sh").st_mode) == 0o755
        assert stat.S_IMODE(root.stat().st_mode) == 0o755
        assert (Path(staged.lib_dir) / "pkg" / "__init__.py").read_text() == "VALUE = 7\n"
        assert list((Path(staged.runner_dir) / "__pycache__").glob("sandbox_runner.*.pyc"))
        assert list((Path(staged.lib_dir) / "pkg" / "__pycache__").glob("__init__.*.pyc"))
    finally:
        staged.remove()
    assert not root.exists()


def test_a_package_the_service_cannot_copy_is_named(tree):
    with pytest.raises(RuntimeError, match=r"cannot copy python package gone from /nonexistent/gone"):
        stage_files(sys.executable, [("/nonexistent/gone", "gone")], RUNNER, FOREIGN, base=str(tree))
    assert not list(tree.glob("sandbox-files-*"))  # nothing left behind
