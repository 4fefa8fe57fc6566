"""megatron-core backend.

``cpu_compat``  the CPU redirects (explicit ``apply_cpu_redirects()``, never on import)
``layout``      the HF <-> Megatron layout as a table of pieces (pure; no tensors, no megatron)
``convert``     HF <-> Megatron state dicts and a rank's slices (pure torch; no megatron)
``model``       GPTModel construction, process groups, loading HF weights (imports megatron lazily)
"""
