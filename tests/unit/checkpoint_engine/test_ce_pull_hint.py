"""What a daemon leaves beside an engine's load-step socket about the pull to come (`load_rendezvous.PullHint`)."""

import json
import logging

import pytest

from checkpoint_engine.transport.load_rendezvous import HINT_FILE, PullHint, hint_path, read_pull_hint, write_pull_hint

HINT = PullHint(
    peers=(("10.0.0.1:15001", 4096),),
    tensors=(("model.embed_tokens.weight", "float32", (64, 16)), ("lm_head.bias", "bfloat16", (64,))),
)


def test_the_hint_round_trips_beside_the_socket_and_an_empty_one_removes_it(tmp_path):
    address = f"ipc://{tmp_path}/load.sock"
    assert hint_path(address) == str(tmp_path / HINT_FILE)
    assert read_pull_hint(address) == PullHint() and not PullHint()  # none left
    write_pull_hint(address, HINT)
    assert read_pull_hint(address) == HINT
    peers_only = PullHint(peers=HINT.peers)
    write_pull_hint(address, peers_only)
    assert read_pull_hint(address) == peers_only and peers_only
    write_pull_hint(address, PullHint())
    assert not (tmp_path / HINT_FILE).exists() and read_pull_hint(address) == PullHint()


def test_a_tcp_rendezvous_has_no_hint_file(tmp_path):
    assert hint_path("tcp://127.0.0.1:5000") is None
    write_pull_hint("tcp://127.0.0.1:5000", HINT)  # nowhere to put it: nothing
    assert read_pull_hint("tcp://127.0.0.1:5000") == PullHint()


@pytest.mark.parametrize(
    "bad,names",
    [
        ("not json", "Expecting value"),
        (json.dumps([["10.0.0.1:1", 4096]]), "expected {'peers'"),
        (json.dumps({"peers": [], "extra": 1}), "expected {'peers'"),
        (json.dumps({"peers": [["10.0.0.1:1", "4096"]]}), "peers: expected"),
        (json.dumps({"peers": [["x", True]]}), "peers: expected"),
        (json.dumps({"tensors": [["w", "float32"]]}), "tensors: expected"),
        (json.dumps({"tensors": [["w", "float32", [2, -1]]]}), "tensors: expected"),
        (json.dumps({"tensors": [["w", "float32", [2]], ["w", "float32", [2]]]}), "a name is listed twice"),
    ],
)
def test_a_malformed_hint_is_ignored_with_a_warning_naming_the_problem(tmp_path, caplog, bad, names):
    address = f"ipc://{tmp_path}/load.sock"
    (tmp_path / HINT_FILE).write_text(bad)
    with caplog.at_level(logging.WARNING, logger="checkpoint_engine.transport.load_rendezvous"):
        assert read_pull_hint(address) == PullHint()
    assert "ignoring the load step's pull hint" in caplog.text and names in caplog.text, caplog.text
