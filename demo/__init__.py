"""The demo's built-in material: the arithmetic task (problems, answer formats, held-out split) and the
tiny Qwen2 model with its character-level tokenizer, both made in code (nothing is downloaded).

Nothing here is needed to move weights; the RL job, SFT and the benchmarks use it as their default
task and model.
"""
