"""One rank of a two-rank trainer pushing its model into vLLM at tensor parallel 2 through vLLM's own
trainer API with the checkpoint_engine backend (test_vllm_tp2.py runs two of these).

    python -m tests.integration.vllm.tp2_trainer_rank --rank R --world-size 2 --master-port P --url URL --model DIR \
        [--go-file PATH]

Each rank joins a gloo process group (the trainer's own, as torchrun would make), loads the model
with transformers (a replica on every rank, as under DDP), and calls `trainer_init` and
`send_weights` as vLLM's API asks of every trainer rank. With `--go-file` it gets ready (vLLM's import
alone takes ~12 s here) and then waits for that file before it talks to vLLM: the test starts the
ranks beside the engine's start. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--go-file", default=None, help="wait (up to --go-timeout-s) for this file before sending")
    p.add_argument("--go-timeout-s", type=float, default=900.0)
    a = p.parse_args()

    from datetime import timedelta

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_ext.weight_transfer.trainer import CheckpointEngineTrainerInitInfo

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{a.master_port}",
        rank=a.rank,
        world_size=a.world_size,
        timeout=timedelta(seconds=a.timeout_s),
    )
    model = AutoModelForCausalLM.from_pretrained(a.model)
    if a.go_file is not None:
        deadline = time.monotonic() + a.go_timeout_s
        while not os.path.exists(a.go_file):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {a.go_file} within {a.go_timeout_s:.0f} s")
            time.sleep(0.1)  # the test's signal, polled under the deadline
    info = CheckpointEngineTrainerInitInfo(
        rank=a.rank, world_size=a.world_size, transport="cpu", update_timeout_s=a.timeout_s
    )
    client = HTTPVLLMWeightSyncClient(a.url, timeout=a.timeout_s)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    try:
        start = time.monotonic()
        engine.send_weights()
        send_s = time.monotonic() - start
        registered = engine.ps.checkpoints()
    finally:
        engine.shutdown()
    share = next(iter(registered.values()))["num_tensors"]
    print(json.dumps({"ok": True, "rank": a.rank, "send_s": round(send_s, 3), "num_tensors": share}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
