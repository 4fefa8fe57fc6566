"""Helpers every package of the project uses (none of them knows about weights or engines).

validate    field checks for config dataclasses (one wording everywhere)
cli_config  command-line flags generated from a config dataclass
dictconfig  config dataclasses <-> JSON trees, merging and `--set` overrides
logs        logging set-up for entry points
httpjson    JSON over HTTP, client and a quiet handler base (stdlib)
ports       free TCP ports
procs       child processes that end with their parent
fsutil      crash-safe file writes
hf_dir      the safetensors files of a Hugging Face model directory
"""
