"""`kvpilot fetch-model`: a real download over HTTP (hf:// through HF_ENDPOINT) and HTTPS (a local
certificate trusted through SSL_CERT_FILE), atomic rename, errors with non-zero exits, no shell."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

KVPILOT = str(Path(sys.executable).parent / "kvpilot")
PAYLOAD = os.urandom(3 << 20) + b"GGUF-end"


class FileServer:
    def __init__(self, tls_dir: Path | None = None):
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                seen.append((self.path, self.headers.get("Authorization")))
                if not self.path.endswith(".gguf"):
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(PAYLOAD)))
                self.end_headers()
                self.wfile.write(PAYLOAD)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls_dir:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tls_dir / "cert.pem", tls_dir / "key.pem")
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def fetch(*args, env=None):
    return subprocess.run([KVPILOT, "fetch-model", *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.timeout(120)
def test_hf_file_through_hf_endpoint_with_token(tmp_path):
    server = FileServer()
    try:
        dest = tmp_path / "models" / "model.Q4_0.gguf"
        r = fetch("hf://org/repo/sub/model.Q4_0.gguf", str(dest), env={"HF_ENDPOINT": f"http://127.0.0.1:{server.port}", "HF_TOKEN": "hf_secret"})
        assert r.returncode == 0, r.stderr
        assert dest.read_bytes() == PAYLOAD and not dest.with_name(dest.name + ".part").exists()
        assert server.seen == [("/org/repo/resolve/main/sub/model.Q4_0.gguf", "Bearer hf_secret")]
        assert "complete" in r.stderr and "hf_secret" not in r.stderr
        missing = fetch("hf://org/repo/nothing.bin", str(tmp_path / "x"), env={"HF_ENDPOINT": f"http://127.0.0.1:{server.port}"})
        assert missing.returncode == 1 and "HTTP 404" in missing.stderr and not (tmp_path / "x").exists()
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_https_file(tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    server = FileServer(tmp_path)
    try:
        dest = tmp_path / "tiny.gguf"
        r = fetch(f"https://127.0.0.1:{server.port}/files/tiny.gguf", str(dest), env={"SSL_CERT_FILE": str(tmp_path / "cert.pem")})
        assert r.returncode == 0, r.stderr
        assert dest.read_bytes() == PAYLOAD
        untrusted = fetch(f"https://127.0.0.1:{server.port}/files/tiny.gguf", str(tmp_path / "y.gguf"))
        assert untrusted.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    finally:
        server.close()


def test_refuses_sources_that_are_not_one_file(tmp_path):
    for bad in ('hf://org/repo/x";id;".gguf', "pvc://claim/model.gguf", "hf://org/repo", "smollm2-135m"):
        r = fetch(bad, str(tmp_path / "out"))
        assert r.returncode in (1, 2) and ("error" in r.stderr or "fail" in r.stderr), (bad, r.stderr)
        assert not (tmp_path / "out").exists()
