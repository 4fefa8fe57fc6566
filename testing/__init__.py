"""Helpers for the tests, benchmarks and examples (not shipped in the wheel): real vLLM servers started
as child processes with free ports, deadlines and log files (`testing.vllm_servers`), and the
checkpoint-engine daemon started the same way (`testing.daemon`).
"""
