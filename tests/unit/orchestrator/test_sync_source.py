"""`sync.source`: files (the handoff dir) or the job's memory (orchestrator.engine_pool.memory_source)."""

import pytest

from orchestrator.config import SyncConfig


@pytest.mark.parametrize(
    "kw, error",
    [
        ({}, None),
        ({"source": "memory", "p2p_host": "10.0.0.5"}, None),
        ({"source": "disk"}, "must be 'files' or 'memory'"),
        ({"source": "memory", "delta": True}, "sync.delta=false"),
        ({"source": "memory", "p2p_host": ""}, "must be an address"),
        ({"source": "memory", "p2p_protocol": "rdma"}, None),
        ({"source": "memory", "p2p_protocol": "udp"}, "must be 'tcp' or 'rdma'"),
    ],
)
def test_sync_source_values(kw, error):
    if error is None:
        assert SyncConfig(**kw).source == kw.get("source", "files")
    else:
        with pytest.raises(ValueError, match=error):
            SyncConfig(**kw)


def test_the_engines_model_folder_holds_no_weights_and_the_jobs_shape(tmp_path):
    """`python -m orchestrator --write-engine-model DIR`: what an inference host's engine needs as --model
    when no volume is shared: the warm-up model's config (the shape of sft.*) and tokenizer, no weights."""
    import json
    import subprocess
    import sys

    out = tmp_path / "model"
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--set", "sft.hidden_size=128", "--set", "sft.num_layers=3"]
        + ["--write-engine-model", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    hf = json.loads((out / "config.json").read_text())
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"]) == (128, 3, 512)
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(out)) == hf["vocab_size"]


def test_the_engines_model_folder_of_your_own_model_is_its_files_but_the_weights(tmp_path):
    from demo.tiny_model import TinyModelConfig, make_tiny_model
    from orchestrator.config import load_config
    from orchestrator.engine_pool.daemon import write_engine_model

    mine = make_tiny_model(tmp_path / "mine", TinyModelConfig.tiny(num_layers=1), max_shard_size_bytes=2**16)
    assert len(list(mine.glob("*.safetensors"))) > 1  # sharded, with an index
    job = load_config(None, [f"init_model_dir={mine}"])
    out = write_engine_model(job, tmp_path / "engine-model")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in mine.iterdir() if p.suffix != ".safetensors" and not p.name.endswith(".index.json")
    )
    assert (out / "config.json").read_bytes() == (mine / "config.json").read_bytes()
