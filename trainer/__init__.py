"""The training side of the topology: trainer backends that hand their weights to the checkpoint engine.

``base``           what every backend shares: the ``Trainer`` protocol, ``TrainerConfig``, the optimizer
                   recipe and steps (``OptimizerSteps``), batch padding, HF-directory save
``hf``             ``HFTrainer``: a transformers model in this process
``factory``        ``make_trainer`` picks the backend (``"hf"`` or ``"megatron"``)
``policy``         one RL training step (k1.5 eq. 3, GRPO, REINFORCE behind ``make_objective``)
``loss``           every loss as a pure tensor function (k1.5, GRPO, REINFORCE, DPO), table-tested
``dpo``            long2short's data rules (shortest rejection, DPO pairs) and the DPO step
``sft``            supervised fine-tuning of the demo model (``python -m trainer.sft``), cached by config
``cpu``            the autocast dtype decision (bf16 only where it is native) and thread counts
``megatron``       the megatron-core backend (GPTModel with the local layer spec; on CPU through gloo
                   with ``trainer.megatron.cpu_compat``) and its pure HF <-> Megatron conversion

The orchestrator talks to a trainer only through the ``Trainer`` protocol (train one iteration on a
batch, hand out named tensors in HF layout, save/load state); nothing here imports ``orchestrator``.
"""
