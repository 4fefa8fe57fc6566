"""The shared helpers of checkpoint_engine: HF model-dir I/O, the dtype table, field checks, the JSON client."""

import socket

import pytest
import torch

from ckpt_common import dtypes, hf_dir, httpjson
from ckpt_common.validate import check_int, check_number
from testing.http_stub import serve_stub


def test_hf_dir_round_trip_sharded_and_named(tmp_path):
    state = {f"w{i}": torch.full((64,), float(i), dtype=torch.bfloat16 if i % 2 else torch.float32) for i in range(5)}
    files = hf_dir.write_safetensors(tmp_path, state, max_shard_size_bytes=300)
    assert len(files) > 1 and hf_dir.safetensors_files(tmp_path) == files
    assert all(torch.equal(hf_dir.read_tensors(tmp_path)[k], v) for k, v in state.items())
    assert set(hf_dir.read_tensors(tmp_path, ["w1", "w4"])) == {"w1", "w4"}
    assert hf_dir.tensor_dtypes(tmp_path) == {k: v.dtype for k, v in state.items()}
    with pytest.raises(ValueError, match=r"lacks tensors \['nope'\]"):
        hf_dir.read_tensors(tmp_path, ["w0", "nope"])


def test_hf_dir_without_weights(tmp_path):
    with pytest.raises(ValueError, match="holds no .safetensors file"):
        hf_dir.safetensors_files(tmp_path)


def test_dtype_lookups_name_the_dtype_and_the_known_ones():
    assert dtypes.torch_dtype_from_safetensors("BF16") is torch.bfloat16
    with pytest.raises(ValueError, match=r"'C64'; supported: \[.*'F32'"):
        dtypes.torch_dtype_from_safetensors("C64")
    with pytest.raises(ValueError, match=r"'complex64'; supported: \[.*'float32'"):
        dtypes.dtype_from_name("complex64")


@pytest.mark.parametrize("value", [0, -1, 1.0, True, None, "3"])
def test_check_int_rejects(value):
    with pytest.raises(ValueError, match=r"^x\.n=.* must be an int >= 1$"):
        check_int("x.n", value)


def test_checks_accept():
    check_int("n", 0, 0)
    check_number("t", 0.5)
    check_number("t", 0, allow_zero=True)
    with pytest.raises(ValueError, match=r"t=inf must be a number > 0"):
        check_number("t", float("inf"))


class _Server(httpjson.JsonRequestHandler):
    def do_GET(self):
        if self.path == "/ok?x=1":
            self.reply(200, {"ok": True})
        elif self.path == "/text":
            body = b"not json"
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.reply(404, {"detail": "no route"})

    def do_POST(self):
        self.reply(200, {"echo": self.read_json()})


@pytest.fixture
def base_url():
    with serve_stub(_Server) as url:
        yield url


def test_json_client(base_url):
    assert httpjson.call_json("GET", base_url + "/ok?x=1", timeout_s=5) == {"ok": True}
    assert httpjson.post_json(base_url + "/p", {"a": [1]}, timeout_s=5) == {"echo": {"a": [1]}}
    with pytest.raises(httpjson.HTTPError, match="HTTP 404") as e:
        httpjson.call_json("GET", base_url + "/missing", timeout_s=5)
    assert e.value.status == 404 and isinstance(e.value, RuntimeError)
    assert httpjson.status_json("GET", base_url + "/missing", timeout_s=5) == (404, {"detail": "no route"})
    assert httpjson.status_json("GET", base_url + "/text", timeout_s=5) == (503, {"raw": "not json"})


def test_json_client_unreachable():
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/x"
    with pytest.raises(OSError):
        httpjson.status_json("GET", url, timeout_s=5)
    with pytest.raises(RuntimeError, match=f"GET {url} failed"):
        httpjson.call_json("GET", url, timeout_s=5)
