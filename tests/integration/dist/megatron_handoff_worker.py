"""One rank of tests/integration/dist/test_megatron_tp_handoff.py, under torchrun (gloo, CPU) at TP=2.

Every rank builds MegatronTrainer(tp_size=2) from --model-dir and calls the same collective methods;
rank 0 also holds the ParameterServer (world size 1, CPU transport), as the RL job's process does.

  1. named_tensors() with torch.distributed's data calls counted: only the buffer's (pid, fd, size)
     broadcast (24 bytes) and a barrier may happen, no send/recv/gather of shards;
  2. rank 0: register_checkpoint(named_tensors=...) adopts the shared buffer (no copy) and every
     registered tensor equals the model directory's, dtype and bits; an update delivers them to an
     engine (in-process receive loop) bit-exactly;
  3. one training step; named_tensors() while v0 stays registered writes the OTHER buffer (v0's
     bytes unchanged) and equals the old path (shards gathered to rank 0, megatron_to_hf, cast)
     bit-exactly; after v0 is unregistered the next call writes v0's buffer again.
Each rank writes rank<k>.json into --out; exit code 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import warnings

COUNTED = (
    "send",
    "recv",
    "isend",
    "irecv",
    "gather",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "all_reduce",
    "reduce",
    "scatter",
    "all_to_all",
    "gather_object",
    "all_gather_object",
    "broadcast_object_list",
    "barrier",
)


class DataCalls:
    """Counts torch.distributed calls (and tensor bytes) while active."""

    def __init__(self, dist):
        self.calls: dict[str, int] = {}
        self.nbytes = 0
        self.active = False
        for name in COUNTED:
            original = getattr(dist, name)
            setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name, original):
        import torch

        def call(*args, **kwargs):
            if self.active:
                self.calls[name] = self.calls.get(name, 0) + 1
                for a in args:
                    if isinstance(a, torch.Tensor):
                        self.nbytes += a.numel() * a.element_size()
                    elif isinstance(a, list):
                        self.nbytes += sum(t.numel() * t.element_size() for t in a if isinstance(t, torch.Tensor))
            return original(*args, **kwargs)

        return call


def _gather_old_way(trainer):
    """The old path, for reference only: TP rank 1 sends its shard to rank 0, which merges and casts."""
    import torch
    import torch.distributed as dist

    from trainer.megatron.convert import megatron_to_hf

    mine = trainer.megatron_state()
    if dist.get_rank() == 1:
        for name in sorted(mine):
            dist.send(mine[name].detach().contiguous(), dst=0)
        return None
    other = {}
    for name in sorted(mine):
        other[name] = torch.empty_like(mine[name])
        dist.recv(other[name], src=1)
    hf = megatron_to_hf({(0, 0): mine, (0, 1): other}, trainer.shape, trainer.megatron.parallelism, trainer.norm_style)
    return {n: t.detach().to(trainer._disk_dtypes.get(n, t.dtype)) for n, t in hf.items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    import torch
    import torch.distributed as dist

    from checkpoint_engine.config import ParameterServerConfig
    from checkpoint_engine.ps import ParameterServer
    from demo.tiny_model import load_state_dict_from_dir
    from tests.unit.checkpoint_engine.test_ce_inprocess import ThreadEngine
    from trainer.base import TrainerConfig
    from trainer.megatron.model import MegatronModelConfig
    from trainer.megatron.trainer import MegatronTrainer

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    counter = DataCalls(dist)
    trainer = MegatronTrainer(
        args.model_dir,
        TrainerConfig(lr=1e-3, optimizer="sgd", autocast_dtype="float32", num_threads=1),
        MegatronModelConfig(tp_size=2),
    )
    result: dict = {"rank": rank, "no_gather_method": not hasattr(trainer, "gather_shards")}
    ps = None
    try:
        counter.active = True
        first = trainer.named_tensors()
        counter.active = False
        result["calls"], result["bytes_sent"] = counter.calls, counter.nbytes
        result["no_shard_traffic"] = set(counter.calls) <= {"broadcast", "barrier"} and counter.nbytes <= 24
        if rank == 0:
            disk = load_state_dict_from_dir(args.model_dir)
            ps = ParameterServer(rank=0, world_size=1, config=ParameterServerConfig(transport="cpu"))
            ps.register_checkpoint("v0", named_tensors=first)
            ckpt = ps._checkpoints["v0"]
            registered = {m.name: ckpt.view(m) for m in ckpt.layout.metas}
            result["adopted"] = ckpt.adopted and ckpt.chunks[0].tensor.data_ptr() <= first[next(iter(first))].data_ptr()
            result["registered_equals_hf"] = set(registered) == set(disk) and all(
                registered[n].dtype == disk[n].dtype and torch.equal(registered[n], disk[n]) for n in disk
            )
            result["dtypes"] = sorted({str(t.dtype) for t in registered.values()})
            ps.gather_metas("v0")
            engine = ThreadEngine()
            result["update_mode"] = ps.update("v0", engine.req_func).mode
            result["engine_equals_hf"] = set(engine.weights) == set(disk) and all(
                torch.equal(engine.weights[n], disk[n]) for n in disk
            )
        prompts, responses = [(1, 20, 21, 22)] * 2, [(30, 31, 32, 33)] * 2
        trainer.step(-trainer.sequence_logprobs(prompts, responses).mean())
        second = trainer.named_tensors()
        reference = _gather_old_way(trainer)
        if rank == 0:
            name = next(iter(second))
            result["second_buffer_differs"] = second[name].data_ptr() != first[name].data_ptr()
            result["v0_unchanged"] = all(torch.equal(ckpt.view(m), disk[m.name]) for m in ckpt.layout.metas)
            result["trained_equals_old_path"] = set(second) == set(reference) and all(
                second[n].dtype == reference[n].dtype and torch.equal(second[n], reference[n]) for n in reference
            )
            result["weights_moved"] = any(not torch.equal(second[n], disk[n]) for n in disk)
            ps.unregister_checkpoint("v0")
        dist.barrier()
        third = trainer.named_tensors()
        if rank == 0:
            result["buffer_reused_after_unregister"] = third[name].data_ptr() == first[name].data_ptr()
            result["third_equals_second"] = all(torch.equal(third[n], reference[n]) for n in reference)
    finally:
        if ps is not None:
            ps.close()
        trainer.close()
        from trainer.megatron import model as mg_model

        mg_model.close_parallel()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
    checks = [v for k, v in result.items() if isinstance(v, bool)]
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
