"""The training side of the topology: trainer backends that hand their weights to the checkpoint engine.

``trainer.megatron`` is the megatron-core backend (GPTModel with the local layer spec; on CPU
through gloo with ``trainer.megatron.cpu_compat``) and its pure HF <-> Megatron conversion.
"""
