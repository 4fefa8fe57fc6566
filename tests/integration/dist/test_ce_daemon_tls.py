"""The daemon's HTTP API over TLS (--tls-cert-file/--tls-key-file) with a bearer token: the token only
ever crosses the network encrypted, and nothing but the health checks answers without it.

A self-signed certificate for 127.0.0.1 (made with openssl here) is its own CA: a client that trusts it
(`ca_file`) talks to the daemon; one that does not is refused by its own TLS check; a plain-HTTP
request to the port gets no answer from the API; every route but /health answers 401 without the
token, a shutdown with it ends the daemon with exit code 0.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ckpt_common.httpjson import status_json
from testing.daemon import start_daemon

TOKEN = "tls-test-token-0123456789"


@pytest.fixture
def cert(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, crt = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt)]
        + ["-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return crt, key


def test_the_api_serves_https_and_refuses_without_the_token(tmp_path, cert):
    crt, key = cert
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    daemon = start_daemon(
        *("--tls-cert-file", str(crt), "--tls-key-file", str(key), "--token-file", str(token_file)),
        log=tmp_path / "daemon.log",
        nproc=1,
        token=TOKEN,
        ca_file=str(crt),
    )
    try:
        assert daemon.url.startswith("https://127.0.0.1:")
        assert daemon.call("GET", "/health")[0] == 200
        plain = daemon.url.replace("https://", "http://")
        try:
            code, _ = status_json("GET", plain + "/health", timeout_s=5)
        except OSError:
            code = None
        assert code in (None, 400), code  # no plain-HTTP answer from the API itself
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            status_json("GET", daemon.url + "/health", timeout_s=5)  # a client that does not trust the CA
        for method, path, body in [
            ("GET", "/checkpoints", None),
            ("POST", "/checkpoints", {"name": "x", "files": []}),
            ("POST", "/update", {"name": "x"}),
            ("POST", "/engines/start", {"name": "x"}),
            ("POST", "/shutdown", None),
        ]:
            code, answer = status_json(method, daemon.url + path, body, timeout_s=10, ca_file=str(crt))
            assert code == 401, (method, path, code, answer)
            code, _ = status_json(method, daemon.url + path, body, timeout_s=10, ca_file=str(crt), token="wrong")
            assert code == 401, (method, path, code)
        assert daemon.call("GET", "/checkpoints")[0] == 200  # with the token
        assert daemon.shutdown(60) == 0, daemon.log_tail()
    finally:
        daemon.stop()
