"""A host without the token attacking the daemon's command relay through torchrun's store (tests).

    python -m testing.relay_attack STORE_IP STORE_PORT

The daemon's ranks share torchrun's TCPStore, which anyone reaching its port can read and write
(and list: `TCPStore.list_keys`). The relay's keys sit under the prefixes of torchrun's and
torch.distributed's `PrefixStore`s and the relay's own: with torch 2.13 under torchrun's static
rendezvous, `default_pg/0//ckpt-daemon//cmd/<n>` (`init_process_group`'s "default_pg", the default
group's name "0/", the relay's "ckpt-daemon/"). The attacker finds that prefix in the store's key list
rather than rebuilding the wrappers, so a torch that nests them otherwise is still attacked where the
ranks read.

From its start until a line arrives on stdin it lists the store's keys and copies every command value
it sees (the genuine, signed commands rank 0 posts). Then it writes each forgery in turn at the next
command number `n` (one past the last command seen): the other ranks wait on exactly that key, so
each forgery is read there; it waits until a rank took the key away again (the relay deletes a value
it refused) and prints one JSON line:
{"prefix": raw prefix, "next": n, "seen": [numbers], "forgeries": [{"what", "op", "consumed_s"} ...]}
("consumed_s": null when no rank took it within the deadline).
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
POLL_S = 0.01
CONSUME_TIMEOUT_S = 10.0


def store_client(ip: str, port: int):
    """A plain client of the daemon's store (no token, no rank: any host that reaches the port)."""
    import torch.distributed as dist

    # connecting waits (up to a minute) for a store that torchrun is still starting
    store = dist.TCPStore(ip, port, is_master=False, timeout=timedelta(seconds=60))
    # then a short timeout: a get racing the relay's delete of that key fails fast instead of waiting
    store.set_timeout(timedelta(seconds=2))
    return store


def watch(store, stop: threading.Event) -> tuple[str | None, dict[int, bytes]]:
    """The raw prefix of the relay's command keys and every command value seen, by number, until `stop`."""
    prefix, seen = None, {}
    while not stop.is_set():
        for raw in store.list_keys():
            m = CMD_KEY.match(raw)
            if m is None or int(m[2]) in seen:
                continue
            try:
                seen[int(m[2])] = store.get(raw)
                prefix = m[1]
            except RuntimeError:  # deleted between the listing and the get (answered): missed
                pass
        time.sleep(POLL_S)
    return prefix, seen


def forgeries(n: int, seen: dict[int, bytes]) -> list[tuple[str, str, str]]:
    """(what, op, value) of each forged command for number `n`, with the relay's real command shapes."""
    key = f"cmd/{n}"
    wrong = relay_key("wrong")  # a key derived from a token that is not the daemon's
    commands = [
        {"op": "exit", "phase": "run"},  # POST /shutdown's relayed command
        {"op": "engine_stop", "ranks": None, "phase": "run"},  # POST /engines/stop's run phase
        {"op": "update", "name": "v1", "phase": "run"},  # POST /update's run phase
    ]
    out = [("unsigned", c["op"], json.dumps(c)) for c in commands]
    out += [("wrong token", c["op"], seal(wrong, key, c)) for c in commands]
    # a genuine command, signed with the daemon's key, copied from its own (earlier) number
    last = max(seen)
    op = json.loads(json.loads(seen[last])["body"]).get("op")
    out.append((f"replay of cmd/{last}", op, seen[last].decode()))
    return out


def main(argv: list[str]) -> int:
    ip, port = argv[0], int(argv[1])
    store = store_client(ip, port)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    print(json.dumps({"watching": True}), flush=True)
    prefix, seen = watch(store, stop)
    if not seen:
        print(json.dumps({"error": "no command seen"}), flush=True)
        return 1
    n = max(seen) + 1
    key = f"{prefix}cmd/{n}"  # the raw key of the relay's `cmd/<n>`: HMACs name `cmd/<n>`
    report = []
    for what, op, value in forgeries(n, seen):
        store.set(key, value)
        t0 = time.monotonic()
        consumed = None
        while time.monotonic() - t0 < CONSUME_TIMEOUT_S:
            if not store.check([key]):  # the rank waiting on `key` read it and dropped it
                consumed = round(time.monotonic() - t0, 3)
                break
            time.sleep(POLL_S)
        report.append({"what": what, "op": op, "consumed_s": consumed})
        if consumed is None:
            store.delete_key(key)  # never leave a value where rank 0's next command goes
            break
    print(json.dumps({"prefix": prefix, "next": n, "seen": sorted(seen), "forgeries": report}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
