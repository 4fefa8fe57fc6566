"""Runs one untrusted program in a fresh bubblewrap sandbox and says what happened.

    Sandbox.run(RunRequest)
      ├─ python:  pool.acquire() ─▶ send code ─▶ supervisor forks program ─▶ drive I/O ─▶ classify
      └─ c/cpp:   compile in one sandbox (binary comes back on stdout) ─▶ run it in another

    drive I/O: one selector over stdout, stderr (byte budgets) and the status fd; stdin and the
    request are written non-blocking; the wall clock starts at the supervisor's `start`; at the
    deadline or on a budget overflow the sandbox's pid-namespace init is SIGKILLed, which takes
    every process of the run with it. Sandboxes are single use.

Blocking by design: the service calls `run` from a bounded thread pool.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from .bwrap import sandbox_argv, system_mount_args, visible_inside
from .cgroup import CgroupSupport, RunCgroup, probe_cgroup_v2
from .config import MIB, SandboxConfig
from .models import RunRequest, RunResult
from .pool import UidAllocator, WarmPool
from .process import Member, Pipes, kill_sandbox, sweep_uid
from .protocol import Limits, Observation, classify, cpu_limit_s, encode_request, parse_exit
from .runner import BOOT as RUNNER_BOOT
from .staging import SandboxUser, access_problems, stage_files

logger = logging.getLogger(__name__)
_STATUS_CAP_BYTES = 4096


@dataclass
class _Outcome:
    stdout: bytes = b""
    stderr: bytes = b""
    status_lines: list[str] = field(default_factory=list)
    timed_out: bool = False
    output_exceeded: bool = False
    run_wall_s: float = 0.0
    oom_killed: bool = False


def _observation(mode: str, report, out: _Outcome, limits: Limits, stderr_tail: bytes = b"") -> Observation:
    """What `classify` needs of one sandboxed run."""
    return Observation(
        mode=mode,
        report=report,
        timed_out=out.timed_out,
        output_exceeded=out.output_exceeded,
        oom_killed=out.oom_killed,
        memory_bytes=limits.memory_bytes,
        cpu_limit_s=limits.cpu_s,
        stderr_tail=stderr_tail,
    )


class Sandbox:
    """Executes RunRequests in bubblewrap sandboxes, with a warm pool of pre-started ones."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        if not os.path.exists(config.python_executable):
            raise ValueError(f"python_executable {config.python_executable} does not exist")
        if not visible_inside(config.python_executable, config):
            raise ValueError(
                f"python_executable {config.python_executable} is not inside the "
                f"sandbox's system paths; add a read-only bind (extra_ro_binds)"
            )
        if config.switch_uid == "on" and os.geteuid() != 0:
            raise ValueError("switch_uid='on' needs root; use 'auto' or 'off'")
        self.switch_uid = config.switch_uid == "on" or (config.switch_uid == "auto" and os.geteuid() == 0)
        self.user = (
            SandboxUser(
                uid=config.uid_base,
                gid=config.uid_base,
                label=f"host uids {config.uid_base}-{config.uid_base + config.num_uids - 1}, no supplementary groups",
            )
            if self.switch_uid
            else SandboxUser()
        )
        # say now, naming the path, what bubblewrap would only say as a cryptic failure at the first run
        problems = access_problems(self._bind_sources(), self.user)
        if problems:
            raise ValueError("; ".join(problems))
        self._staged = stage_files(
            config.python_executable, config.python_lib_binds, Path(__file__).with_name("runner.py"), self.user
        )
        self._cleanup = weakref.finalize(self, self._staged.remove)  # also runs at interpreter exit
        self._argv = sandbox_argv(
            config, system_mount_args(config.system_paths), self._staged.runner_dir, self._staged.lib_dir
        ) + [
            config.python_executable,
            "-I",
            "-S",
            "-c",
            RUNNER_BOOT,
        ]
        self._uids = UidAllocator(config.uid_base, config.num_uids) if self.switch_uid else None
        self._setpriv = config.setpriv_path if os.path.exists(config.setpriv_path) else None
        self.cgroup = (
            probe_cgroup_v2(config.cgroup_root)
            if config.use_cgroup == "auto"
            else CgroupSupport(False, "disabled by configuration")
        )
        self._pool: WarmPool[Member] = WarmPool(
            self._spawn, config.pool_size, is_alive=lambda m: m.proc.poll() is None, discard=self._discard
        )
        self._pool.start()

    # ----------------------------------------------------------------------------- public API
    def languages(self) -> list[str]:
        out = ["python"]
        for name, compiler in (("c", self.config.c_compiler), ("cpp", self.config.cpp_compiler)):
            if os.path.exists(compiler) and visible_inside(compiler, self.config):
                out.append(name)
        return out

    def run(self, request: RunRequest) -> RunResult:
        """Run one program; ValueError when the request exceeds this sandbox's limits."""
        self.config.check_request(request)
        if request.language not in self.languages():
            raise ValueError(f"language {request.language!r} is not available here (available: {self.languages()})")
        if request.language == "python":
            return self._run_mode(
                "python", request.code.encode("utf-8", "replace"), request.stdin, request.timeout_s, request.memory_mb
            )
        binary, failed = self.compile(request.language, request.code)
        if binary is None:
            return failed
        return self.run_binary(binary, request.stdin, request.timeout_s, request.memory_mb)

    def compile(self, language: str, code: str) -> tuple[bytes | None, RunResult]:
        """(binary, result): binary is None and result.status == 'compile_error' on failure."""
        cfg = self.config
        if language not in ("c", "cpp") or language not in self.languages():
            raise ValueError(f"cannot compile language {language!r} here")
        compiler, flags = (cfg.c_compiler, cfg.c_flags) if language == "c" else (cfg.cpp_compiler, cfg.cpp_flags)
        limits = Limits(
            cpu_s=cpu_limit_s(cfg.compile_timeout_s),
            memory_bytes=cfg.compile_memory_mb * MIB,
            nproc=cfg.max_processes,
            fsize_bytes=cfg.max_binary_bytes,
            nofile=cfg.max_open_files,
        )
        request = encode_request(
            "compile",
            limits,
            code.encode("utf-8", "replace"),
            compiler=compiler,
            flags="\x1f".join(flags),
            ext=language,
        )
        out = self._execute(request, b"", cfg.compile_timeout_s, cfg.max_binary_bytes, limits)
        report = parse_exit(out.status_lines)
        status, exit_code = classify(_observation("compile", report, out, limits))
        stderr = out.stderr.decode("utf-8", "replace")
        if status == "ok":
            return out.stdout, RunResult("ok", 0, "", stderr, out.run_wall_s)
        if status != "compile_error":
            stderr += f"\nsandbox: compilation ended with {status}\n"
        return None, RunResult("compile_error", exit_code, "", stderr, out.run_wall_s)

    def run_binary(self, binary: bytes, stdin: str, timeout_s: float, memory_mb: int) -> RunResult:
        """Run a binary made by `compile` (it never touches the host's disk)."""
        return self._run_mode("binary", binary, stdin, timeout_s, memory_mb)

    def health(self) -> dict:
        cfg = self.config
        return {
            "languages": self.languages(),
            "python_executable": cfg.python_executable,
            "uid_isolation": self.switch_uid,
            "cgroup": {"used": self.cgroup.usable, "reason": self.cgroup.reason},
            "pool": self._pool.stats(),
            "limits": {
                "max_timeout_s": cfg.max_timeout_s,
                "min_memory_mb": cfg.min_memory_mb,
                "max_memory_mb": cfg.max_memory_mb,
                "max_processes": cfg.max_processes,
                "max_file_size_mb": cfg.max_file_size_mb,
                "max_stdout_bytes": cfg.max_stdout_bytes,
                "max_stderr_bytes": cfg.max_stderr_bytes,
                "tmpfs_size_mb": cfg.tmpfs_size_mb,
            },
        }

    def close(self) -> None:
        self._pool.close()
        self._cleanup()

    def _bind_sources(self) -> list[str]:
        """Host paths bubblewrap resolves as the sandbox's user (besides the staged files)."""
        cfg = self.config
        return [p for p in cfg.system_paths if os.path.lexists(p) and not os.path.islink(p)] + [
            src for src, _ in cfg.extra_ro_binds
        ]

    def _start_failure(self, stderr: bytes) -> str:
        """Why a sandbox ended before its program started, with the reachability problems of its
        bind sources when there are any (e.g. a staged folder made unreachable since start)."""
        text = stderr[-2000:].decode(errors="replace")
        staged = [self._staged.runner_dir, self._staged.lib_dir]
        problems = access_problems(self._bind_sources() + staged, self.user)
        return text + ("\n" + "; ".join(problems) if problems else "")

    # ------------------------------------------------------------------------------ internals
    def _run_mode(self, mode: str, payload: bytes, stdin: str, timeout_s: float, memory_mb: int) -> RunResult:
        cfg = self.config
        limits = Limits(
            cpu_s=cpu_limit_s(timeout_s),
            memory_bytes=memory_mb * MIB,
            nproc=cfg.max_processes,
            fsize_bytes=cfg.max_file_size_mb * MIB,
            nofile=cfg.max_open_files,
        )
        out = self._execute(
            encode_request(mode, limits, payload),
            stdin.encode("utf-8", "replace"),
            timeout_s,
            cfg.max_stdout_bytes,
            limits,
        )
        report = parse_exit(out.status_lines)
        status, exit_code = classify(_observation(mode, report, out, limits, stderr_tail=out.stderr[-4096:]))
        stderr = out.stderr.decode("utf-8", "replace")
        if report is None and status == "runtime_error":
            stderr += "\nsandbox: the program's supervisor was killed before it reported\n"
        duration_s = report.wall_s if report is not None else out.run_wall_s
        return RunResult(
            status=status,
            exit_code=exit_code,
            stdout=out.stdout.decode("utf-8", "replace"),
            stderr=stderr,
            duration_s=round(duration_s, 6),
            cpu_s=None if report is None else report.cpu_s,
        )

    def _spawn(self) -> Member:
        uid = self._uids.acquire() if self._uids is not None else None
        req_r, req_w = os.pipe()
        st_r, st_w = os.pipe()
        argv, ids = self._argv + [str(req_r), str(st_w)], {}
        if uid is not None and self._setpriv is not None:
            # exec'ing setpriv lets subprocess use vfork (a uid change in Popen forces a full
            # fork of this large process): ~1 ms less CPU per sandbox
            argv = [self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
        elif uid is not None:
            ids = {"user": uid, "group": uid, "extra_groups": []}
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(req_r, st_w),
                env={},
                cwd="/",
                start_new_session=True,
                **ids,
            )
        except OSError as exc:
            for fd in (req_w, st_r):
                os.close(fd)
            if uid is not None:
                self._uids.release(uid)
            raise RuntimeError(f"cannot start bubblewrap ({self.config.bwrap_path}): {exc}") from exc
        finally:
            os.close(req_r)
            os.close(st_w)
        return Member(proc=proc, uid=uid, request_fd=req_w, status_fd=st_r)

    def _execute(self, request: bytes, stdin: bytes, timeout_s: float, stdout_cap: int, limits: Limits) -> _Outcome:
        member = self._pool.acquire()
        try:
            out = self._drive(member, request, stdin, timeout_s, stdout_cap, limits)
        except BaseException:
            self._finish(member, abnormal=True)
            raise
        self._finish(member, abnormal=out.timed_out or out.output_exceeded)
        return out

    def _drive(
        self, m: Member, request: bytes, stdin: bytes, timeout_s: float, stdout_cap: int, limits: Limits
    ) -> _Outcome:
        cfg = self.config
        out = _Outcome()
        bufs = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
        caps = {"stdout": stdout_cap, "stderr": cfg.max_stderr_bytes, "status": _STATUS_CAP_BYTES}
        io = Pipes(m, stdin)
        deadline = time.monotonic() + cfg.setup_timeout_s
        started_at = None
        try:
            while io.num_readers:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if started_at is None:
                        raise RuntimeError(
                            f"sandbox did not start within setup_timeout_s={cfg.setup_timeout_s}: "
                            f"{bytes(bufs['stderr'][-2000:]).decode(errors='replace')}"
                        )
                    out.timed_out = True
                    break
                for name, chunk in io.poll(remaining):
                    if name != "status":
                        bufs[name] += chunk
                        if len(bufs[name]) > caps[name]:
                            del bufs[name][caps[name] :]
                            out.output_exceeded = True
                        continue
                    bufs["status"] += chunk
                    lines = bytes(bufs["status"]).decode("ascii", "replace").split("\n")
                    for line in lines[len(out.status_lines) : -1]:
                        out.status_lines.append(line)
                        if line == "ready":
                            self._attach_cgroup(m, limits)
                            io.send_request(request)
                        elif line == "start":
                            started_at = time.monotonic()
                            deadline = started_at + timeout_s
                if out.output_exceeded:
                    break
        finally:
            io.close()
        if started_at is None and not out.output_exceeded:
            raise RuntimeError(
                f"sandbox ended before it started the program: {self._start_failure(bytes(bufs['stderr']))}"
            )
        if started_at is not None:
            out.run_wall_s = time.monotonic() - started_at
        out.stdout, out.stderr = bytes(bufs["stdout"]), bytes(bufs["stderr"])
        out.oom_killed = m.cgroup is not None and m.cgroup.oom_killed()
        return out

    def _attach_cgroup(self, m: Member, limits: Limits) -> None:
        if not self.cgroup.usable:
            return
        try:
            m.cgroup = RunCgroup(
                self.config.cgroup_root,
                limits.memory_bytes + self.config.tmpfs_size_mb * MIB,
                self.config.max_processes,
            )
            m.cgroup.attach_tree(m.proc.pid)
        except OSError as exc:
            raise RuntimeError(f"cannot set up the run's cgroup: {exc}") from exc

    def _finish(self, m: Member, abnormal: bool, *, ran: bool = True) -> None:
        """Make sure nothing of the run survives, reap bwrap, give the uid back."""
        grace_s = self.config.kill_grace_s
        if abnormal:
            kill_sandbox(m.proc)
        try:
            m.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            kill_sandbox(m.proc)
            try:
                m.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.error("bwrap pid %d did not exit after SIGKILL", m.proc.pid)
            abnormal = True
        for f in (m.proc.stdin, m.proc.stdout, m.proc.stderr):
            if f is not None:
                f.close()
        if m.cgroup is not None:
            m.cgroup.remove(grace_s)
        if m.uid is not None:
            if abnormal:
                survivors = sweep_uid(m.uid)
                if survivors:
                    log = logger.warning if ran else logger.debug
                    log("killed %d leftover processes of sandbox uid %d", survivors, m.uid)
            self._uids.release(m.uid)

    def _discard(self, m: Member) -> None:
        # a sandbox still setting up has no namespace init to kill yet: give it a moment to say
        # `ready` (or die), so that the kill below takes its whole tree and leaves no zombie
        select.select([m.status_fd], [], [], min(1.0, self.config.setup_timeout_s))
        for fd in (m.request_fd, m.status_fd):
            os.close(fd)
        self._finish(m, abnormal=True, ran=False)
