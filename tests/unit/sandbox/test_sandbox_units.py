"""Pure parts of the sandbox: classification, wire format, output comparison, configs, pools,
cgroup probing, reward arithmetic and the k1.5 test-case filters. No bubblewrap needed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orchestrator.rewards.code_sandbox import CodeRewardConfig, code_reward, extract_code_block
from sandbox.bwrap import sandbox_argv, system_mount_args, visible_inside
from sandbox.cgroup import RunCgroup, is_cgroup2_mount, probe_cgroup_v2, process_tree
from sandbox.config import SandboxConfig, ServiceConfig
from sandbox.judge import normalize_output, outputs_match
from sandbox.models import JudgeResult, RunRequest, TestCase
from sandbox.pool import UidAllocator, WarmPool
from sandbox.protocol import (
    ExitReport,
    Limits,
    Observation,
    classify,
    cpu_limit_s,
    encode_request,
    parse_exit,
)
from sandbox.runner import MEMORY_EXIT_CODE, SYNTAX_EXIT_CODE, _parse
from sandbox.service import Admission
from sandbox.testgen import (
    Solution,
    TestGenConfig,
    decide_problem,
    load_problems,
    majority_output,
    select_cases,
)

MIB = 1 << 20
PROBLEMS = Path(__file__).resolve().parents[3] / "sandbox" / "problems"


def report(code=0, sig=0, cpu_s=0.01, rss=10 * MIB):
    return ExitReport(exit_code=None if sig else code, signal=sig, cpu_s=cpu_s, wall_s=0.02, max_rss_bytes=rss)


@pytest.mark.parametrize(
    "obs, expected",
    [
        (Observation("python", report(0)), ("ok", 0)),
        (Observation("python", report(1)), ("runtime_error", 1)),
        (Observation("python", report(MEMORY_EXIT_CODE)), ("memory_limit", MEMORY_EXIT_CODE)),
        (Observation("python", report(SYNTAX_EXIT_CODE)), ("compile_error", SYNTAX_EXIT_CODE)),
        (Observation("python", None), ("runtime_error", None)),
        (Observation("python", None, timed_out=True), ("timeout", None)),
        (Observation("python", report(0), output_exceeded=True), ("output_limit", 0)),
        (Observation("python", None, timed_out=True, output_exceeded=True), ("output_limit", None)),
        (Observation("binary", report(sig=signal.SIGXCPU)), ("timeout", -signal.SIGXCPU)),
        (Observation("binary", report(sig=signal.SIGKILL, cpu_s=3.0), cpu_limit_s=3), ("timeout", -signal.SIGKILL)),
        (
            Observation("binary", report(sig=signal.SIGKILL, cpu_s=0.1), cpu_limit_s=3),
            ("runtime_error", -signal.SIGKILL),
        ),
        (Observation("binary", report(sig=signal.SIGSEGV)), ("runtime_error", -signal.SIGSEGV)),
        (
            Observation("binary", report(sig=signal.SIGABRT), stderr_tail=b"std::bad_alloc"),
            ("memory_limit", -signal.SIGABRT),
        ),
        (
            Observation("binary", report(sig=signal.SIGSEGV, rss=60 * MIB), memory_bytes=64 * MIB),
            ("memory_limit", -signal.SIGSEGV),
        ),
        (Observation("binary", report(MEMORY_EXIT_CODE)), ("runtime_error", MEMORY_EXIT_CODE)),
        (Observation("binary", report(0), oom_killed=True), ("memory_limit", 0)),
        (Observation("compile", report(0)), ("ok", 0)),
        (Observation("compile", report(1)), ("compile_error", 1)),
    ],
)
def test_classify(obs, expected):
    assert classify(obs) == expected


@pytest.mark.parametrize("timeout_s, cpu_s", [(0.1, 1), (1.0, 1), (1.01, 2), (2.5, 3), (30, 30)])
def test_cpu_limit_rounds_up(timeout_s, cpu_s):
    assert cpu_limit_s(timeout_s) == cpu_s


def test_request_encoding_round_trips_through_the_runner_parser():
    limits = Limits(cpu_s=2, memory_bytes=64 * MIB, nproc=16, fsize_bytes=MIB, nofile=64)
    payload = b"print('a\\tb')\n\x00\xff"
    data = encode_request(
        "compile", limits, payload, compiler="/usr/bin/gcc", flags="\x1f".join(["-O2", "-std=gnu11"]), ext="c"
    )
    header, body = _parse(data)
    assert body == payload
    assert header["mode"] == "compile" and header["memory_bytes"] == str(64 * MIB)
    assert header["flags"].split("\x1f") == ["-O2", "-std=gnu11"]
    with pytest.raises(ValueError, match="separator"):
        encode_request("python", limits, b"", bad="a\tb")


@pytest.mark.parametrize(
    "lines, expected",
    [
        (["ready", "start"], None),
        (["ready", "start", "exit 0 0 0.0100 0.0200 2048"], ExitReport(0, 0, 0.01, 0.02, 2048 * 1024)),
        (["ready", "start", "exit -1 9 1.5 2.0 100"], ExitReport(None, 9, 1.5, 2.0, 100 * 1024)),
        (["exit nonsense"], None),
    ],
)
def test_parse_exit(lines, expected):
    assert parse_exit(lines) == expected


@pytest.mark.parametrize(
    "expected, actual, mode, match",
    [
        ("3\n", "3\n", "exact", True),
        ("3\n", "3", "exact", False),
        ("3\n", "3", "lines", True),
        ("1 2\n3\n", "1 2   \n3\n\n\n", "lines", True),
        ("1 2\n3\n", "1  2\n3\n", "lines", False),
        ("1 2\n3\n", "1  2\n3\n", "tokens", True),
        ("a\r\nb\r\n", "a\nb", "lines", True),
        ("", "\n\n", "lines", True),
        ("1\n", "2\n", "tokens", False),
    ],
)
def test_outputs_match(expected, actual, mode, match):
    assert outputs_match(expected, actual, mode) is match


def test_unknown_compare_mode_is_rejected():
    with pytest.raises(ValueError, match="compare"):
        normalize_output("x", "fuzzy")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"language": "rust"}, "language"),
        ({"code": "   "}, "code"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"memory_mb": 0}, "memory_mb"),
        ({"memory_mb": True}, "memory_mb"),
    ],
)
def test_run_request_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RunRequest(**{"language": "python", "code": "print(1)", **kwargs})


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tmpfs_size_mb": 0}, "tmpfs_size_mb"),
        ({"max_processes": 2}, "max_processes"),
        ({"pool_size": -1}, "pool_size"),
        ({"min_memory_mb": 512, "max_memory_mb": 256}, "min_memory_mb"),
        ({"switch_uid": "yes"}, "switch_uid"),
        ({"uid_base": 10}, "uid_base"),
        ({"max_binary_bytes": 64 * MIB, "tmpfs_size_mb": 64}, "max_binary_bytes"),
        ({"python_lib_binds": (("/x", "a/b"),)}, "python_lib_binds"),
        ({"python_lib_binds": (("/x", "a"), ("/y", "a"))}, "unique"),
        ({"compile_timeout_s": -1.0}, "compile_timeout_s"),
    ],
)
def test_sandbox_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SandboxConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"port": 70000}, "port"),
        ({"num_workers": 0}, "num_workers"),
        ({"max_queue": -1}, "max_queue"),
        ({"queue_timeout_s": 0}, "queue_timeout_s"),
    ],
)
def test_service_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServiceConfig(**kwargs)


@pytest.mark.parametrize(
    "request_kwargs, field",
    [
        ({"memory_mb": 16}, "memory_mb"),
        ({"memory_mb": 10_000}, "memory_mb"),
        ({"timeout_s": 31}, "timeout_s"),
        ({"code": "x" * 600_000}, "code"),
        ({"stdin": "y" * (17 * MIB)}, "stdin"),
    ],
)
def test_check_request_enforces_the_sandbox_maxima(request_kwargs, field):
    request = RunRequest(**{"language": "python", "code": "print(1)", **request_kwargs})
    with pytest.raises(ValueError, match=field):
        SandboxConfig().check_request(request)
    SandboxConfig().check_request(RunRequest("python", "print(1)"))


def test_system_mounts_keep_top_level_symlinks():
    fake = {"/usr": None, "/bin": "usr/bin", "/etc/alternatives": None}
    args = system_mount_args(
        ["/usr", "/bin", "/lib64", "/etc/alternatives"],
        exists=lambda p: p in fake,
        is_link=lambda p: fake.get(p) is not None,
        readlink=lambda p: fake[p],
    )
    assert args == [
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--ro-bind",
        "/etc/alternatives",
        "/etc/alternatives",
    ]


def test_sandbox_argv_isolates_everything():
    cfg = SandboxConfig(python_lib_binds=(("/site/cyaron", "cyaron"),), tmpfs_size_mb=32)
    argv = sandbox_argv(cfg, ["--ro-bind", "/usr", "/usr"], "/tmp/staged/runner", "/tmp/staged/lib")
    joined = " ".join(argv)
    for flag in (
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--cap-drop ALL",
        "--remount-ro /",
        f"--size {32 * MIB} --perms 1777 --tmpfs /tmp",
        "--chdir /tmp",
        "--ro-bind /tmp/staged/lib /sandbox/lib",  # staged copies: the host path is never bound
        "--ro-bind /tmp/staged/runner /sandbox/runner",
        "--remount-ro /dev",
    ):
        assert flag in joined, flag
    assert "--share-net" not in argv and "--bind" not in argv and "/site/cyaron" not in joined
    assert visible_inside("/usr/bin/python3", cfg)
    assert not visible_inside("/root/.pyenv/bin/python", cfg)


def test_uid_allocator_hands_out_each_uid_once():
    uids = UidAllocator(200_000, 3)
    got = [uids.acquire() for _ in range(3)]
    assert sorted(got) == [200_000, 200_001, 200_002]
    with pytest.raises(RuntimeError, match="uids"):
        uids.acquire()
    uids.release(got[1])
    assert uids.acquire() == got[1]
    assert uids.num_held == 3


def test_warm_pool_refills_and_discards_dead_items():
    spawned, discarded = [], []
    lock = threading.Condition()

    def spawn():
        with lock:
            spawned.append({"alive": True, "n": len(spawned)})
            lock.notify_all()
            return spawned[-1]

    pool = WarmPool(spawn, 2, is_alive=lambda item: item["alive"], discard=discarded.append)
    pool.start()
    with lock:
        assert lock.wait_for(lambda: len(spawned) >= 2, timeout=10)
    spawned[0]["alive"] = False
    item = pool.acquire()
    assert item["alive"] and spawned[0] in discarded
    with lock:
        assert lock.wait_for(lambda: len(spawned) >= 4, timeout=10)
    pool.close()
    assert pool.stats()["ready"] == 0
    assert all(s in discarded for s in spawned if s is not item)
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire()


def test_pool_of_size_zero_spawns_on_demand():
    pool = WarmPool(lambda: "fresh", 0, is_alive=lambda _: True, discard=lambda _: None)
    pool.start()
    assert pool.acquire() == "fresh" and pool.stats()["cold_starts"] == 1
    pool.close()


def test_admission_bounds_running_plus_queued():
    adm = Admission(num_workers=2, max_queue=1)
    assert [adm.try_enter() for _ in range(4)] == [True, True, True, False]
    adm.leave()
    assert adm.try_enter() and adm.inside == 3


@pytest.mark.parametrize(
    "path, mounts, expected",
    [
        ("/sys/fs/cgroup", "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0", True),
        ("/sys/fs/cgroup/sandbox", "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0", True),
        ("/sys/fs/cgroup", "tmpfs /sys/fs/cgroup tmpfs rw 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0", False),
        ("/sys/fs/cgroupx", "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0", False),
    ],
)
def test_is_cgroup2_mount(path, mounts, expected):
    assert is_cgroup2_mount(path, mounts) is expected


def test_cgroup_probe_explains_why_not(tmp_path):
    support = probe_cgroup_v2(str(tmp_path))
    assert not support.usable and "not a cgroup v2 mount" in support.reason


def test_run_cgroup_files_on_a_fake_hierarchy(tmp_path):
    """The cgroup v2 path cannot run on this cgroup v1 host; check what it writes and reads."""
    cg = RunCgroup(str(tmp_path), memory_bytes=64 * MIB, max_processes=16)
    assert Path(cg.path, "memory.max").read_text() == str(64 * MIB)
    assert Path(cg.path, "pids.max").read_text() == "16"
    assert not cg.oom_killed()
    Path(cg.path, "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert cg.oom_killed()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
        cg.attach_tree(child.pid)
        assert Path(cg.path, "cgroup.procs").read_text() == str(child.pid)
    finally:
        child.kill()
        child.wait(timeout=10)
    cg.remove(timeout_s=0.05)  # a plain directory never empties: gives up at the deadline
    assert Path(cg.path).exists()


@pytest.mark.parametrize(
    "text, language, expected",
    [
        ("no fences here", None, "no fences here"),
        ("a\n```python\nprint(1)\n```\nb", "python", "print(1)\n"),
        ("```\nfirst\n```\n```py\nsecond\n```", "python", "second\n"),
        ("```cpp\nint main(){}\n```\n```text\nnotes\n```", "cpp", "int main(){}\n"),
        ("```cpp\nint main(){}\n```\n```text\nnotes\n```", None, "notes\n"),
    ],
)
def test_extract_code_block(text, language, expected):
    assert extract_code_block(text, language) == expected


class FakeClient:
    def __init__(self, passed: int) -> None:
        self.passed = passed
        self.calls = []

    def judge(self, language, code, cases, **kw):
        self.calls.append(kw)
        return JudgeResult(status="ok", passed=self.passed, total=len(cases))


@pytest.mark.parametrize(
    "passed, mode, expected",
    [
        (3, "fraction", 0.75),
        (4, "fraction", 1.0),
        (0, "fraction", 0.0),
        (3, "all_or_nothing", 0.0),
        (4, "all_or_nothing", 1.0),
    ],
)
def test_code_reward_modes(passed, mode, expected):
    client = FakeClient(passed)
    cases = [TestCase("1", "1"), {"input": "2", "output": "2"}, ("3", "3"), TestCase("4", "4")]
    assert code_reward(client, "print(1)", cases, mode=mode) == expected
    assert client.calls[0]["stop_on_first_failure"] is (mode == "all_or_nothing")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"mode": "best"}, "mode"),
        ({"language": "go"}, "language"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"memory_mb": 1.5}, "memory_mb"),
        ({"compare": "fuzzy"}, "compare"),
    ],
)
def test_code_reward_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CodeRewardConfig(**kwargs)


def test_code_reward_takes_its_config():
    from dataclasses import asdict

    client = FakeClient(2)
    cfg = CodeRewardConfig(mode="all_or_nothing", timeout_s=1.0)
    assert code_reward(client, "x", [TestCase("1", "1"), TestCase("2", "2")], **asdict(cfg)) == 1.0
    assert client.calls[0]["timeout_s"] == 1.0


def test_code_reward_edge_cases():
    client = FakeClient(1)
    assert code_reward(client, "  \n", [TestCase("1", "1")], mode="fraction") == 0.0
    assert client.calls == []
    with pytest.raises(ValueError, match="mode"):
        code_reward(client, "x", [TestCase("1", "1")], mode="best_of")
    with pytest.raises(ValueError, match="test_cases"):
        code_reward(client, "x", [], mode="fraction")


def test_reward_type_code_sandbox_builds_the_code_reward():
    from orchestrator.config import RewardConfig
    from orchestrator.rewards.code_sandbox import CodeSandboxReward
    from orchestrator.scoring import make_reward_fn

    reward = make_reward_fn(
        RewardConfig(type="code_sandbox", sandbox_url="http://127.0.0.1:1", code={"mode": "all_or_nothing"})
    )
    assert isinstance(reward, CodeSandboxReward)
    reward.client.close()
    reward.client = FakeClient(2)
    answer = "Here:\n```python\nprint(input())\n```\n"
    assert reward({"test_cases": [["1", "1"], ["2", "2"]]}, answer) == 1.0
    assert reward.client.calls[0]["stop_on_first_failure"] is True


def test_old_module_path_still_starts_the_service_cli():
    """`python -m orchestrator.sandbox` is an alias of `python -m sandbox` (README, users' scripts)."""
    repo = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.sandbox", "--help"], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "python -m sandbox" in out.stdout


# ----------------------------------------------------------------- k1.5 test-case filtering
@pytest.mark.parametrize(
    "outputs, expected",
    [
        (["1\n"] * 7 + ["2\n"] * 3, (0, 7)),
        (["2\n"] * 3 + ["1\n"] * 7, (3, 7)),
        ([None] * 10, (-1, 0)),
        (["1"] + ["1\n  "] * 5 + [None] * 4, (0, 6)),
    ],
)
def test_majority_output(outputs, expected):
    assert majority_output(outputs) == expected


def matrix(columns):
    """outputs[s][c] from a list of per-case columns."""
    return [list(row) for row in zip(*columns)]


@pytest.mark.parametrize("agree, kept", [(10, True), (7, True), (6, False), (0, False)])
def test_case_kept_only_with_enough_agreement(agree, kept):
    column = ["42\n"] * agree + [f"{i}\n" for i in range(10 - agree)]
    cases, decisions, _ = select_cases(["in\n"], matrix([column]), TestGenConfig())
    assert decisions[0].kept is kept and decisions[0].agreement == max(agree, 1)
    assert cases == ([TestCase("in\n", "42\n")] if kept else [])


def test_duplicate_inputs_are_dropped():
    cases, decisions, _ = select_cases(["a", "b", "a"], matrix([["1"] * 10] * 3), TestGenConfig())
    assert [d.kept for d in decisions] == [True, True, False]
    assert "duplicate of input 0" in decisions[2].reason and len(cases) == 2


def run_decide(num_wrong: int, wrong_on: int = 3):
    """10 solutions on 4 inputs; `num_wrong` of them are wrong on the first `wrong_on` inputs."""
    solutions = [Solution(f"s{i}", "code", planted_wrong=i >= 10 - num_wrong) for i in range(10)]
    outputs = [[("bad" if s.planted_wrong and c < wrong_on else f"{c}") for c in range(4)] for s in solutions]
    statuses = [["ok"] * 4 for _ in solutions]
    return decide_problem("p", solutions, ["i0", "i1", "i2", "i3"], outputs, statuses, TestGenConfig())


@pytest.mark.parametrize(
    "num_wrong, problem_kept, num_cases, reason",
    [
        (0, True, 4, "10 of 10 reference solutions pass"),
        (1, True, 4, "9 of 10 reference solutions pass"),
        (2, False, 0, "only 8 of 10 reference solutions pass all 4 kept cases (need 9)"),
        (3, False, 0, "only 7 of 10 reference solutions pass all 4 kept cases (need 9)"),
    ],
)
def test_problem_kept_only_when_nine_of_ten_pass(num_wrong, problem_kept, num_cases, reason):
    rep = run_decide(num_wrong)
    assert rep.kept is problem_kept and len(rep.test_cases) == num_cases
    assert reason in rep.reason
    failing = sorted(s.name for s in rep.solutions if not s.passes_all_kept)
    assert failing == [f"s{i}" for i in range(10 - num_wrong, 10)]


def test_when_wrong_solutions_break_agreement_the_case_is_dropped():
    rep = run_decide(4)  # 6 of 10 agree on inputs 0-2: dropped; only input 3 is kept
    assert [d.kept for d in rep.cases] == [False, False, False, True]
    assert [d.agreement for d in rep.cases] == [6, 6, 6, 10]
    assert rep.kept and rep.test_cases == (TestCase("i3", "3"),)
    rep = run_decide(10)  # every solution wrong alike: they agree, nothing can tell
    assert rep.kept and len(rep.test_cases) == 4


def test_no_agreement_at_all_drops_the_problem():
    solutions = [Solution(f"s{i}", "code") for i in range(10)]
    outputs = [[f"{s}"] for s in range(10)]
    rep = decide_problem("p", solutions, ["i0"], outputs, [["ok"]] * 10, TestGenConfig())
    assert not rep.kept and "no case reached agreement" in rep.reason


def test_config_and_shipped_problem_files_are_valid():
    with pytest.raises(ValueError, match="min_case_agreement"):
        TestGenConfig(min_case_agreement=0)
    problems = load_problems([str(PROBLEMS)])
    assert {p.name for p in problems} >= {"sum_list", "max_list", "reverse_string"}
    for problem in problems:
        assert len(problem.solutions) == 10, problem.name
        assert "cyaron" in problem.generator
    assert any(s.planted_wrong for p in problems for s in p.solutions)
