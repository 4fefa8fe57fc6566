"""The host files a sandbox sees besides the system directories, and whether its user can reach them.

bubblewrap resolves every bind source with the host credentials it was started with. When the
service runs as root it starts each sandbox as a foreign host uid (uid_base + i, no groups), so a
source under a private folder (a 0700 home or temp folder holding the checkout and its venv) is
out of reach: `bwrap: Can't find source path ...: Permission denied`. Binding by file descriptor
does not help with bubblewrap < 0.9: it resolves `/proc/self/fd/N` back to the path first.

So the service copies what it needs from the checkout (the supervisor and the python packages
that test generators import) once at start into a fresh folder of its own, in a temp location
that every user can traverse, with modes that let the sandbox read (never write) them:

    <tmp>/sandbox-files-XXXX/        0755, removed when the Sandbox closes (or the service exits)
        runner/sandbox_runner.py     + bytecode  ──ro──▶ /sandbox/runner
        lib/<package>/...            + bytecode  ──ro──▶ /sandbox/lib

`access_problem` says, in words, why the sandbox's user cannot reach a host path (None when it
can): the service checks every bind source with it at start instead of failing at the first run.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

STAGE_PREFIX = "sandbox-files-"
_R, _X = 4, 1


@dataclass(frozen=True)
class SandboxUser:
    """Whose permissions bubblewrap has on the host when it resolves bind sources.

    `uid` None: the service's own user (checked with os.access). Otherwise a foreign host uid
    without supplementary groups (the service running as root switches every sandbox to one)."""

    uid: int | None = None
    gid: int | None = None
    label: str = ""

    def describe(self) -> str:
        if self.label:
            return self.label
        if self.uid is None:
            return f"the service's own user (uid {os.getuid()})"
        return f"host uid {self.uid}, no supplementary groups"

    def may(self, path: str, st: os.stat_result, want: int) -> bool:
        """Whether this user has the `want` bits (4 read, 1 search/execute) on `path`."""
        if self.uid is None:
            return os.access(path, (os.R_OK if want & _R else 0) | (os.X_OK if want & _X else 0))
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            bits = (st.st_mode >> 6) & 7
        elif self.gid is not None and st.st_gid == self.gid:
            bits = (st.st_mode >> 3) & 7
        else:
            bits = st.st_mode & 7
        return bits & want == want


def _owner(st: os.stat_result) -> str:
    try:
        import pwd

        return pwd.getpwuid(st.st_uid).pw_name
    except (ImportError, KeyError):
        return f"uid {st.st_uid}"


def _ancestors(path: str) -> list[str]:
    """'/a/b/c' -> ['/', '/a', '/a/b'] (lexically, without resolving symlinks)."""
    parts = Path(os.path.normpath(path)).parts
    return [str(Path(*parts[:i])) for i in range(1, len(parts))]


def access_problem(path: str, user: SandboxUser) -> str | None:
    """None when `user` can resolve and read `path`; else a sentence naming the path and why not.

    Checks search permission on every folder above the path (as written and after resolving its
    symlinks, as bubblewrap does) and read permission on the path itself (and search, for a
    folder)."""
    if not path.startswith("/"):
        return f"the sandbox cannot read {path}: not an absolute path"
    who = user.describe()
    real = os.path.realpath(path)
    seen: set[str] = set()
    for folder in _ancestors(path) + _ancestors(real):
        if folder in seen:
            continue
        seen.add(folder)
        try:
            st = os.stat(folder)
        except OSError as exc:
            return f"the sandbox cannot read {path}: the service cannot inspect {folder} ({exc.strerror})"
        if not user.may(folder, st, _X):
            return (
                f"the sandbox cannot read {path}: a folder above it ({folder}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}, owner {_owner(st)}) is closed to the sandbox's user "
                f"({who}); open that folder to others (chmod o+x {folder}) or keep this file elsewhere"
            )
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return f"the sandbox cannot read {path}: it does not exist"
    except OSError as exc:
        return f"the sandbox cannot read {path}: the service cannot inspect it ({exc.strerror})"
    want = _R | _X if stat.S_ISDIR(st.st_mode) else _R
    if not user.may(real, st, want):
        kind = "folder" if stat.S_ISDIR(st.st_mode) else "file"
        return (
            f"the sandbox cannot read {path}: the {kind} itself (mode {stat.S_IMODE(st.st_mode):04o}, "
            f"owner {_owner(st)}) is closed to the sandbox's user ({who})"
        )
    return None


def access_problems(paths: Iterable[str], user: SandboxUser) -> list[str]:
    return [p for p in (access_problem(path, user) for path in paths) if p is not None]


@dataclass(frozen=True)
class StagedFiles:
    """A staging folder: `runner_dir` is bound at /sandbox/runner, `lib_dir` at /sandbox/lib."""

    root: str
    runner_dir: str
    lib_dir: str

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def staging_candidates() -> list[str]:
    """Where a staging folder may go, most preferred first."""
    out: list[str] = []
    for base in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        if base not in out:
            out.append(base)
    return out


def choose_staging_base(user: SandboxUser, candidates: Sequence[str] | None = None) -> str:
    """The first candidate folder the service can write and the sandbox's user can reach."""
    reasons = []
    for base in staging_candidates() if candidates is None else candidates:
        if not os.path.isdir(base):
            reasons.append(f"{base} is not a folder")
            continue
        if not os.access(base, os.W_OK | os.X_OK):
            reasons.append(f"the service cannot write {base}")
            continue
        problem = access_problem(base, user)
        if problem is None:
            return base
        reasons.append(problem)
    raise ValueError(
        "no folder where the service can put the sandbox's files (supervisor, python packages) that "
        "the sandbox's user can reach: " + "; ".join(reasons) + " (set TMPDIR to a folder open to others)"
    )


def _open_modes(root: str) -> None:
    """Folders 0755, files 0644 (0755 when executable by their owner); symlinks left alone."""
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.chmod(path, 0o755 if st.st_mode & stat.S_IXUSR else 0o644)


_COMPILE = (
    "import compileall, py_compile, sys\n"
    "py_compile.compile(sys.argv[1], doraise=True)\n"
    "compileall.compile_dir(sys.argv[2], quiet=2)\n"  # best effort: a package may hold odd files
)


def stage_files(
    python_executable: str,
    packages: Sequence[tuple[str, str]],
    runner_source: str | os.PathLike,
    user: SandboxUser,
    *,
    base: str | None = None,
    timeout_s: float = 60.0,
) -> StagedFiles:
    """Copy the supervisor and `packages` ((host path, name under /sandbox/lib) pairs) into a fresh
    folder the sandbox's user can read, with bytecode made by the sandbox's own interpreter."""
    base = choose_staging_base(user) if base is None else base
    root = tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=base)
    staged = StagedFiles(root, os.path.join(root, "runner"), os.path.join(root, "lib"))
    try:
        os.mkdir(staged.runner_dir)
        os.mkdir(staged.lib_dir)
        runner = os.path.join(staged.runner_dir, "sandbox_runner.py")
        shutil.copyfile(runner_source, runner)
        for src, name in packages:
            dest = os.path.join(staged.lib_dir, name)
            try:
                if os.path.isdir(src):
                    # copy2 keeps mtimes, so bytecode already next to the sources stays valid
                    shutil.copytree(src, dest, symlinks=False, ignore_dangling_symlinks=True)
                else:
                    shutil.copy2(src, dest)
            except (OSError, shutil.Error) as exc:
                raise RuntimeError(f"cannot copy python package {name} from {src} for the sandbox: {exc}") from exc
        proc = subprocess.run(
            [python_executable, "-I", "-S", "-c", _COMPILE, runner, staged.lib_dir],
            capture_output=True,
            timeout=timeout_s,
            env={},
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{python_executable} cannot compile the sandbox supervisor: "
                f"{proc.stderr.decode(errors='replace')[-1000:]}"
            )
        _open_modes(root)
        problem = access_problem(runner, user)
        if problem is not None:
            raise ValueError(problem)
    except BaseException:
        staged.remove()
        raise
    return staged
