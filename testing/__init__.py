"""Helpers for the tests and benchmarks (not shipped in the wheel): real vLLM servers started as
child processes with free ports, deadlines and log files (`testing.vllm_servers`).
"""
