"""The real sandbox service (a subprocess on a free port) against hostile and correct programs.

Every hostile test ends by checking that the service still serves a correct program exactly.
"""

from __future__ import annotations

import ast
import http.client
import json
import os
import secrets
import shutil
import textwrap
import threading
import time

import psutil
import pytest

from orchestrator.rewards.code_sandbox import code_reward
from sandbox.client import SandboxClient
from sandbox.models import TestCase
from testing.sandbox_service import SECRET_ENV_NAME, Answer, request, start_service

pytestmark = pytest.mark.sandbox


def post(service, path: str, body: dict, timeout_s: float = 60.0) -> Answer:
    return request("POST", service.url + path, body, timeout_s)


def run(service, code: str, **kw) -> dict:
    body = {"language": "python", "code": textwrap.dedent(code), **kw}
    started = time.monotonic()
    resp = post(service, "/run", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    out["request_s"] = time.monotonic() - started
    return out


def assert_still_serving(service) -> None:
    out = run(service, "import sys\nprint(sys.stdin.read().upper(), end='')", stdin="still here\n")
    assert (out["status"], out["stdout"], out["exit_code"]) == ("ok", "STILL HERE\n", 0)


def processes_with(marker: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(f"{proc.pid}: {cmdline[:200]}")
    return found


# ------------------------------------------------------------------------------- hostile code
def test_network_is_unreachable(service):
    port = service.port
    out = run(
        service,
        f"""
        import socket
        for host, port in (("1.1.1.1", 80), ("127.0.0.1", {port}), ("localhost", {port})):
            try:
                socket.create_connection((host, port), timeout=1).close()
                print("CONNECTED", host, port)
            except OSError as exc:
                print("blocked", host, type(exc).__name__)
    """,
    )
    assert out["status"] == "ok", out
    assert "CONNECTED" not in out["stdout"]
    assert out["stdout"].count("blocked") == 3, out
    assert_still_serving(service)


def test_cannot_write_outside_its_tmpfs(service, tmp_path):
    host_dir = tmp_path / "host_dir"
    host_dir.mkdir()
    out = run(
        service,
        f"""
        import os
        for path in ("/x", "/usr/x", "/etc/x", "/dev/x", "/proc/x", "/bin/x", "{host_dir}/x",
                     "/sandbox/x"):
            try:
                with open(path, "w") as f:
                    f.write("pwned")
                print("WROTE", path)
            except OSError as exc:
                print("denied", path, type(exc).__name__)
        with open("/tmp/mine.txt", "w") as f:
            f.write("ok")
        print("tmp", open("/tmp/mine.txt").read())
    """,
    )
    assert out["status"] == "ok", out
    assert "WROTE" not in out["stdout"], out["stdout"]
    assert out["stdout"].count("denied") == 8
    assert "tmp ok" in out["stdout"]
    assert list(host_dir.iterdir()) == []
    assert_still_serving(service)


def test_host_secrets_are_not_visible(service, tmp_path):
    token = "filesecret-" + secrets.token_hex(8)
    home = os.path.expanduser("~")
    home_dir = os.path.join(
        home if os.access(home, os.W_OK) else str(tmp_path), f".sandbox-test-{secrets.token_hex(4)}"
    )
    os.makedirs(home_dir)
    try:
        secret_paths = [os.path.join(home_dir, "secret.txt"), str(tmp_path / "secret.txt")]
        for path in secret_paths:
            with open(path, "w") as f:
                f.write(token)
        out = run(
            service,
            f"""
            import glob, os
            for path in {secret_paths!r}:
                try:
                    print("READ", open(path).read())
                except OSError as exc:
                    print("no", path, type(exc).__name__)
            print("env", dict(os.environ))
            for path in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
                try:
                    print(path, open(path, "rb").read())
                except OSError:
                    pass
            print("root", os.listdir("/"))
            print("exists", [p for p in ("/root", "/work", "/home", "/etc/shadow", "/etc/passwd",
                                         "/sys", "/var") if os.path.exists(p)])
            print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
        """,
        )
    finally:
        shutil.rmtree(home_dir)
    assert out["status"] == "ok", out
    text = out["stdout"] + out["stderr"]
    assert token not in text and "READ" not in text
    assert service.env_secret not in text and SECRET_ENV_NAME not in text
    assert "exists []" in out["stdout"]
    pids_line = [line for line in out["stdout"].splitlines() if line.startswith("pids")][0]
    assert len(ast.literal_eval(pids_line[5:])) <= 4, pids_line  # the sandbox pid namespace only
    assert_still_serving(service)


def test_fork_bomb_is_contained(service):
    marker = "forkbomb-" + secrets.token_hex(6)
    out = run(
        service,
        f"""
        import os, sys
        sys.argv.append("{marker}")
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """,
        timeout_s=1.0,
    )
    assert out["status"] == "timeout", out
    assert out["request_s"] < 10, out
    assert processes_with(marker) == []
    counted = run(
        service,
        """
        import os, time
        num_forked = 0
        try:
            for _ in range(10000):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                num_forked += 1
        except OSError as exc:
            print("fork failed after", num_forked, type(exc).__name__)
    """,
        timeout_s=5.0,
    )
    health = request("GET", service.url + "/health").json()
    assert counted["status"] == "ok" and counted["request_s"] < 5, counted
    num_forked = int(counted["stdout"].split()[3])
    assert 0 < num_forked < health["sandbox"]["limits"]["max_processes"], counted
    assert_still_serving(service)


def test_process_finder_sees_live_processes():
    """The no-survivor checks above would notice a surviving process."""
    import subprocess
    import sys

    marker = "visible-" + secrets.token_hex(6)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        deadline = time.monotonic() + 10
        while not processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for exec, bounded by the deadline
        assert processes_with(marker)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert processes_with(marker) == []


def test_memory_bomb_reports_memory_limit(service):
    out = run(
        service,
        """
        blocks = []
        while True:
            blocks.append(bytearray(8 << 20))
    """,
        memory_mb=64,
        timeout_s=5.0,
    )
    assert out["status"] == "memory_limit", out
    out = run(service, "x = 'a' * (10 ** 10)", memory_mb=64)
    assert out["status"] == "memory_limit", out
    assert_still_serving(service)


def test_infinite_loop_times_out(service):
    out = run(service, "while True:\n    pass\n", timeout_s=1.0)
    assert out["status"] == "timeout", out
    assert 0.9 <= out["duration_s"] < 3.0 and out["request_s"] < 8, out
    assert_still_serving(service)


def test_sleeping_past_the_wall_limit_times_out(service):
    out = run(service, "import time\nprint('before', flush=True)\ntime.sleep(60)\n", timeout_s=0.5)
    assert out["status"] == "timeout", out
    assert out["stdout"] == "before\n"
    assert out["request_s"] < 8, out
    assert_still_serving(service)


def test_flooding_stdout_hits_the_output_limit(service):
    health = request("GET", service.url + "/health").json()
    cap = health["sandbox"]["limits"]["max_stdout_bytes"]
    out = run(service, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", timeout_s=10.0)
    assert out["status"] == "output_limit", {k: v for k, v in out.items() if k != "stdout"}
    assert len(out["stdout"]) <= cap and out["request_s"] < 8
    out = run(service, "import sys\nwhile True:\n    sys.stderr.write('e' * 65536)\n", timeout_s=10.0)
    assert out["status"] == "output_limit"
    assert_still_serving(service)


def test_file_size_and_tmpfs_limits(service):
    health = request("GET", service.url + "/health").json()
    limits = health["sandbox"]["limits"]
    out = run(
        service,
        f"""
        import errno
        try:
            with open("/tmp/big", "wb") as f:
                f.write(b"x" * ({limits["max_file_size_mb"]} + 1) * (1 << 20))
            print("WROTE")
        except OSError as exc:
            print("big file:", errno.errorcode[exc.errno])
        written = 0
        try:
            for i in range(1000):
                with open(f"/tmp/part{{i}}", "wb") as f:
                    f.write(b"y" * (4 << 20))
                written += 4
        except OSError as exc:
            print("tmpfs:", errno.errorcode[exc.errno], written <= {limits["tmpfs_size_mb"]})
    """,
        timeout_s=10.0,
    )
    assert out["status"] == "ok", out
    assert out["stdout"] == "big file: EFBIG\ntmpfs: ENOSPC True\n", out
    assert_still_serving(service)


def test_killing_its_parent_is_contained(service):
    """The supervisor is pid 1 of the sandbox's pid namespace, so SIGKILL from inside cannot
    reach it; either way the run ends, is reported, and leaves nothing behind."""
    marker = "orphan-" + secrets.token_hex(6)
    out = run(
        service,
        f"""
        import os, signal, subprocess, time
        subprocess.Popen(["/usr/bin/python3", "-c", "import time; time.sleep(1000)", "{marker}"])
        for pid in (os.getppid(), 1):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as exc:
                print("kill", pid, type(exc).__name__)
        time.sleep(0.2)
        print("still running", flush=True)
    """,
        timeout_s=5.0,
    )
    assert out["status"] in ("ok", "runtime_error"), out
    assert out["request_s"] < 5, out
    assert processes_with(marker) == []
    assert_still_serving(service)


@pytest.mark.parametrize("hang", [False, True], ids=["exits", "hangs"])
def test_background_processes_do_not_survive(service, hang):
    marker = "bg-" + secrets.token_hex(6)
    out = run(
        service,
        f"""
        import os, subprocess, time
        sleeper = ["/usr/bin/python3", "-c", "import time; time.sleep(1000)", "{marker}"]
        subprocess.Popen(sleeper, start_new_session=True)
        if os.fork() == 0:          # double fork: a daemon the program does not wait for
            os.setsid()
            if os.fork() == 0:
                os.execv(sleeper[0], sleeper)
            os._exit(0)
        time.sleep(0.2)
        print("spawned", flush=True)
        if {hang}:
            time.sleep(60)
    """,
        timeout_s=2.0,
    )
    assert out["status"] == ("timeout" if hang else "ok"), out
    assert out["stdout"] == "spawned\n"
    assert processes_with(marker) == []
    assert_still_serving(service)


# ------------------------------------------------------------------------------ correct code
def test_correct_programs_give_exact_output(service):
    out = run(
        service,
        "import sys\ndata = sys.stdin.read()\nsys.stdout.write(data[::-1])",
        stdin="héllo wörld ✓\n  spaces  \n",
    )
    assert out == {**out, "status": "ok", "exit_code": 0, "stdout": "\n  secaps  \n✓ dlröw olléh"}
    big = run(service, "print('\\n'.join(str(i) for i in range(200000)))")
    assert big["status"] == "ok"
    assert big["stdout"] == "\n".join(str(i) for i in range(200000)) + "\n"
    out = run(service, "import sys\nprint('to err', file=sys.stderr)\nsys.exit(3)")
    assert (out["status"], out["exit_code"], out["stderr"]) == ("runtime_error", 3, "to err\n")
    out = run(service, "def broken(:\n    pass\n")
    assert out["status"] == "compile_error" and "SyntaxError" in out["stderr"]


def test_python_exit_keeps_python_semantics(service):
    """The supervisor's fast exit still joins threads, runs atexit and flushes open files."""
    out = run(
        service,
        """
        import atexit, sys, threading, time
        atexit.register(lambda: print("atexit ran"))
        def late():
            time.sleep(0.1)
            print("thread done")
        threading.Thread(target=late).start()
        extra = open(1, "w", closefd=False)
        extra.write("unflushed file object\\n")
        sys.stdout.write("no newline, ")
    """,
    )
    assert out["status"] == "ok", out
    assert out["stdout"] == "no newline, thread done\natexit ran\nunflushed file object\n"
    out = run(service, "raise SystemExit('bye')")
    assert (out["status"], out["exit_code"], out["stderr"]) == ("runtime_error", 1, "bye\n")
    out = run(service, "exit(0)")
    assert (out["status"], out["exit_code"]) == ("ok", 0)


def test_compiled_languages(service):
    health = request("GET", service.url + "/health").json()
    if "cpp" not in health["sandbox"]["languages"]:
        pytest.skip("no C++ compiler on this machine")
    cpp = "#include <iostream>\nint main(){long long a,b;std::cin>>a>>b;std::cout<<a*b<<'\\n';}"
    resp = post(service, "/run", {"language": "cpp", "code": cpp, "stdin": "123456 654321"})
    assert resp.json()["stdout"] == f"{123456 * 654321}\n", resp.json()
    c_bad = "int main(void) { return undefined_name; }"
    resp = post(service, "/run", {"language": "c", "code": c_bad})
    assert resp.json()["status"] == "compile_error" and "undefined_name" in resp.json()["stderr"]
    c_loop = "int main(void) { volatile unsigned long x = 0; for (;;) x++; }"
    resp = post(service, "/run", {"language": "c", "code": c_loop, "timeout_s": 1.0})
    assert resp.json()["status"] == "timeout"


def test_concurrent_runs_do_not_see_each_other(service):
    code = """
        import os, sys, time
        token = sys.stdin.read().strip()
        with open("/tmp/shared.txt", "a") as f:
            f.write(token + "\\n")
        time.sleep(0.3)
        print(sorted(os.listdir("/tmp")), open("/tmp/shared.txt").read().split())
    """
    tokens = [secrets.token_hex(4) for _ in range(6)]
    results: dict[str, dict] = {}

    def one(token: str) -> None:
        results[token] = run(service, code, stdin=token)

    threads = [threading.Thread(target=one, args=(t,)) for t in tokens]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == sorted(tokens)
    for token, out in results.items():
        assert out["status"] == "ok", out
        assert out["stdout"] == f"['main.py', 'shared.txt'] ['{token}']\n"


# --------------------------------------------------------------------------- API behaviours
@pytest.mark.parametrize(
    "body, field",
    [
        ({"language": "rust", "code": "x"}, "language"),
        ({"language": "python", "code": ""}, "code"),
        ({"language": "python", "code": "print(1)", "timeout_s": -1}, "timeout_s"),
        ({"language": "python", "code": "print(1)", "timeout_s": 1000}, "timeout_s"),
        ({"language": "python", "code": "print(1)", "memory_mb": 1}, "memory_mb"),
        ({"language": "python", "code": "print(1)", "extra": 1}, "extra"),
        ({"code": "print(1)"}, "language"),
    ],
)
def test_invalid_requests_get_a_clear_400(service, body, field):
    resp = post(service, "/run", body)
    assert resp.status_code == 400, resp.text
    assert field in resp.json()["detail"]


def test_malformed_json_gets_400(service):
    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)
    try:
        conn.request("POST", "/run", body=b"{not json", headers={"content-type": "application/json"})
        resp = conn.getresponse()
        status, body = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 400 and "JSON" in body["detail"]


def test_judge_and_code_reward(service):
    cases = [TestCase("1 2\n", "3\n"), TestCase("5 5\n", "10\n"), TestCase("-1 1\n", "0\n")]
    good = "a, b = map(int, input().split())\nprint(a + b)"
    wrong_on_negative = "a, b = map(int, input().split())\nprint(abs(a) + abs(b))"
    with SandboxClient(service.url, timeout_s=60) as client:
        judged = client.judge("python", wrong_on_negative, cases)
        assert (judged.passed, judged.total, judged.all_passed) == (2, 3, False)
        assert [c.passed for c in judged.cases] == [True, True, False]
        assert judged.cases[2].stdout == "2\n"
        assert code_reward(client, good, cases, mode="fraction") == 1.0
        assert code_reward(client, wrong_on_negative, cases, mode="fraction") == pytest.approx(2 / 3)
        assert code_reward(client, wrong_on_negative, cases, mode="all_or_nothing") == 0.0
        assert code_reward(client, good, cases, mode="all_or_nothing") == 1.0
        assert code_reward(client, "while True: pass", cases[:1], mode="fraction", timeout_s=0.5) == 0.0
        assert code_reward(client, "def f(:", cases, mode="fraction") == 0.0
        with pytest.raises(ValueError, match="memory_mb"):
            client.judge("python", good, cases, memory_mb=1)


def test_overload_gets_503_and_service_recovers(bwrap_ok):
    small = start_service(["--workers", "1", "--max-queue", "1", "--pool-size", "1"])
    try:
        body = {"language": "python", "code": "import time\ntime.sleep(1.5)", "timeout_s": 5}
        codes: list[int] = []
        bodies: list[dict] = []

        def one() -> None:
            resp = request("POST", small.url + "/run", body)
            codes.append(resp.status_code)
            bodies.append(resp.json())

        threads = [threading.Thread(target=one) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(codes).count(200) >= 1 and 503 in codes, codes
        rejected = [b for b, c in zip(bodies, codes) if c == 503]
        assert all(b["status"] == "rejected" and "capacity" in b["detail"] for b in rejected)
        ok = request("POST", small.url + "/run", {"language": "python", "code": "print(2)"}).json()
        assert ok["stdout"] == "2\n"
    finally:
        rc = small.stop()
    assert rc == 0, small.log_text()
