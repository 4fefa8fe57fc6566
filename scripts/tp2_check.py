"""A tensor-parallel 2 vLLM server on CPU, updated by a sharded pull, against TP 2 loaded from disk.

    python scripts/tp2_check.py [--p2p-reader engine|rank|none] [--work-dir DIR]

1. writes two demo models (A: the server's start, B: the update) in the work directory;
2. runs vLLM TP 2 on B from disk in a subprocess: the reference greedy tokens;
3. starts the launcher on A with `--tensor-parallel-size 2`, gate only (no initial push);
4. pushes B with two parameter-server ranks (`vllm_ext.push --world-size 2`), one per worker; with
   `--p2p-reader engine` (the default) each worker reads the other rank's half over Mooncake itself,
   only the slices its loaders take;
5. compares the server's greedy tokens with the reference, prints each worker's read bytes
   (`weights_state`'s last update: engine_reads), ends the server.

Needs the 2 CPUs (`VLLM_CPU_OMP_THREADS_BIND="0|1"`, set here). Takes ~2 minutes. The last line is
one JSON object; exit code 0 when the tokens are equal and every push succeeded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["12+7=", "3*4=", "hello"]
MAX_TOKENS = 12
ENGINE_ARGS = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--dtype", "bfloat16"]
ENGINE_ARGS += ["--enforce-eager", "--max-model-len", "128", "--seed", "0"]

REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="mp", dtype="bfloat16",
          enforce_eager=True, max_model_len=128, seed=0)
out = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=int(sys.argv[3])))
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in out]), flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--p2p-reader", choices=["engine", "rank", "none"], default="engine")
    p.add_argument(
        "--max-ranges",
        type=int,
        default=None,
        help="the launcher's --sharded-max-ranges-per-tensor (default: its own, 64; 0: every slice row by row)",
    )
    p.add_argument("--work-dir", default=None, help="where the models and logs go (default: a new temporary one)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="bound on each step")
    args = p.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from ckpt_common.ports import free_port
    from demo.tiny_model import make_tiny_model
    from testing.vllm_servers import child_env, completion_token_ids
    from vllm_ext.extension_req import collective_rpc

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tp2-check-"))
    env = child_env(VLLM_CPU_OMP_THREADS_BIND="0|1")
    model_a, model_b = make_tiny_model(work / "A", seed=1), make_tiny_model(work / "B", seed=2)

    t0 = time.perf_counter()
    ref = subprocess.run(
        [sys.executable, "-c", REFERENCE, str(model_b), json.dumps(PROMPTS), str(MAX_TOKENS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.timeout_s,
    )
    lines = [line for line in ref.stdout.splitlines() if line.startswith("TOKENS ")]
    if ref.returncode != 0 or not lines:
        print(ref.stdout[-2000:], ref.stderr[-3000:], file=sys.stderr)
        return 1
    reference = json.loads(lines[-1][len("TOKENS ") :])
    reference_s = time.perf_counter() - t0

    launcher_extra = [] if args.max_ranges is None else ["--sharded-max-ranges-per-tensor", str(args.max_ranges)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launch_log = open(work / "launcher.log", "w")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_ext.launch",
            "--model",
            str(model_a),
            "--port",
            str(port),
            "--no-initial-push",
            "--gate-wait-s",
            "0",
            *launcher_extra,
            "--",
            *ENGINE_ARGS,
        ],
        cwd=REPO,
        env=env,
        stdout=launch_log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + args.timeout_s
        while True:  # the gate answers; vLLM is healthy once it waits for weights
            try:
                import urllib.request

                with urllib.request.urlopen(f"{url}/launcher/status", timeout=5) as r:
                    if json.load(r).get("phase") == "waiting_for_weights":
                        break
            except OSError:
                pass
            if launcher.poll() is not None or time.monotonic() > deadline:
                print((work / "launcher.log").read_text()[-3000:], file=sys.stderr)
                return 1
            time.sleep(1.0)  # polling the gate, bounded by the deadline
        master = free_port()
        pushes = []
        for rank in range(2):
            cmd = [
                sys.executable,
                "-m",
                "vllm_ext.push",
                "--model",
                str(model_b),
                "--rank",
                str(rank),
                "--world-size",
                "2",
                "--master-port",
                str(master),
                "--engine-url",
                url,
                "--transport",
                "cpu",
                "--timeout-s",
                "120",
            ]
            if args.p2p_reader != "none":
                cmd += ["--p2p-reader", args.p2p_reader]
            log = open(work / f"push{rank}.log", "w")
            pushes.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [proc.wait(timeout=args.timeout_s) for proc in pushes]
        metrics = [json.loads((work / f"push{r}.log").read_text().strip().splitlines()[-1]) for r in range(2)]
        got = completion_token_ids(url, str(model_a), PROMPTS, MAX_TOKENS)
        states = collective_rpc(url, "weights_state", timeout_s=60.0)
        reads = [(s.get("last_update") or {}).get("engine_reads") for s in states]
    finally:
        launcher.terminate()
        launcher.wait(timeout=60)
        launch_log.close()

    for rank, r in enumerate(reads):
        if r:
            pulled = r["scratch_bytes"] + r["sliced_out_bytes"]
            print(
                f"worker {rank}: read {r['scratch_bytes']} of the {pulled} bytes it pulled ({r['sliced_tensors']} "
                f"tensors in part)"
            )
    equal = got == reference
    print(f"greedy tokens equal to TP 2 from disk: {equal}")
    result = {
        "p2p_reader": args.p2p_reader,
        "modes": [m.get("mode") for m in metrics],
        "push_exit_codes": codes,
        "tokens_equal": equal,
        "engine_reads": reads,
        "reference_s": round(reference_s, 1),
        "work_dir": str(work),
    }
    print(json.dumps(result))
    return 0 if equal and codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
