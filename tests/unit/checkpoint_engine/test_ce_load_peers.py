"""The owners' addresses a daemon leaves beside an engine's load-step socket (`load_rendezvous`)."""

import json
import logging

from checkpoint_engine.load_rendezvous import PEERS_FILE, peers_hint_path, read_peers_hint, write_peers_hint


def test_peers_round_trip_beside_the_socket_and_an_empty_list_removes_them(tmp_path):
    address = f"ipc://{tmp_path}/load.sock"
    assert peers_hint_path(address) == str(tmp_path / PEERS_FILE)
    assert read_peers_hint(address) == []  # none left
    write_peers_hint(address, [("10.0.0.1:15001", 4096)])
    assert read_peers_hint(address) == [("10.0.0.1:15001", 4096)]
    write_peers_hint(address, [])
    assert not (tmp_path / PEERS_FILE).exists() and read_peers_hint(address) == []


def test_a_tcp_rendezvous_has_no_peers_file(tmp_path):
    assert peers_hint_path("tcp://127.0.0.1:5000") is None
    write_peers_hint("tcp://127.0.0.1:5000", [("10.0.0.1:15001", 4096)])  # nowhere to put them: nothing
    assert read_peers_hint("tcp://127.0.0.1:5000") == []


def test_a_malformed_peers_file_is_ignored_with_a_warning(tmp_path, caplog):
    address = f"ipc://{tmp_path}/load.sock"
    for bad in ("not json", json.dumps({"a": 1}), json.dumps([["10.0.0.1:1", "4096"]]), json.dumps([["x", True]])):
        (tmp_path / PEERS_FILE).write_text(bad)
        with caplog.at_level(logging.WARNING, logger="checkpoint_engine.load_rendezvous"):
            caplog.clear()
            assert read_peers_hint(address) == []
        assert "ignoring the load step's peers file" in caplog.text, bad
