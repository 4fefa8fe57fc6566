"""Configuration of the sandbox executor and of the HTTP service (frozen, validated dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ckpt_common.cli_config import meta
from ckpt_common.logs import DEFAULT_LOG_LEVEL, check_log_level
from ckpt_common.validate import check_int, check_literals, check_number

from .models import RunRequest

MIB = 1 << 20


@dataclass(frozen=True)
class SandboxConfig:
    """How sandboxes are built and which limits apply to every run.

    `python_lib_binds` lists (host_dir, name) pairs: each host package directory (or module file)
    is copied once at start into a staging folder that the sandbox's user can read (the checkout
    may sit in a private folder it cannot traverse) and appears read-only as /sandbox/lib/<name>
    inside; /sandbox/lib is first on the program's sys.path (this is how test-case generators get
    `cyaron` without seeing the host's site-packages). `extra_ro_binds` are bound in place: their
    sources must be reachable by the sandbox's user (checked at start). The `help` of a field is its
    flag's help on `python -m sandbox` (`sandbox/__main__.py`).
    """

    bwrap_path: str = field(default="/usr/bin/bwrap", metadata=meta("the bubblewrap binary"))
    setpriv_path: str = "/usr/bin/setpriv"  # used to switch uid when present (util-linux)
    python_executable: str = field(default="/usr/bin/python3", metadata=meta("the interpreter run inside"))
    c_compiler: str = "/usr/bin/gcc"
    cpp_compiler: str = "/usr/bin/g++"
    c_flags: tuple[str, ...] = ("-O2", "-std=gnu11", "-pipe")
    cpp_flags: tuple[str, ...] = ("-O2", "-std=gnu++17", "-pipe")
    system_paths: tuple[str, ...] = ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc/ld.so.cache", "/etc/alternatives")
    extra_ro_binds: tuple[tuple[str, str], ...] = ()
    python_lib_binds: tuple[tuple[str, str], ...] = ()
    tmpfs_size_mb: int = 64
    switch_uid: Literal["auto", "on", "off"] = "auto"
    uid_base: int = field(default=100_000, metadata=meta("first host uid for sandboxes (when running as root)"))
    num_uids: int = 512
    min_memory_mb: int = 32
    max_memory_mb: int = field(default=4096, metadata=meta("the largest memory_mb a request may ask for"))
    max_timeout_s: float = field(default=30.0, metadata=meta("the largest timeout_s a request may ask for"))
    max_code_bytes: int = 512 * 1024
    max_stdin_bytes: int = 16 * MIB
    max_stdout_bytes: int = 4 * MIB
    max_stderr_bytes: int = 256 * 1024
    max_binary_bytes: int = 16 * MIB
    max_processes: int = field(default=32, metadata=meta("processes per run"))
    max_file_size_mb: int = 16
    max_open_files: int = 256
    compile_timeout_s: float = 20.0
    compile_memory_mb: int = 2048
    setup_timeout_s: float = 10.0
    kill_grace_s: float = 3.0
    pool_size: int = field(default=4, metadata=meta("pre-started sandboxes kept warm (0 disables)"))
    use_cgroup: Literal["auto", "off"] = field(
        default="auto", metadata=meta("cgroup v2 limits per run: where usable (auto), or never (off)")
    )
    cgroup_root: str = "/sys/fs/cgroup"

    def __post_init__(self) -> None:
        for name in ("max_timeout_s", "compile_timeout_s", "setup_timeout_s", "kill_grace_s"):
            check_number(name, getattr(self, name))
        for name in (
            "tmpfs_size_mb",
            "num_uids",
            "min_memory_mb",
            "max_memory_mb",
            "max_code_bytes",
            "max_stdin_bytes",
            "max_stdout_bytes",
            "max_stderr_bytes",
            "max_binary_bytes",
            "max_processes",
            "max_file_size_mb",
            "max_open_files",
            "compile_memory_mb",
        ):
            check_int(name, getattr(self, name))
        if isinstance(self.pool_size, bool) or not isinstance(self.pool_size, int) or self.pool_size < 0:
            raise ValueError(f"pool_size must be an integer >= 0, got {self.pool_size!r}")
        if self.min_memory_mb > self.max_memory_mb:
            raise ValueError(f"min_memory_mb ({self.min_memory_mb}) must be <= max_memory_mb ({self.max_memory_mb})")
        if self.max_binary_bytes >= self.tmpfs_size_mb * MIB:
            raise ValueError(
                f"max_binary_bytes ({self.max_binary_bytes}) must be smaller than the "
                f"sandbox tmpfs (tmpfs_size_mb={self.tmpfs_size_mb})"
            )
        check_literals(self)
        if not isinstance(self.uid_base, int) or self.uid_base < 1000:
            raise ValueError(f"uid_base must be an integer >= 1000, got {self.uid_base!r}")
        if self.max_processes < 4:
            raise ValueError(f"max_processes must be >= 4 (bwrap, runner and program), got {self.max_processes}")
        names = [name for _, name in self.python_lib_binds]
        if len(set(names)) != len(names):
            raise ValueError(f"python_lib_binds names must be unique, got {names}")
        for host_dir, name in self.python_lib_binds:
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"python_lib_binds name must be a plain directory name, got {name!r}")
            if not host_dir.startswith("/"):
                raise ValueError(f"python_lib_binds host dir must be absolute, got {host_dir!r}")

    def check_request(self, request: RunRequest) -> None:
        """Raise ValueError naming the field when a request exceeds what this sandbox allows."""
        if not self.min_memory_mb <= request.memory_mb <= self.max_memory_mb:
            raise ValueError(
                f"memory_mb must be in [{self.min_memory_mb}, {self.max_memory_mb}], got {request.memory_mb}"
            )
        if request.timeout_s > self.max_timeout_s:
            raise ValueError(f"timeout_s must be <= {self.max_timeout_s}, got {request.timeout_s}")
        code_bytes = len(request.code.encode("utf-8", "surrogatepass"))
        if code_bytes > self.max_code_bytes:
            raise ValueError(f"code is {code_bytes} bytes, more than max_code_bytes={self.max_code_bytes}")
        stdin_bytes = len(request.stdin.encode("utf-8", "surrogatepass"))
        if stdin_bytes > self.max_stdin_bytes:
            raise ValueError(f"stdin is {stdin_bytes} bytes, more than max_stdin_bytes={self.max_stdin_bytes}")


@dataclass(frozen=True)
class ServiceConfig:
    """The HTTP service: where it listens, how many runs at once, how many may wait."""

    host: str = field(default="127.0.0.1", metadata=meta("address to bind"))
    port: int = field(default=8090, metadata=meta("port to listen on (0: any free one)"))
    num_workers: int = field(default=2, metadata=meta("runs at once"))
    max_queue: int = field(default=64, metadata=meta("requests that may wait beyond the running ones (then 503)"))
    queue_timeout_s: float = field(default=60.0, metadata=meta("the longest a request may wait (then 503)"))
    max_judge_cases: int = field(default=500, metadata=meta("test cases one /judge request may hold"))
    max_body_bytes: int = field(
        default=64 * MIB, metadata=meta("the largest request body, in bytes of JSON (then 413)")
    )
    log_level: str = field(
        default=DEFAULT_LOG_LEVEL, metadata=meta("a logging level name: DEBUG, INFO, WARNING, ERROR")
    )
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        check_int("num_workers", self.num_workers)
        check_int("max_judge_cases", self.max_judge_cases)
        check_number("queue_timeout_s", self.queue_timeout_s)
        check_int("max_body_bytes", self.max_body_bytes)
        largest_run = self.sandbox.max_code_bytes + self.sandbox.max_stdin_bytes
        if self.max_body_bytes < largest_run:
            raise ValueError(
                f"max_body_bytes ({self.max_body_bytes}) must hold the largest /run the sandbox takes "
                f"(max_code_bytes + max_stdin_bytes = {largest_run})"
            )
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        if not self.host:
            raise ValueError("host must be a non-empty address")
        check_log_level("log_level", self.log_level)
