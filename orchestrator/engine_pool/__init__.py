"""Rollout engines behind one interface, and the weight sync that feeds each kind.

base            the `RolloutEngine` interface
factory         the engine a config names
vllm_async      vLLM's AsyncLLM in this process
vllm_http       a running vLLM server over HTTP
pool            N local vLLM servers behind one engine (pool_servers, pool_members, pool_sync)
daemon          engines the checkpoint-engine daemon manages (daemon_client: its HTTP API)
weight_sync     trainer -> engines through the checkpoint engine, once per iteration
"""
