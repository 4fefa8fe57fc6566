"""Across hosts, against the link: a version from the trainer's memory into engines on two other hosts.

    sudo python benchmarks/bench_hosts.py [--rate-mbit 400] [--size-mib 512] [--runs 3]
        [--bucket-mib 16] [--modes relay,auto] [--work-dir DIR] [--delta K [--lr 1e-6]]

The multi-host testbed (testing/hosts.py): hosts "trainer", "inf0", "inf1", each its own network
namespace, host name and /dev/shm, every link shaped to the same rate R both ways (tbf). The trainer
host holds M bytes of float32 tensors in memory (testing/host_roles.py trainer: registered from
memory, no file); each inference host runs a plain engine and one parameter-server rank (gloo over
the links). Each run is one update of every engine from the trainer's memory, in each mode:

    relay   (the product's path across hosts) the first inference rank reads each bucket once from
            the trainer over Mooncake and broadcasts it to the other; the next bucket's read overlaps
            this one's broadcast; each rank keeps every H-th bucket for heals (keep_relayed, the
            default: a copy of M / H per rank, and the metas gathered after the update)
    auto    (what a pull did before: mode p2p) every inference rank reads every bucket from the
            trainer itself
    relay-unkept  (not in the default) the relay with keep_relayed off: what keeping costs, paired

Per run: e2e_s (every rank ready -> every engine holds the version, measured on rank 0 after a
barrier of all ranks), the bytes each host's interface sent and received (its counters), and each
engine's per-tensor checksums against the trainer's (a run whose engines differ fails the benchmark).

    ratio_e2e_vs_link_limit            e2e_s / (M / R): 1.0 is one copy at the link's rate
    ratio_trainer_link_bytes_vs_copy   bytes the trainer's link sent / M: 1.0 is every byte once

Both are medians over --runs of the relay mode (spread: min and max); the same figures of `auto`
beside them. The default R (400 Mbit/s, 50 MB/s) keeps the 2 cores far from busy (Mooncake's TCP
reads run at 0.36 GB/s here, gloo's broadcast at 2-3 GB/s: ENVIRONMENT.md), so the link is the
limit. The file handoff (a shared volume) has no honest stand-in here: the testbed has no network
filesystem, and a folder on this machine's disk would be shared by every "host" without crossing
any link. The last line is one JSON object.

    --delta K   the trainer holds K+1 bf16 versions (--engine-dtype fp8: float8 e4m3 in 128x128
                blocks, each with a float32 scale, as DeepSeek-V3 and Kimi-K2 are served) of float32
                masters N(0, 0.02), one AdamW step of --lr on random gradients between two (synthetic
                steps, not an RL run's), and registers the first in full, each later one as the delta
                from the one before, and a last delta that changes nothing. Each run: the full
                version, the K deltas, the empty one, in relay mode; every engine's digest checked
                after each. Reported (medians over the deltas of every run, min and max):
                    delta_ratio_link_bytes_vs_encoded  the busiest link's bytes (any host, sent or
                                                       received) / the delta's wire bytes
                    fixed_cost_s                       e2e of the delta that changes nothing: the
                                                       process group and plan, the engine's round
                                                       trip, and the CRC-32 of every tensor before
                                                       and after the apply (a pass over the model)
                    delta_ratio_e2e_vs_link_limit      (e2e - that run's fixed cost) / (wire bytes / R)
                The plain engines are TP 1, so `delta_worker_share_max` is null here: a TP 2 worker's
                share of a sharded delta is measured by tests/integration/vllm/test_vllm_tp2.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

UNKEPT = "relay-unkept"  # --modes: the relay with keep_relayed off (the ranks keep no share for heals)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate-mbit", type=float, default=400.0, help="every host's link, both directions")
    p.add_argument("--size-mib", type=int, default=512, help="M: the version's bytes (float32 tensors)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--bucket-mib", type=int, default=16)
    p.add_argument(
        "--modes", default="relay,auto", help=f"of relay, auto and {UNKEPT} (the relay with --no-keep-relayed)"
    )
    p.add_argument("--work-dir", default=None)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument(
        "--delta",
        type=int,
        default=0,
        metavar="K",
        help="K > 0: bf16 versions instead (M: one of them), each run a full update then K deltas and one "
        "that changes nothing, in relay mode (see the module docstring); --modes is then ignored",
    )
    p.add_argument("--lr", type=float, default=1e-6, help="--delta: the AdamW learning rate between versions")
    p.add_argument(
        "--delta-bucket-mib",
        type=int,
        default=0,
        help="--delta: the deltas' bucket size (0: the parameter server's choice, which across hosts cuts a "
        "small update into 8 buckets of at least 2 MiB: in --bucket-mib buckets a delta of a few tens of MiB "
        "is two buckets, and the relay's two links barely overlap)",
    )
    p.add_argument(
        "--engine-dtype", default="bf16", choices=["bf16", "fp8"], help="--delta: bf16, or fp8 in 128x128 blocks"
    )
    args = p.parse_args(argv)
    from testing.host_sync import HostSync
    from testing.hosts import Testbed

    why = Testbed.unavailable()
    if why:
        print(json.dumps({"error": f"no testbed: {why}"}))
        return 2
    modes = [m for m in args.modes.split(",") if m]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-hosts-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.delta:
        return _deltas(args, work)
    figures: dict[str, list[dict]] = {m: [] for m in modes}
    with Testbed(["trainer", "inf0", "inf1"], rate_mbit=args.rate_mbit) as bed:
        sync = HostSync(bed, size_mib=args.size_mib, work_dir=work, timeout_s=args.timeout_s)
        limit_s = sync.nbytes * 8 / (args.rate_mbit * 1e6)
        try:
            for run in range(args.runs):
                for mode in modes:  # paired: the modes alternate within each run
                    keep = mode != UNKEPT  # the relay without keep_relayed: what keeping a share costs
                    r = sync.update(mode if keep else "relay", bucket_mib=args.bucket_mib, keep_relayed=keep)
                    if not r.ok or not all(r.digests_match.values()):
                        print(json.dumps({"error": f"{mode} run {run} failed", "results": r.results}))
                        return 1
                    row = {
                        "mode": mode,
                        "run": run,
                        "e2e_s": r.e2e_s,
                        "ratio_e2e_vs_link_limit": round(r.e2e_s / limit_s, 3),
                        "trainer_tx_vs_copy": round(r.link_bytes["trainer"].tx_bytes / sync.nbytes, 4),
                        "inf0_tx_vs_copy": round(r.link_bytes["inf0"].tx_bytes / sync.nbytes, 4),
                        "inf1_rx_vs_copy": round(r.link_bytes["inf1"].rx_bytes / sync.nbytes, 4),
                        "ran_as": r.results[0].get("mode"),
                    }
                    figures[mode].append(row)
                    print(json.dumps(row), flush=True)
        finally:
            sync.close()

    def summary(rows: list[dict], key: str) -> dict:
        values = [row[key] for row in rows]
        return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}

    out = {
        "rate_mbit": args.rate_mbit,
        "size_bytes": sync.nbytes,
        "link_limit_s": round(limit_s, 3),
        "runs": args.runs,
        "bucket_mib": args.bucket_mib,
    }
    for mode, rows in figures.items():
        out[mode] = {k: summary(rows, k) for k in ("e2e_s", "ratio_e2e_vs_link_limit", "trainer_tx_vs_copy")}
    if "relay" in figures:
        out["ratio_e2e_vs_link_limit"] = out["relay"]["ratio_e2e_vs_link_limit"]["median"]
        out["ratio_trainer_link_bytes_vs_copy"] = out["relay"]["trainer_tx_vs_copy"]["median"]
    print(json.dumps(out))
    return 0


def _deltas(args, work: Path) -> int:
    """--delta K: per run, v0 in full, then its K deltas and the one that changes nothing, relay mode."""
    from testing.host_sync import HostSync
    from testing.hosts import Testbed

    rate_bytes_s = args.rate_mbit * 1e6 / 8
    rows: list[dict] = []
    with Testbed(["trainer", "inf0", "inf1"], rate_mbit=args.rate_mbit) as bed:
        sync = HostSync(
            bed,
            size_mib=args.size_mib,
            work_dir=work,
            timeout_s=args.timeout_s,
            delta_versions=args.delta,
            lr=args.lr,
            engine_dtype=args.engine_dtype,
        )
        try:
            for run in range(args.runs):
                for k in range(len(sync.deltas) + 1):  # 0: the full version the deltas start from
                    r = sync.update("relay", bucket_mib=args.delta_bucket_mib if k else args.bucket_mib, delta=k)
                    if not r.ok or not all(r.digests_match.values()):
                        print(json.dumps({"error": f"run {run} update {k} failed", "results": r.results}))
                        return 1
                    d = sync.deltas[k - 1] if k else None
                    sent = d["wire_bytes"] if d else sync.nbytes
                    links = {name: max(c.tx_bytes, c.rx_bytes) for name, c in r.link_bytes.items()}
                    row = {
                        "run": run,
                        "update": d["name"] if d else "full",
                        "zero": bool(d) and d["changed_share"] == 0.0,
                        "changed_share": d["changed_share"] if d else 1.0,
                        "wire_bytes": sent,
                        "e2e_s": r.e2e_s,
                        "busiest_link_bytes": max(links.values()),
                        "busiest_link": max(links, key=links.get),
                        "trainer_tx_bytes": r.link_bytes["trainer"].tx_bytes,
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            sync.close()

    def spread(values: list[float]) -> dict:
        return {k: round(f(values), 4) for k, f in (("median", statistics.median), ("min", min), ("max", max))}

    fixed = [row["e2e_s"] for row in rows if row["zero"]]
    fixed_of_run = {row["run"]: row["e2e_s"] for row in rows if row["zero"]}  # each delta's own run's
    deltas = [row for row in rows if row["update"] != "full" and not row["zero"]]
    full = [row for row in rows if row["update"] == "full"]
    out = {
        "rate_mbit": args.rate_mbit,
        "full_bytes": sync.nbytes,
        "lr": args.lr,
        "engine_dtype": args.engine_dtype,
        "runs": args.runs,
        "deltas_per_run": args.delta,
        "bucket_mib": args.bucket_mib,
        "delta_bucket_mib": args.delta_bucket_mib,
        "changed_share": spread([row["changed_share"] for row in deltas]),
        "delta_wire_vs_full": spread([row["wire_bytes"] / sync.nbytes for row in deltas]),
        "delta_e2e_s": spread([row["e2e_s"] for row in deltas]),
        "full_e2e_s": spread([row["e2e_s"] for row in full]),
        "fixed_cost_s": spread(fixed),
        # the busiest link over the bytes one inference host needs: 1.0 is every changed byte once
        "delta_ratio_link_bytes_vs_encoded": spread([row["busiest_link_bytes"] / row["wire_bytes"] for row in deltas]),
        # (e2e - the fixed cost measured in the same run) over the encoded bytes at the link's rate
        "delta_ratio_e2e_vs_link_limit": spread(
            [(row["e2e_s"] - fixed_of_run[row["run"]]) / (row["wire_bytes"] / rate_bytes_s) for row in deltas]
        ),
        "delta_worker_share_max": None,  # plain engines are TP 1 here (see the module docstring)
    }
    for key in ("delta_ratio_link_bytes_vs_encoded", "delta_ratio_e2e_vs_link_limit"):
        out[key] = out[key] | {"value": out[key]["median"]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
