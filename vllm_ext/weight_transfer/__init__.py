"""The checkpoint engine as a backend of vLLM's own weight-transfer API (`vllm.distributed.weight_transfer`),
one module per side, as vLLM lays out its backends:

    infos.py       the backend's init/update infos (no torch, no vLLM): both sides build and parse them
    plugin.py      `register()`: the worker-side backend, by module path (the `vllm.general_plugins` entry point)
    engine.py      worker side: `CheckpointEngineWeightTransferEngine` (the extension's receiver and reload)
    native_req.py  ParameterServer side: req_funcs over vLLM's RL routes, an offline LLM or a sync client
    trainer.py     vLLM's trainer API: registers the trainer-side engine when imported

Importing this package imports nothing else.
"""
