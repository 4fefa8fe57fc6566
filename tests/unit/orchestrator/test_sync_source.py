"""`sync.source`: files (the handoff dir) or the job's memory (orchestrator.engine_pool.memory_source)."""

import pytest

from orchestrator.config import SyncConfig


@pytest.mark.parametrize(
    "kw, error",
    [
        ({}, None),
        ({"source": "memory", "p2p_host": "10.0.0.5"}, None),
        ({"source": "disk"}, "must be 'files' or 'memory'"),
        ({"source": "memory", "delta": True}, None),  # deltas go from memory too
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


def test_the_megatron_trainers_shared_buffer_is_published_without_a_copy():
    """`sync.source=memory` with the Megatron trainer: `named_tensors()` are views of a SharedTensorBuffer
    (its TP ranks wrote their slices there), and MemorySource registers them as that buffer itself: the
    chunk the daemon's ranks read over Mooncake is the buffer's memory (the metas' chunk pointer is the
    buffer's address), not a copy. Two buffers alternate as the trainer does: v2 goes into the second
    while v1 is registered; releasing v1 frees the first for v3."""
    pytest.importorskip("mooncake.engine")
    import json

    from checkpoint_engine.host_memory import SharedTensorBuffer
    from orchestrator.engine_pool.memory_source import MemorySource

    specs = [("model.embed_tokens.weight", "float32", (64, 16)), ("model.norm.weight", "float32", (16,))]
    source = MemorySource("127.0.0.1", timeout_s=10)
    buffers = [SharedTensorBuffer(specs), SharedTensorBuffer(specs)]
    try:
        for version, buf in zip((1, 2, 3), (buffers[0], buffers[1], buffers[0])):
            assert buf.adopted_by is None  # free: the version it held was released
            for t in buf.tensors.values():
                t.fill_(float(version))
            name = f"policy-v{version}"
            metas = json.loads(json.dumps(source.publish(name, buf.tensors)))  # what POST /metas carries
            assert buf.adopted_by == name  # registered as the buffer itself
            ckpt = source.ps._checkpoints[name]
            (chunk,) = ckpt.chunks
            assert ckpt.adopted and (chunk.handle.pid, chunk.handle.fd) == (buf.ref.pid, buf.ref.fd)
            first = ckpt.layout.metas[0]
            assert chunk.tensor.data_ptr() + first.offset_bytes == buf.tensors[first.name].data_ptr()
            assert metas["chunk_ptrs"] == {"0": [chunk.tensor.data_ptr()]} and metas["p2p_addrs"]["0"]
            source.release(keep=name)
            assert source.registered == [name]
    finally:
        source.close()
        for buf in buffers:
            buf.close()
