"""The pieces one weight update of `vllm_ext.receiver` composes, one job each: how tensors reach the
loaders per reload mode (`modes`), the weight cache's use (`caching`), the reads the engine does
itself (`reads`), a delta update (`delta`) and test-only fault injection (`faults`)."""
