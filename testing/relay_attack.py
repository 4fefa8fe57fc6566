"""A host without the token attacking the daemon through torchrun's store (tests).

    python -m testing.relay_attack STORE_IP STORE_PORT

The daemon's ranks share torchrun's TCPStore, which anyone reaching its port can read and write
(and list: `TCPStore.list_keys`). The daemon's keys sit under the prefixes of torchrun's and
torch.distributed's `PrefixStore`s and the daemon's own: with torch 2.13 under torchrun's static
rendezvous, `default_pg/0//ckpt-daemon//cmd/<n>` (`init_process_group`'s "default_pg", the default
group's name "0/", the relay's "ckpt-daemon/") and `default_pg/0//ckpt-engines//engines/<rank>` (the
engine board's). The attacker finds those prefixes in the store's key list rather than rebuilding the
wrappers, so a torch that nests them otherwise is still attacked where the ranks read.

From its start until a line arrives on stdin it lists the store's keys and copies every command value
it sees (the genuine, signed commands rank 0 posts) and every distinct record of rank 1's engine (the
genuine, signed records rank 1 writes at each state change). Then it writes each forgery in turn, with
the relay's and the board's real value shapes:
- at the command number `n` rank 1 waits on (one past the last command seen): three commands
  unsigned, the same three signed with a key from a wrong token, the last genuine command copied from
  its earlier number (a replay);
- at rank 1's engine record: a "failed" record unsigned (its url the attacker's), one signed with a
  wrong token's key, and the oldest genuine record of rank 1 seen (written back);
- rank 1's result of command `n` (wrong token) and rank 1's exit (`gone/1`, unsigned): rank 0 reads
  them only when it gathers command `n` (the shutdown's exit), so nothing is waited for after them.
After each forgery it prints one JSON line {"placed": what, "key": name, "op": op or null, "wait":
bool}; with "wait" it reads a line from stdin before the next one (the test has seen the daemon refuse
it, in the reading rank's log). It never deletes what it wrote: the ranks' own writes replace the
forgeries (a rank that deleted a refused value could delete the genuine one landing at that moment).
Last, one JSON line: {"prefix", "next": n, "seen": [numbers], "records_seen": count, "forgeries": [...]}.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from datetime import timedelta

from checkpoint_engine.daemon.relay import relay_key, seal

CMD_KEY = re.compile(r"^(.*ckpt-daemon/+)cmd/(\d+)$")  # the relay's command keys, in the raw store
RECORD_KEY = re.compile(r"^(.*ckpt-engines/+)engines/(\d+)$")  # the engine board's records
VICTIM = 1  # the rank whose record, result and exit are forged
POLL_S = 0.01


def store_client(ip: str, port: int):
    """A plain client of the daemon's store (no token, no rank: any host that reaches the port)."""
    import torch.distributed as dist

    # connecting waits (up to a minute) for a store that torchrun is still starting
    store = dist.TCPStore(ip, port, is_master=False, timeout=timedelta(seconds=60))
    # then a short timeout: a get racing the relay's delete of that key fails fast instead of waiting
    store.set_timeout(timedelta(seconds=2))
    return store


class Watch:
    """What the attacker learns from the key list until it attacks."""

    def __init__(self):
        self.prefix: str | None = None  # the relay's raw key prefix
        self.record_prefix: str | None = None  # the engine board's
        self.commands: dict[int, bytes] = {}  # command number -> its genuine value
        self.records: list[bytes] = []  # rank VICTIM's distinct records, oldest first

    def run(self, store, stop: threading.Event) -> None:
        while not stop.is_set():
            for raw in store.list_keys():
                try:
                    if (m := CMD_KEY.match(raw)) is not None and int(m[2]) not in self.commands:
                        self.commands[int(m[2])] = store.get(raw)
                        self.prefix = m[1]
                    elif (m := RECORD_KEY.match(raw)) is not None and int(m[2]) == VICTIM:
                        value = store.get(raw)
                        self.record_prefix = m[1]
                        if not self.records or self.records[-1] != value:
                            self.records.append(value)
                except RuntimeError:  # deleted between the listing and the get (answered): missed
                    pass
            time.sleep(POLL_S)


def forgeries(n: int, watch: Watch) -> list[tuple[str, str, str | None, str, bool]]:
    """(what, key name, op, value, wait) of each forgery, in the order written (module docstring)."""
    wrong = relay_key("wrong")  # a key derived from a token that is not the daemon's
    key = f"cmd/{n}"
    commands = [
        {"op": "exit", "phase": "run"},  # POST /shutdown's relayed command
        {"op": "engine_stop", "ranks": None, "phase": "run"},  # POST /engines/stop's run phase
        {"op": "update", "name": "v1", "phase": "run"},  # POST /update's run phase
    ]
    out = [("unsigned", key, c["op"], json.dumps(c), True) for c in commands]
    out += [("wrong token", key, c["op"], seal(wrong, key, c), True) for c in commands]
    # a genuine command, signed with the daemon's key, copied from its own (earlier) number
    last = max(watch.commands)
    op = json.loads(json.loads(watch.commands[last])["body"]).get("op")
    out.append((f"replay of cmd/{last}", key, op, watch.commands[last].decode(), True))
    # rank VICTIM's engine record: what would make the healer restart it, or GET /engines point elsewhere
    rec = f"engines/{VICTIM}"
    failed = {
        "rank": VICTIM,
        "ranks": [VICTIM],
        "state": "failed",
        "checkpoint": None,
        "url": "http://attacker.invalid:1",
        "healthy": False,
        "exit_code": 1,
        "last_error": "forged",
        "last_failure": None,
    }
    out.append(("unsigned record", rec, None, json.dumps(failed), True))
    out.append(("wrong token record", rec, None, seal(wrong, rec, {"n": 10**9, "record": failed}), True))
    if len(watch.records) > 1:  # an older genuine record than the one in the store now
        out.append(("older genuine record", rec, None, watch.records[0].decode(), True))
    # rank VICTIM's result of command n and its exit: read by rank 0 when it gathers command n
    res = f"res/{n}/{VICTIM}"
    out.append(("wrong token result", res, None, seal(wrong, res, {"ok": False, "error": "forged"}), False))
    out.append(("unsigned exit", f"gone/{VICTIM}", None, "1", False))
    return out


def main(argv: list[str]) -> int:
    ip, port = argv[0], int(argv[1])
    store = store_client(ip, port)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    print(json.dumps({"watching": True}), flush=True)
    watch = Watch()
    watch.run(store, stop)
    if not watch.commands or watch.record_prefix is None:
        print(json.dumps({"error": "no command or no engine record seen"}), flush=True)
        return 1
    n = max(watch.commands) + 1
    report = []
    for what, name, op, value, wait in forgeries(n, watch):
        prefix = watch.record_prefix if name.startswith("engines/") else watch.prefix
        store.set(prefix + name, value)  # the raw key of the daemon's `name`: the seals name `name`
        report.append({"placed": what, "key": name, "op": op, "wait": wait})
        print(json.dumps(report[-1]), flush=True)
        if wait:
            sys.stdin.readline()  # the test saw the reading rank refuse it
    summary = {"prefix": watch.prefix, "next": n, "seen": sorted(watch.commands), "records_seen": len(watch.records)}
    print(json.dumps({**summary, "forgeries": report}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
