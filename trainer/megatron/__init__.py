"""megatron-core backend.

``cpu_compat``  the CPU redirects (explicit ``apply_cpu_redirects()``, never on import)
``convert``     HF <-> Megatron state dicts and a rank's slices (pure torch; no megatron), by the piece
                table of ``ckpt_common.layout`` (shapes, parallelism, HF <-> Megatron pieces)
``model``       GPTModel construction, process groups, loading HF weights (imports megatron lazily)
``trainer``     ``MegatronTrainer``: the orchestrator's ``Trainer`` protocol on a GPTModel (one TP rank;
                the whole model at TP=1, in the RL job's process); ``named_tensors``: every TP rank writes
                its HF slices into one shared buffer the ParameterServer adopts (no copy, no gather)
``tp``          ``TPMegatronTrainer``: TP > 1 inside the RL job (the job's process is TP rank 0 and
                starts the follower ranks, ``python -m trainer.megatron.tp``, over gloo)

``trainer.factory.make_trainer("megatron", model_dir, config, tp_size=...)`` picks between them
(the RL job's ``trainer`` config section: ``{"type": "megatron", "tp_size": 2}``).
"""
