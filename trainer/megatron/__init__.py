"""megatron-core backend: CPU redirects (``cpu_compat``), pure HF <-> Megatron conversion
(``convert``, no megatron import) and GPTModel construction (``model``, imports megatron lazily)."""
