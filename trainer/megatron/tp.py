"""Tensor parallel Megatron training inside the RL job: the job's process is TP rank 0, and
``tp_size - 1`` follower processes (``python -m trainer.megatron.tp``) hold the other shards.

::

    RL loop (orchestrator process) ── Trainer protocol ──▶ TPMegatronTrainer = TP rank 0
        │ every call: broadcast_object_list(command) over gloo ──▶ follower ranks 1..tp-1
        │                                                          (same MegatronTrainer method)
        sequence_logprobs: every rank runs the forward (logits gathered over TP); rank 0 hands
            the loop a detached proxy of log p; its loss.backward() stops at the proxy
        backward: rank 0 broadcasts d loss / d log p; every rank backpropagates it through its
            own graph (megatron's TP all-reduces pair up across ranks)
        step: grad norm summed over the TP group (replicated params once), same clip, AdamW per shard
        named_tensors: every rank writes its own HF slices (convert.write_rank_slices) into ONE
            shared HF-layout buffer (a memfd rank 0 made; the followers map /proc/<rank 0>/fd/<fd>),
            barrier ──▶ rank 0 hands out views of it ──▶ WeightSync: ParameterServer.register_checkpoint
            adopts the buffer as its chunk (no copy) ──▶ engines read it in place (local mode)

Where the ParameterServer lives: in the job's process, TP rank 0, one PS rank per inference engine
(WeightSync: world size 1). It is the process that makes the shared buffer, so the buffer's fd is
the PS's own chunk handle: engines open /proc/<PS pid>/fd/<fd> as for any registered chunk, and the
buffer outlives no process that still needs it. The trainer's TP ranks are writers, not PS ranks:
a PS rank must own whole HF tensors (one owner per tensor), while a TP rank holds slices of most
of them. No shard goes over gloo: the only messages of a sync are the buffer's (pid, fd, size) and
a barrier. Needs the TP ranks on the PS's host (TP stays inside a node). The loss and the k1.5 step
are the loop's own code, unchanged: only rank 0 sees them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import pathlib
import subprocess
import sys
from collections.abc import Mapping, Sequence

import torch

from ckpt_common.ports import free_port
from trainer.base import TrainerConfig, save_hf_dir

logger = logging.getLogger(__name__)

_TIMEOUT = datetime.timedelta(hours=6)  # followers wait in a broadcast while the loop does rollouts


def _broadcast(obj=None):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TPMegatronTrainer:
    """TP rank 0 of a Megatron trainer whose other ranks are follower processes it starts."""

    def __init__(
        self,
        model_dir: str | pathlib.Path,
        config: TrainerConfig | None = None,
        tp_size: int = 2,
        follower_env: Mapping[str, str] | None = None,
    ) -> None:
        import torch.distributed as dist

        from trainer.megatron.model import MegatronModelConfig
        from trainer.megatron.trainer import MegatronTrainer

        if dist.is_initialized():
            raise RuntimeError("TPMegatronTrainer makes its own process group; one is already initialized")
        if tp_size < 2:
            raise ValueError(f"tp_size={tp_size}: use MegatronTrainer for TP=1")
        config = TrainerConfig() if config is None else config
        if config.num_threads is None:  # the ranks share the process's CPUs
            from trainer.cpu import usable_cpus

            config = dataclasses.replace(config, num_threads=max(1, usable_cpus() // tp_size))
        port = free_port()
        env = dict(os.environ, **(follower_env or {}))
        repo = str(pathlib.Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
        self._followers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "trainer.megatron.tp",
                    "--model-dir",
                    str(model_dir),
                    "--tp",
                    str(tp_size),
                    "--rank",
                    str(rank),
                    "--port",
                    str(port),
                    "--config",
                    json.dumps(dataclasses.asdict(config)),
                ],
                env=env,
                cwd=repo,
            )
            for rank in range(1, tp_size)
        ]
        try:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=tp_size, timeout=_TIMEOUT
            )
            self.inner = MegatronTrainer(model_dir, config, MegatronModelConfig(tp_size=tp_size))
        except BaseException:
            self._kill_followers()
            raise
        self.config = self.inner.config
        self.tp_size = tp_size
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (proxy handed out, real log p)
        self._closed = False

    # attributes the loop and policy read
    @property
    def num_threads(self) -> int:
        return self.inner.num_threads

    @property
    def dtype_choice(self):
        return self.inner.dtype_choice

    @property
    def pad_id(self) -> int:
        return self.inner.pad_id

    @property
    def source_dir(self) -> pathlib.Path:
        return self.inner.source_dir

    def _call(self, method: str, *args, pending: list | None = None):
        _broadcast((method, args, torch.is_grad_enabled()))
        return _run(self.inner, method, args, [] if pending is None else pending)

    def _logprobs(self, method: str, *args) -> torch.Tensor:
        real = self._call(method, *args)
        if not real.requires_grad:
            return real
        proxy = real.detach().requires_grad_()
        self._pending.append((proxy, real))
        return proxy

    def sequence_logprobs(
        self,
        prompt_ids_list: Sequence[Sequence[int]],
        response_ids_list: Sequence[Sequence[int]],
        response_masks: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        return self._logprobs(
            "sequence_logprobs",
            _plain(prompt_ids_list),
            _plain(response_ids_list),
            None if response_masks is None else _plain(response_masks),
        )

    def token_logprobs(self, prompt_ids_list, response_ids_list, response_masks=None) -> torch.Tensor:
        return self._logprobs(
            "token_logprobs",
            _plain(prompt_ids_list),
            _plain(response_ids_list),
            None if response_masks is None else _plain(response_masks),
        )

    def backward(self, loss: torch.Tensor) -> None:
        if loss.dim() != 0:
            raise ValueError(f"loss must be a scalar, got shape {tuple(loss.shape)}")
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss.item()!r}")
        loss.backward()  # into the proxies only
        grads = [torch.zeros_like(proxy) if proxy.grad is None else proxy.grad for proxy, _ in self._pending]
        reals = [real for _, real in self._pending]
        self._pending = []
        self._call("_backward_pending", grads, pending=reals)

    def step(self, loss: torch.Tensor | None = None) -> dict[str, float]:
        if loss is not None:
            self.backward(loss)
        return self._call("step")

    def reset_optimizer(self) -> None:
        self._pending = []
        self._call("reset_optimizer")

    def set_lr(self, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"lr={lr!r} must be > 0")
        self._call("set_lr", float(lr))

    def named_tensors(self, copy: bool = False) -> dict[str, torch.Tensor]:
        """Views of the shared HF buffer every rank wrote its slices into (see the module docstring)."""
        return self._call("named_tensors", bool(copy))

    def release_device_memory(self) -> dict[str, float | int]:
        return self._call("release_device_memory")  # every rank lends its device

    def reclaim_device_memory(self) -> dict[str, float | int]:
        return self._call("reclaim_device_memory")

    def load_hf_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._call("load_hf_weights", {n: t.detach().cpu() for n, t in state_dict.items()})

    def save(self, out_dir: str | pathlib.Path) -> pathlib.Path:
        return save_hf_dir(
            self.inner.source_dir,
            out_dir,
            self.named_tensors(),
            self.config,
            extra={"backend": "megatron", "tp_size": self.tp_size},
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            _broadcast(("close", (), False))
        except Exception as e:  # noqa: BLE001 - the followers may be gone already
            logger.warning("TP followers did not take the close command: %s", e)
        for proc in self._followers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        from trainer.megatron import model as mg_model
        from trainer.megatron.cpu_compat import remove_cpu_redirects

        self.inner.close()  # the shared HF buffers (a registered one: when it is unregistered)
        mg_model.close_parallel()
        remove_cpu_redirects()

    def _kill_followers(self) -> None:
        for proc in self._followers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _plain(rows) -> list[list[int]]:
    return [list(map(int, r)) for r in rows]


def _run(trainer, method: str, args: tuple, pending_real: list):
    """One command on one rank (rank 0 and the followers run the same code)."""
    if method == "_backward_pending":
        (grads,) = args
        if len(grads) != len(pending_real):
            raise RuntimeError(f"{len(grads)} gradients for {len(pending_real)} pending log-prob tensors")
        if grads:
            torch.autograd.backward(pending_real, grads)
        pending_real.clear()
        return None
    if method in ("step", "reset_optimizer"):
        pending_real.clear()
    return getattr(trainer, method)(*args)


def follower_main(argv=None) -> int:
    """A follower TP rank: build the same MegatronTrainer, then run rank 0's commands until "close"."""
    import warnings

    import torch.distributed as dist

    from trainer.megatron.model import MegatronModelConfig
    from trainer.megatron.trainer import MegatronTrainer

    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--config", required=True, help="TrainerConfig as JSON")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.tp, timeout=_TIMEOUT
    )
    trainer = MegatronTrainer(
        args.model_dir, TrainerConfig(**json.loads(args.config)), MegatronModelConfig(tp_size=args.tp)
    )
    pending: list[torch.Tensor] = []
    try:
        while True:
            method, call_args, grad_enabled = _broadcast()
            if method == "close":
                return 0
            with torch.set_grad_enabled(grad_enabled):
                out = _run(trainer, method, call_args, pending)
            if method in ("sequence_logprobs", "token_logprobs") and out.requires_grad:
                pending.append(out)
    finally:
        from trainer.megatron import model as mg_model

        mg_model.close_parallel()


if __name__ == "__main__":
    sys.exit(follower_main())
