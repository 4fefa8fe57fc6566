"""The model's tensor layout, shared by the trainer and the checkpoint engine (pure, no torch, no megatron).

``shapes``  ``ModelShape`` (dense or MoE, from an HF config), ``Parallelism`` (TP, PP, EP; ranks), the
            global <-> local expert index, the HF tensors' shapes, each PP stage's layers, ``Piece``
``pieces``  the HF Qwen2 <-> Megatron-core layout as a table of pieces: which slice of which HF tensor
            each Megatron tensor on each (pp, tp[, ep]) rank holds (``hf_sources``, ``sources_of_slice``,
            ``conversion_pieces``, ``writer_pieces``)

It sits below both users: ``trainer.megatron`` converts and hands out weights by it, and
``checkpoint_engine.sharding.shard_plan`` plans which slices each inference rank needs by it.
"""
