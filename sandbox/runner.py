"""The supervisor that runs INSIDE each sandbox (bound read-only at /sandbox/runner, with its
bytecode compiled once by the service, and imported by `python3 -I -S -c BOOT`).

It is started ahead of time (the warm pool), imports only builtin modules, says `ready`, and
blocks until the service sends one request on the request fd. Then, by `mode`:

    python   compile the code, fork, apply rlimits in the child, exec the code object there
    compile  write the source, fork the compiler under compile rlimits, send the binary on stdout
    binary   write the binary to /tmp/main, fork, apply rlimits, execve it

and reports on the status fd (the child never holds it):

    ready\\n                      warm, waiting for the request
    start\\n                      the program (or compiler) is about to start: the wall clock runs
    exit CODE SIG CPU_S WALL_S MAXRSS_KB\\n   how the child ended (CODE -1 when killed by SIG)

Request: one header line of TAB-separated key=value pairs, a newline, then the payload bytes.
This file must stay standalone (stdlib builtins only): it is never imported by the service.
"""

import os
import resource
import sys
import time

MEMORY_EXIT_CODE = 113  # a python program that ran out of memory (MemoryError) exits with this
SYNTAX_EXIT_CODE = 112  # python code that does not compile exits with this
WORK = "/tmp"
LIB_DIR = "/sandbox/lib"
RUNNER_DIR = "/sandbox/runner"
BOOT = "import sys; sys.path.insert(0, %r); import sandbox_runner; sandbox_runner.main()" % RUNNER_DIR
CHILD_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": WORK}


def _read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _parse(data):
    line, _, payload = data.partition(b"\n")
    header = {}
    for item in line.decode("ascii").split("\t"):
        key, _, value = item.partition("=")
        header[key] = value
    return header, payload


def _apply_limits(h):
    r = resource
    cpu_s = int(h["cpu_s"])
    r.setrlimit(r.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    for name, key in (
        ("RLIMIT_AS", "memory_bytes"),
        ("RLIMIT_NPROC", "nproc"),
        ("RLIMIT_FSIZE", "fsize_bytes"),
        ("RLIMIT_NOFILE", "nofile"),
    ):
        value = int(h[key])
        r.setrlimit(getattr(r, name), (value, value))
    r.setrlimit(r.RLIMIT_CORE, (0, 0))


def _write_file(path, data, mode):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _out_of_memory():
    os.write(2, b"MemoryError: the program ran out of its memory limit\n")
    os._exit(MEMORY_EXIT_CODE)


def _system_exit_code(exc):
    """The exit status Python gives an uncaught SystemExit."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:  # noqa: BLE001 - the sandboxed program's failure is its result
        pass
    return 1


def _flush_std_streams():
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()


def _fast_exit(code, scope):
    """Python's own exit minus the slow module teardown: join threads, run atexit, drop the
    program's objects (unclosed files flush), flush stdio, _exit."""
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        import atexit

        atexit._run_exitfuncs()
        _flush_std_streams()  # Python's order: stdio first, then the program's objects die
        scope.clear()
        _flush_std_streams()
    except MemoryError:
        _out_of_memory()
    except BaseException:  # noqa: BLE001 - the sandboxed program's failure is its result
        code = code or 120  # what Python does when flushing stdout fails at exit
    os._exit(code)


def _python_child(source):
    import builtins

    try:
        code = compile(source, "main.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        import traceback

        os.write(2, "".join(traceback.format_exception_only(type(exc), exc)).encode())
        os._exit(SYNTAX_EXIT_CODE)
    except MemoryError:
        _out_of_memory()
    builtins.exit = builtins.quit = sys.exit  # no site module under -S
    sys.argv = ["main.py"]
    if RUNNER_DIR in sys.path:
        sys.path.remove(RUNNER_DIR)
    if os.path.isdir(LIB_DIR):
        sys.path.insert(0, LIB_DIR)
    scope = {"__name__": "__main__", "__file__": WORK + "/main.py", "__builtins__": builtins}
    status = 0
    try:
        exec(code, scope)
    except MemoryError:
        _out_of_memory()
    except SystemExit as exc:
        status = _system_exit_code(exc)
    except BaseException:  # noqa: BLE001 - the sandboxed program's failure is its result
        exc_type, exc, tb = sys.exc_info()
        try:
            exc = exc.with_traceback(tb.tb_next)  # hide this supervisor frame
            sys.excepthook(exc_type, exc, exc.__traceback__)
        except MemoryError:
            _out_of_memory()
        status = 1
    _fast_exit(status, scope)


def _exec_child(argv, to_stderr):
    try:
        if to_stderr:
            os.dup2(2, 1)
        os.execve(argv[0], argv, CHILD_ENV)
    except OSError as exc:
        os.write(2, ("cannot execute %s: %s\n" % (argv[0], exc)).encode())
    os._exit(127)


def _supervise(status_fd, header, child):
    """Fork; the child applies the limits and runs `child()`; report how it ended."""
    os.write(status_fd, b"start\n")
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(status_fd)
            _apply_limits(header)
        except BaseException as exc:  # noqa: BLE001 - the sandboxed program's failure is its result
            os.write(2, ("sandbox: cannot apply limits: %r\n" % (exc,)).encode())
            os._exit(126)
        child()
        os._exit(0)
    _, status, usage = os.wait4(pid, 0)
    wall_s = time.monotonic() - started
    if os.WIFSIGNALED(status):
        code, sig = -1, os.WTERMSIG(status)
    else:
        code, sig = os.WEXITSTATUS(status), 0
    cpu_s = usage.ru_utime + usage.ru_stime
    os.write(status_fd, ("exit %d %d %.4f %.4f %d\n" % (code, sig, cpu_s, wall_s, usage.ru_maxrss)).encode())
    return code, sig


def _run_python(status_fd, header, payload):
    _write_file(WORK + "/main.py", payload, 0o644)
    _supervise(status_fd, header, lambda: _python_child(payload))


def _run_compile(status_fd, header, payload):
    source = WORK + "/main." + header["ext"]
    binary = WORK + "/main"
    _write_file(source, payload, 0o644)
    flags = [f for f in header.get("flags", "").split("\x1f") if f]
    argv = [header["compiler"], *flags, "-o", binary, source, "-lm"]
    code, sig = _supervise(status_fd, header, lambda: _exec_child(argv, True))
    if code == 0 and sig == 0:
        with open(binary, "rb") as f:
            data = f.read()
        view = memoryview(data)
        while view:
            view = view[os.write(1, view) :]


def _run_binary(status_fd, header, payload):
    path = WORK + "/main"
    _write_file(path, payload, 0o755)
    _supervise(status_fd, header, lambda: _exec_child([path], False))


def main():
    request_fd, status_fd = int(sys.argv[1]), int(sys.argv[2])
    os.write(status_fd, b"ready\n")
    data = _read_all(request_fd)
    os.close(request_fd)
    header, payload = _parse(data)
    mode = header.get("mode")
    if mode == "python":
        _run_python(status_fd, header, payload)
    elif mode == "compile":
        _run_compile(status_fd, header, payload)
    elif mode == "binary":
        _run_binary(status_fd, header, payload)
    else:
        os.write(2, ("sandbox: unknown mode %r\n" % (mode,)).encode())
    os._exit(0)


if __name__ == "__main__":
    main()
