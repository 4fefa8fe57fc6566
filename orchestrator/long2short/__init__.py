"""k1.5 long2short (report section 2.4): make a long-CoT model answer with fewer tokens.

cli     `python -m orchestrator.long2short` / `ckpt-long2short`: the subcommands
sample  n responses per problem, and the shortest-rejection records
train   SFT on those records, or DPO
merge   `alpha * long + (1 - alpha) * short` into a new model directory
eval    greedy held-out accuracy and mean response tokens of several models
"""
