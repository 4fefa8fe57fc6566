"""The autocast dtype decision (pure table) and the CPU facts it reads."""

import pytest

from trainer import cpu


def _timer(fp32_ms: float, bf16_ms: float):
    calls = []

    def time_matmul(bf16: bool) -> float:
        calls.append(bf16)
        return bf16_ms if bf16 else fp32_ms

    return time_matmul, calls


@pytest.mark.parametrize(
    "requested,flags,fp32_ms,bf16_ms,chosen,timed",
    [
        ("auto", ("avx512_bf16", "amx_bf16"), 3.0, 0.5, "bfloat16", True),  # AMX machine
        ("auto", ("avx512_bf16",), 3.0, 200.0, "float32", True),  # flags lie (ONEDNN_MAX_CPU_ISA=AVX2)
        ("auto", (), 3.0, 0.5, "float32", False),  # AVX2-only EPYC: no timing at all
        ("auto", ("bf16",), 3.0, 5.0, "bfloat16", True),  # a busy machine's noise does not flip a native CPU
        ("auto", ("amx_bf16",), 9.37, 19.78, "bfloat16", True),  # seen on a native CPU under load 15
        ("auto", ("bf16",), 3.0, 30.0, "float32", True),  # over 8x slower: emulated
        ("float32", ("amx_bf16",), 3.0, 0.5, "float32", False),  # explicit settings are kept
        ("bfloat16", (), 3.0, 200.0, "bfloat16", False),
    ],
)
def test_decide_autocast_dtype(requested, flags, fp32_ms, bf16_ms, chosen, timed):
    timer, calls = _timer(fp32_ms, bf16_ms)
    choice = cpu.decide_autocast_dtype(requested, bf16_flags=flags, cpu_model="X", time_matmul=timer)
    assert choice.chosen == chosen
    assert bool(calls) == timed
    if timed:  # interleaved rounds: float32, bf16, float32, bf16, ...
        assert calls == [False, True] * cpu.TIMING_ROUNDS
    assert choice.requested == requested and choice.reason
    assert choice.to_dict()["bf16_flags"] == flags


def test_decide_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="float16"):
        cpu.decide_autocast_dtype("float16", bf16_flags=())


def test_cpu_info_reads_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 fma\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 fma\n"
    )
    assert cpu.cpu_info(str(path)) == ("AMD EPYC 7B13", ())
    path.write_text("model name\t: Intel Xeon\nflags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu.cpu_info(str(path)) == ("Intel Xeon", ("avx512_bf16", "amx_bf16"))
    path.write_text("Features\t: fp asimd bf16 i8mm\nCPU implementer\t: 0x41\n")
    assert cpu.cpu_info(str(path))[1] == ("bf16",)


def test_num_threads_capped_at_affinity(monkeypatch):
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert cpu.usable_cpus() == 3
    assert cpu.num_threads_for(None) == 3
    assert cpu.num_threads_for(1) == 1
    assert cpu.num_threads_for(8) == 3


def test_resolve_measures_this_cpu():
    choice = cpu.resolve_autocast_dtype("auto")
    assert choice.chosen in ("float32", "bfloat16")
    if choice.chosen == "bfloat16":
        assert choice.bfloat16_matmul_ms < choice.float32_matmul_ms
