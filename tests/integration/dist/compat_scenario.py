"""One rank of a MoonshotAI-style script, run under torchrun by tests/integration/dist/test_ce_compat_update.py.

    torchrun --nproc-per-node 2 -m tests.integration.dist.compat_scenario SCENARIO [options]

It uses only the API MoonshotAI's users call (`checkpoint_engine.distributed`, `ParameterServer(
auto_pg=True)` with no config, `update_weights_from_ipc` in the engine). Each rank starts one engine
process (spawn) that checks every tensor it receives bit-exact against tensors it rebuilds from
seeds. Prints `COMPAT_OK <scenario> rank <r>` and exits 0 when every check passed.

Scenarios: ranks (rank lists in sequence), error (an engine whose run raises, then a good update),
files (/dev/shm + disk safetensors files + in-memory tensors), owner + join (two torchrun jobs: the
owner job saves its metas with pickle and waits for the test's release; the join job gathers metas
of a name it never registered, loads the owners' metas and pulls from them).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import queue
import shutil
import socket
import sys
import uuid

import torch
import torch.multiprocessing as mp

DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32)
ENGINE_WAIT_S = 60.0


def make_tensors(seed: int, owner: int) -> dict[str, torch.Tensor]:
    """~2.5 MB of random tensors in bf16 / fp16 / fp8 e4m3 / fp32, names unique per owner rank."""
    g = torch.Generator().manual_seed(1000 * seed + owner)
    out = {}
    for i in range(32):
        dtype = DTYPES[int(torch.randint(0, len(DTYPES), (1,), generator=g))]
        shape = (int(torch.randint(8, 96, (1,), generator=g)), int(torch.randint(64, 640, (1,), generator=g)))
        out[f"rank{owner}.layer{i}.w"] = torch.randn(shape, generator=g).to(dtype)
    return out


def expected_tensors(seed: int, world: int) -> dict[str, torch.Tensor]:
    return {k: v for r in range(world) for k, v in make_tensors(seed, r).items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


# -- engine process ----------------------------------------------------------------------------
def engine_main(rank: int, device_id: str, world: int, cmds, results) -> None:
    """Serve updates until None arrives: ("check", paths, seed) or ("fail", paths, seed)."""
    import zmq

    from checkpoint_engine.worker import update_weights_from_ipc

    torch.set_num_threads(1)
    ctx = zmq.Context()
    cache: dict[int, dict[str, torch.Tensor]] = {}
    while True:
        item = cmds.get(timeout=120)
        if item is None:
            break
        kind, paths, seed = item
        expected = cache.setdefault(seed, expected_tensors(seed, world))
        seen: set[str] = set()

        def run(weights, expected=expected, seen=seen, kind=kind):
            if kind == "fail" and rank == 0:
                raise RuntimeError("Intentional Error for testing.")
            for name, t in weights:
                if name not in expected or not same_bits(t, expected[name]):
                    raise AssertionError(f"tensor {name!r} differs from what was registered")
                seen.add(name)

        def post_hook(expected=expected, seen=seen):
            missing = sorted(set(expected) - seen)
            if missing:
                raise AssertionError(f"{len(missing)} tensors never arrived, e.g. {missing[:3]}")

        try:
            state = update_weights_from_ipc(
                ctx, dict(paths)[device_id], None, run=run, post_hook=post_hook, timeout_s=ENGINE_WAIT_S
            )
            results.put(("ok", len(seen), state.version))
        except RuntimeError as e:  # UpdateAborted: reported, the engine keeps serving
            results.put(("aborted", str(e), -1))
    ctx.term()


class EngineProc:
    def __init__(self, rank: int, device_id: str, world: int):
        mpc = mp.get_context("spawn")
        self.cmds, self.results = mpc.Queue(), mpc.Queue()
        self.proc = mpc.Process(target=engine_main, args=(rank, device_id, world, self.cmds, self.results))
        self.proc.start()

    def req_func(self, kind: str, seed: int):
        return lambda paths: self.cmds.put((kind, list(paths), seed))

    def result(self):
        try:
            return self.results.get(timeout=ENGINE_WAIT_S)
        except queue.Empty:
            raise AssertionError(f"engine reported nothing within {ENGINE_WAIT_S} s") from None

    def stop(self) -> int:
        self.cmds.put(None)
        self.proc.join(30)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join(5)
        return self.proc.exitcode


# -- scenarios -----------------------------------------------------------------------------------
def expect_ok(engine: EngineProc, what: str) -> None:
    res = engine.result()
    assert res[0] == "ok", f"{what}: engine said {res}"


def scenario_ranks(ps, dist, engine, rank, world, args) -> None:
    ps.register_checkpoint("test", named_tensors=make_tensors(1, rank))
    ps.gather_metas("test")
    rank_lists = json.loads(args.rank_lists)
    for n, ranks in enumerate(rank_lists):
        metrics = ps.update("test", engine.req_func("check", 1), ranks=ranks)
        receiver = not ranks or rank in ranks
        if receiver:
            assert metrics is not None and metrics.mode == "local", (ranks, metrics)
            expect_ok(engine, f"update {n} ranks={ranks}")
        else:
            assert metrics is None, f"rank {rank} is not in {ranks} but update returned {metrics}"
        print(f"UPDATE_OK {n} ranks={ranks} receiver={receiver}", flush=True)
    dist.barrier()  # owners keep the checkpoint until every receiver has read it
    ps.unregister_checkpoint("test")


def scenario_error(ps, dist, engine, rank, world, args) -> None:
    ps.register_checkpoint("test", named_tensors=make_tensors(2, rank))
    ps.gather_metas("test")
    try:
        ps.update("test", engine.req_func("fail", 2))
    except RuntimeError as e:
        assert "Failed to update weights due to remote errors" in str(e), str(e)
        assert "rank 0: engine failed on bucket" in str(e) and "Intentional Error for testing." in str(e), str(e)
        print(f"REMOTE_ERROR {e}", flush=True)
    else:
        raise AssertionError("update did not raise although engine 0's run raised")
    res = engine.result()
    assert res[0] == "aborted", res
    ps.update("test", engine.req_func("check", 2))  # the next update succeeds
    expect_ok(engine, "update after the failed one")
    dist.barrier()
    ps.unregister_checkpoint("test")


def scenario_files(ps, dist, engine, rank, world, args) -> None:
    from safetensors.torch import save_file

    tensors = make_tensors(3, rank)
    items = list(tensors.items())
    third = len(items) // 3
    in_shm, on_disk, in_memory = dict(items[:third]), dict(items[third : 2 * third]), dict(items[2 * third :])
    shm_dir = os.path.join(args.shm_dir, f"rank{rank}")
    disk_dir = os.path.join(args.tmp, f"rank{rank}")
    try:
        os.makedirs(shm_dir)
        os.makedirs(disk_dir)
        files = [os.path.join(shm_dir, "part.safetensors"), os.path.join(disk_dir, "part.safetensors")]
        save_file(in_shm, files[0])
        save_file(on_disk, files[1])
        ps.register_checkpoint(
            "test_with_files",
            files=files,
            named_tensors=in_memory,
            use_shared_memory_pool=False,
            use_inplace_pin_memory=True,
        )
        assert all(os.path.exists(f) for f in files), "registration must not remove the user's files"
        ps.gather_metas("test_with_files")
        ps.update("test_with_files", engine.req_func("check", 3), ranks=[])
        expect_ok(engine, "update from files")
        dist.barrier()
        ps.unregister_checkpoint("test_with_files")
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)


def scenario_owner(ps, dist, engine, rank, world, args) -> None:
    """Register, gather, save the metas (pickle, as MoonshotAI's example), wait for the test's release."""
    ps.register_checkpoint("join", named_tensors=make_tensors(4, rank))
    dist.barrier()
    ps.gather_metas("join")
    if rank == 0:
        tmp = args.metas_file + ".part"
        with open(tmp, "wb") as f:
            pickle.dump(ps.get_metas(), f)
        os.replace(tmp, args.metas_file)
    dist.barrier()  # the file is complete before anyone reports ready
    with socket.create_connection(("127.0.0.1", args.ctl_port), timeout=30) as s:
        s.settimeout(ENGINE_WAIT_S + 60)
        s.sendall(b"R")
        got = s.recv(1)  # the join job is done: the owners may go
    assert got == b"G", f"release not received (got {got!r})"
    ps.unregister_checkpoint("join")


def scenario_join(ps, dist, engine, rank, world, args) -> None:
    with open(args.metas_file, "rb") as f:
        metas = pickle.load(f)  # the user's own file, written by the owner job
    dist.barrier()
    ps.gather_metas("join")  # registered nowhere in this job: learns this job's ranks only
    ps.load_metas(metas)
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    mine = ps.get_metas("join")
    assert mine["pids"] == pids, ("this job's pids must be kept", mine["pids"], pids)
    assert [mine["owner_pids"][str(r)] for r in range(world)] == metas["pids"], mine["owner_pids"]
    assert mine["ranks"] == metas["ranks"] and mine["chunk_handles"] == metas["chunk_handles"]
    for n, ranks in enumerate(([0, 1], None)):
        metrics = ps.update("join", engine.req_func("check", 4), ranks=ranks)
        assert metrics is not None and metrics.mode == "local", metrics
        expect_ok(engine, f"join update {n}")
    dist.barrier()


SCENARIOS = {
    "ranks": scenario_ranks,
    "error": scenario_error,
    "files": scenario_files,
    "owner": scenario_owner,
    "join": scenario_join,
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--rank-lists", default="[[0], [1], [], [0, 1]]")
    p.add_argument("--tmp", default=None)
    p.add_argument("--shm-dir", default=None)
    p.add_argument("--metas-file", default=None)
    p.add_argument("--ctl-port", type=int, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)

    import checkpoint_engine.distributed as dist
    from checkpoint_engine.ps import ParameterServer

    dist.use_backend(None)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ps = ParameterServer(auto_pg=True)
    ps.init_process_group()
    dist.barrier()
    engine = EngineProc(rank, ps.device_id, world) if args.scenario != "owner" else None
    try:
        SCENARIOS[args.scenario](ps, dist, engine, rank, world, args)
    finally:
        code = engine.stop() if engine is not None else 0
        ps.close()
    assert code == 0, f"engine process exited {code}"
    print(f"COMPAT_OK {args.scenario} rank {rank} run {uuid.uuid4().hex[:6]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
