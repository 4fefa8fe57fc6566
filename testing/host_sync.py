"""One trainer host and N inference hosts in the testbed, a weight version moved from the trainer's
memory into a plain engine on every inference host: what `benchmarks/bench_hosts.py` measures and
the across-hosts tests check.

    HostSync(bed, size_mib=512)                 trainer role on host "trainer" (its tensors in memory,
      │                                         Mooncake at its address), a plain engine on each
      │                                         inference host ("inf0", "inf1", ...)
      ├─ update(mode)  -> SyncRun               one update: a PS rank per inference host (gloo over the
      │                                         bridge), the metas loaded, every engine updated from the
      │                                         trainer; e2e seconds, each host's link bytes (interface
      │                                         counters), each engine's digest against the trainer's
      └─ close()                                every process ended (the testbed removes the hosts)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from testing.hosts import LinkCounters, Testbed, wait_port

ENGINE_PORT = 8100
DIGEST = (
    "import json, sys, urllib.request as u; "
    "r = u.Request(sys.argv[1] + '/collective_rpc', data=json.dumps({'method': sys.argv[2], 'args': []}).encode(), "
    "headers={'Content-Type': 'application/json'}); print(u.urlopen(r, timeout=60).read().decode())"
)


@dataclass
class SyncRun:
    mode: str
    e2e_s: float | None
    link_bytes: dict[str, LinkCounters]
    results: list[dict]  # each rank's JSON line (or {"rank", "rc", "log"} when it printed none)
    digests_match: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.get("error") is None and r.get("rc", 0) == 0 for r in self.results)


class HostSync:
    def __init__(
        self,
        bed: Testbed,
        *,
        size_mib: int,
        work_dir: Path,
        timeout_s: float = 120.0,
        tensors: int = 32,
        delta_versions: int = 0,
        lr: float = 1e-6,
        engine_dtype: str = "bf16",
    ):
        """`delta_versions` K > 0: the trainer holds bf16 versions, the first in full, then K deltas
        (`self.deltas`: each one's name, metas path, wire bytes, changed share and digest)."""
        self.bed = bed
        self.inference = [h for name, h in bed.hosts.items() if name != "trainer"]
        self.trainer = bed["trainer"]
        self.work_dir = Path(work_dir)
        self.timeout_s = timeout_s
        self.metas = self.work_dir / "metas.json"  # the tensors' names and addresses (KB), not their bytes
        self._seq = 0
        log = open(self.work_dir / "trainer.log", "w")
        cmd = [sys.executable, "-m", "testing.host_roles", "trainer", "--host-ip", self.trainer.ip]
        cmd += ["--size-mib", str(size_mib), "--tensors", str(tensors), "--metas-out", str(self.metas)]
        cmd += ["--timeout-s", str(timeout_s)]
        if delta_versions:
            cmd += ["--delta-versions", str(delta_versions), "--lr", str(lr), "--engine-dtype", engine_dtype]
        self._trainer_proc = self.trainer.popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=_env())
        line = self._trainer_proc.stdout.readline()  # the role prints one line when its tensors are registered
        if not line:
            raise RuntimeError(f"the trainer role exited: {(self.work_dir / 'trainer.log').read_text()[-3000:]}")
        ready = json.loads(line)
        self.nbytes, self.digest = ready["bytes"], {k: int(v) for k, v in ready["digest"].items()}
        self.deltas: list[dict] = ready.get("deltas", [])
        for h in self.inference:
            elog = open(self.work_dir / f"engine-{h.name}.log", "w")
            cmd = [sys.executable, "-m", "checkpoint_engine.engines.plain", "--port", str(ENGINE_PORT)]
            h.popen(cmd + ["--timeout-s", str(timeout_s)], stdout=elog, stderr=subprocess.STDOUT, env=_env())
        for h in self.inference:
            wait_port(h, ENGINE_PORT, timeout_s=60)

    def counters(self) -> dict[str, LinkCounters]:
        return {name: h.counters() for name, h in self.bed.hosts.items()}

    def update(
        self, mode: str = "relay", *, bucket_mib: int = 32, during=None, delta: int = 0, keep_relayed: bool = True
    ) -> SyncRun:
        """One update into every inference host's engine; `during(procs)` runs while it is under way
        (a fault test partitions a host there). `delta` k > 0: the k-th delta version (the engines must
        hold the one before), its digest the one checked. `keep_relayed`: UpdateConfig's (relay mode)."""
        metas, digest = self.metas, self.digest
        if delta:
            d = self.deltas[delta - 1]
            metas, digest = d["metas"], {k: int(v) for k, v in d["digest"].items()}
        self._seq += 1
        master = self.inference[0]
        port = 29000 + self._seq % 500
        before = self.counters()
        procs = []
        for rank, h in enumerate(self.inference):
            cmd = [sys.executable, "-m", "testing.host_roles", "inference", "--rank", str(rank)]
            cmd += ["--world-size", str(len(self.inference)), "--master-addr", master.ip, "--master-port", str(port)]
            cmd += ["--host-ip", h.ip, "--engine-url", f"http://127.0.0.1:{ENGINE_PORT}", "--metas", str(metas)]
            cmd += ["--mode", mode, "--bucket-mib", str(bucket_mib), "--timeout-s", str(self.timeout_s)]
            cmd += [] if keep_relayed else ["--no-keep-relayed"]
            log = open(self.work_dir / f"rank{rank}-{self._seq}.log", "w")
            procs.append(h.popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=_env()))
        if during is not None:
            during(procs)
        results = []
        for rank, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=self.timeout_s + 60)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            lines = [x for x in (out or "").splitlines() if x.startswith("{")]
            log = (self.work_dir / f"rank{rank}-{self._seq}.log").read_text()[-3000:]
            results.append(
                json.loads(lines[-1]) | {"rc": p.returncode}
                if lines
                else {"rank": rank, "rc": p.returncode, "log": log}
            )
        after = self.counters()
        run = SyncRun(mode, results[0].get("e2e_s"), {k: after[k] - before[k] for k in after}, results)
        for h in self.inference:
            run.digests_match[h.name] = self.engine_digest(h) == digest
        return run

    def engine_digest(self, host) -> dict[str, int]:
        out = host.run([sys.executable, "-c", DIGEST, f"http://127.0.0.1:{ENGINE_PORT}", "weights_digest"], 90)
        if out.returncode != 0:
            return {}
        return {k: int(v) for k, v in json.loads(out.stdout)["results"][0].items()}

    def engine_state(self, host) -> dict:
        out = host.run([sys.executable, "-c", DIGEST, f"http://127.0.0.1:{ENGINE_PORT}", "weights_state"], 90)
        return json.loads(out.stdout)["results"][0] if out.returncode == 0 else {"error": out.stderr[-500:]}

    def close(self) -> None:
        for h in self.bed.hosts.values():
            h.kill_processes()


def _env() -> dict:
    import os

    from testing.vllm_servers import child_env

    env = child_env()
    env["GLOO_SOCKET_IFNAME"] = "eth0"  # the host's link, not its loopback
    env.setdefault("GLOG_minloglevel", "2")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    return env | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def wait_until(check, timeout_s: float, what: str, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:g} s")
        time.sleep(poll_s)
